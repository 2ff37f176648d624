// `flotilla prepare SOURCES... --tokenizer T --out DIR [--field F] [--workers N] [--skip-bad] [--shard-mb M]`
import { UsageError } from './usage.js';

const PREPARE_USAGE = 'flotilla prepare SOURCES... --tokenizer byte|gpt2|tokenizer.json --out DIR [--field text] [--workers N] [--skip-bad] [--shard-mb 64] [--no-progress]';

interface PrepareArgs {
  sources: string[];
  tokenizer: string;
  out: string;
  field: string;
  workers?: number;
  skipBad: boolean;
  shardMb: number;
  progress: boolean;
}

function parsePrepareArgs(args: readonly string[]): PrepareArgs {
  const sources: string[] = [];
  const vals: Record<string, string> = {};
  let skipBad = false;
  let progress = true;
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    const m = /^--(tokenizer|out|field|workers|shard-mb)(?:=(.*))?$/s.exec(a);
    if (a === '--skip-bad') skipBad = true;
    else if (a === '--no-progress') progress = false;
    else if (m) {
      const v = m[2] ?? args[++i];
      if (v === undefined || v === '') throw new UsageError(`prepare: --${m[1]} needs a value; usage: ${PREPARE_USAGE}`);
      vals[m[1]!] = v;
    } else if (a.startsWith('-')) throw new UsageError(`prepare: unknown option ${a}; usage: ${PREPARE_USAGE}`);
    else sources.push(a);
  }
  if (sources.length === 0) throw new UsageError(`prepare: no sources given; usage: ${PREPARE_USAGE}`);
  if (vals.tokenizer === undefined) throw new UsageError(`prepare: --tokenizer is required ("byte", "gpt2" or a tokenizer.json); usage: ${PREPARE_USAGE}`);
  if (vals.out === undefined) throw new UsageError(`prepare: --out DIR is required; usage: ${PREPARE_USAGE}`);
  const num = (k: string, int: boolean, min: number): number | undefined => {
    const v = vals[k];
    if (v === undefined) return undefined;
    const n = Number(v);
    if (!Number.isFinite(n) || n < min || (int && !Number.isInteger(n))) throw new UsageError(`prepare: --${k} needs ${int ? 'an integer' : 'a number'} >= ${min}, got ${JSON.stringify(v)}`);
    return n;
  };
  const workers = num('workers', true, 0);
  return {
    sources, tokenizer: vals.tokenizer, out: vals.out, field: vals.field ?? 'text', skipBad, progress,
    shardMb: num('shard-mb', false, 0.001) ?? 64, ...(workers !== undefined ? { workers } : {}),
  };
}

export async function prepareCommand(args: readonly string[]): Promise<number> {
  const a = parsePrepareArgs(args);
  const { prepare, PrepareError } = await import('../data/prepare.js');
  try {
    await prepare({ ...a });
  } catch (e) {
    if (e instanceof PrepareError) throw new UsageError((e as Error).message.replace(/^prepare: /, 'prepare: '));
    throw e;
  }
  return 0;
}

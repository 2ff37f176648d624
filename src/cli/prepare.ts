// `flotilla prepare SOURCES... --tokenizer T --out DIR [--field F] [--workers N] [--skip-bad] [--shard-mb M]
//   [--format text|chat|completion|preference] [--chat-template model|chatml|FILE] [--train-on assistant|last|all] [--strict]`
import { UsageError } from './usage.js';

const PREPARE_USAGE = 'flotilla prepare SOURCES... --tokenizer byte|gpt2|tokenizer.json|HF_DIR --out DIR [--field text] [--workers N] [--skip-bad] [--shard-mb 64] [--no-progress] ' +
  '[--format text|chat|completion|preference] [--chat-template model|chatml|FILE.jinja] [--train-on assistant|last|all] [--strict]';

const FORMATS = ['text', 'chat', 'completion', 'preference'] as const;
const TRAIN_ON = ['assistant', 'last', 'all'] as const;

interface PrepareArgs {
  sources: string[];
  tokenizer: string;
  out: string;
  field: string;
  workers?: number;
  skipBad: boolean;
  shardMb: number;
  progress: boolean;
  format: (typeof FORMATS)[number];
  chatTemplate: string;
  trainOn: (typeof TRAIN_ON)[number];
  strict: boolean;
}

function parsePrepareArgs(args: readonly string[]): PrepareArgs {
  const sources: string[] = [];
  const vals: Record<string, string> = {};
  let skipBad = false;
  let progress = true;
  let strict = false;
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    const m = /^--(tokenizer|out|field|workers|shard-mb|format|chat-template|train-on)(?:=(.*))?$/s.exec(a);
    if (a === '--skip-bad') skipBad = true;
    else if (a === '--strict') strict = true;
    else if (a === '--no-progress') progress = false;
    else if (m) {
      const v = m[2] ?? args[++i];
      if (v === undefined || v === '') throw new UsageError(`prepare: --${m[1]} needs a value; usage: ${PREPARE_USAGE}`);
      vals[m[1]!] = v;
    } else if (a.startsWith('-')) throw new UsageError(`prepare: unknown option ${a}; usage: ${PREPARE_USAGE}`);
    else sources.push(a);
  }
  if (sources.length === 0) throw new UsageError(`prepare: no sources given; usage: ${PREPARE_USAGE}`);
  if (vals.tokenizer === undefined) throw new UsageError(`prepare: --tokenizer is required ("byte", "gpt2", a tokenizer.json or a Hugging Face directory); usage: ${PREPARE_USAGE}`);
  if (vals.out === undefined) throw new UsageError(`prepare: --out DIR is required; usage: ${PREPARE_USAGE}`);
  const num = (k: string, int: boolean, min: number): number | undefined => {
    const v = vals[k];
    if (v === undefined) return undefined;
    const n = Number(v);
    if (!Number.isFinite(n) || n < min || (int && !Number.isInteger(n))) throw new UsageError(`prepare: --${k} needs ${int ? 'an integer' : 'a number'} >= ${min}, got ${JSON.stringify(v)}`);
    return n;
  };
  const workers = num('workers', true, 0);
  const choice = <T extends string>(k: string, of: readonly T[], dflt: T): T => {
    const v = vals[k] ?? dflt;
    if (!(of as readonly string[]).includes(v)) throw new UsageError(`prepare: --${k} ${JSON.stringify(v)}: expected ${of.join(', ')}`);
    return v as T;
  };
  const format = choice('format', FORMATS, 'text');
  if (format === 'text' && (vals['chat-template'] !== undefined || vals['train-on'] !== undefined || strict)) {
    throw new UsageError('prepare: --chat-template, --train-on and --strict are for --format chat|completion|preference (one JSON example a line)');
  }
  return {
    sources, tokenizer: vals.tokenizer, out: vals.out, field: vals.field ?? 'text', skipBad, progress,
    format, chatTemplate: vals['chat-template'] ?? '', trainOn: choice('train-on', TRAIN_ON, 'assistant'), strict,
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

// The arguments of `flotilla train` (and of `verify`, which takes the same config, --nproc and
// overrides): parsed here for the command, for `verify` and for the ranks of a training series.
import { UsageError, parseNnodes } from './usage.js';

export interface TrainArgs {
  config: string;
  nproc?: number;
  /** --resume: 'latest' or a checkpoint path. */
  resume?: string;
  /** --max-restarts K (train through the launcher). */
  maxRestarts?: number;
  overrides: string[];
  /** `flotilla verify` sets it: every rank records its steps and final parameters there. */
  record?: string;
  /** `verify` only: steps to compare. */
  steps?: number;
  /** `train --nnodes M ...`: the hosts of the job (flotilla run's options, passed on to the launcher). */
  hosts?: HostArgs;
  /** `train --plan`: train with the layout `flotilla plan` ranks first (as [parallel] auto = true). */
  plan?: boolean;
}

/** Where this host stands in a multi-host `flotilla train` (flotilla run's meaning for each). */
export interface HostArgs {
  nnodes: number;
  /** --nnodes MIN:MAX: carry on without a lost host while MIN remain. */
  minNodes?: number;
  nodeRank: number;
  masterAddr?: string;
  masterPort?: number;
}

const HOST_FLAGS = ['--nnodes', '--node-rank', '--master-addr', '--master-port'] as const;

function parseNproc(v: string | undefined): number {
  if (v === undefined || !/^\d+$/.test(v) || Number(v) < 1) {
    throw new UsageError(`--nproc needs a positive integer, got ${v === undefined ? 'nothing' : JSON.stringify(v)} (e.g. --nproc 2)`);
  }
  return Number(v);
}

/** Splits `train` arguments into the config path, --nproc and the --section.field overrides. */
export function parseTrainArgs(args: readonly string[], command = 'train'): TrainArgs {
  let config: string | undefined;
  let nproc: number | undefined;
  let record: string | undefined;
  let steps: number | undefined;
  let resume: string | undefined;
  let maxRestarts: number | undefined;
  let plan = false;
  const host: Partial<Record<(typeof HOST_FLAGS)[number], string>> = {};
  const overrides: string[] = [];
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    const hostFlag = command === 'train' ? HOST_FLAGS.find((f) => a === f || a.startsWith(`${f}=`)) : undefined;
    if (hostFlag !== undefined) {
      const v = a === hostFlag ? args[++i] : a.slice(hostFlag.length + 1);
      if (v === undefined || v === '') throw new UsageError(`${hostFlag} needs a value`);
      host[hostFlag] = v;
    } else if (a === '--plan' && command === 'train') {
      plan = true;
    } else if (a === '--record' && command === 'train') {
      record = args[++i];
      if (record === undefined) throw new UsageError('--record needs a directory');
    } else if ((a === '--steps' || a.startsWith('--steps=')) && command === 'verify') {
      const v = a === '--steps' ? args[++i] : a.slice('--steps='.length);
      if (v === undefined || !/^\d+$/.test(v) || Number(v) < 1) throw new UsageError(`--steps needs a positive integer, got ${v === undefined ? 'nothing' : JSON.stringify(v)}`);
      steps = Number(v);
    } else if (a === '--resume' || a.startsWith('--resume=')) {
      // The path is optional: `--resume` alone (or followed by another option) means the latest.
      const next = args[i + 1];
      resume = a.startsWith('--resume=') ? a.slice('--resume='.length) || 'latest'
        : next !== undefined && !next.startsWith('--') && !next.endsWith('.toml') ? (i++, next) : 'latest';
    } else if ((a === '--max-restarts' || a.startsWith('--max-restarts=')) && command === 'train') {
      const v = a === '--max-restarts' ? args[++i] : a.slice('--max-restarts='.length);
      if (v === undefined || !/^\d+$/.test(v)) throw new UsageError(`--max-restarts needs a whole number, got ${v === undefined ? 'nothing' : JSON.stringify(v)}`);
      maxRestarts = Number(v);
    } else if (a === '--nproc' || a === '--nproc-per-node') {
      nproc = parseNproc(args[++i]);
    } else if (a.startsWith('--nproc=') || a.startsWith('--nproc-per-node=')) {
      nproc = parseNproc(a.slice(a.indexOf('=') + 1));
    } else if (/^--[A-Za-z0-9_]+\.[A-Za-z0-9_]+=/s.test(a)) {
      overrides.push(a);
    } else if (/^--[A-Za-z0-9_]+\.[A-Za-z0-9_]+$/.test(a)) {
      const v = args[i + 1];
      if (v === undefined || v.startsWith('--')) throw new UsageError(`${a} needs a value: write ${a}=value`);
      overrides.push(`${a}=${v}`);
      i++;
    } else if (a.startsWith('-')) {
      throw new UsageError(`${command}: unknown option ${a}; options are --nproc N${command === 'verify' ? ', --steps K' : ''} and --section.field=value overrides (see flotilla --help)`);
    } else if (config === undefined) {
      config = a;
    } else {
      throw new UsageError(`train: one config file expected, got ${JSON.stringify(config)} and ${JSON.stringify(a)}`);
    }
  }
  if (config === undefined) throw new UsageError('train: missing the config file: flotilla train <config.toml> (e.g. examples/gpt-tiny.toml)');
  const hosts = parseHostArgs(host);
  return { config, overrides, ...(plan ? { plan } : {}), ...(hosts !== undefined ? { hosts } : {}), ...(nproc !== undefined ? { nproc } : {}), ...(resume !== undefined ? { resume } : {}), ...(maxRestarts !== undefined ? { maxRestarts } : {}), ...(record !== undefined ? { record } : {}), ...(steps !== undefined ? { steps } : {}) };
}

/** --nnodes and its companions; undefined for a one-host run. Values are checked again by the launcher. */
function parseHostArgs(h: Partial<Record<(typeof HOST_FLAGS)[number], string>>): HostArgs | undefined {
  const count = (flag: string, v: string, min: number): number => {
    if (!/^\d+$/.test(v) || Number(v) < min) throw new UsageError(`train: ${flag} needs a whole number >= ${min}, got ${JSON.stringify(v)}`);
    return Number(v);
  };
  if (h['--nnodes'] === undefined) {
    const stray = HOST_FLAGS.filter((f) => h[f] !== undefined);
    if (stray.length > 0) throw new UsageError(`train: ${stray.join(', ')} ${stray.length > 1 ? 'go' : 'goes'} with --nnodes M (the hosts of the job)`);
    return undefined;
  }
  const { nnodes, minNodes } = parseNnodes(h['--nnodes'], (m) => new UsageError(`train: ${m}`)); // flotilla run's grammar
  if (nnodes === 1) return undefined;
  // In a Slurm allocation the node's index is SLURM_NODEID ([Note: slurm geometry] in src/launch/slurm.ts checks the rest).
  const slurmNode = process.env.SLURM_NODEID?.trim() || undefined;
  if (h['--node-rank'] === undefined && slurmNode === undefined) throw new UsageError(`train: --nnodes ${nnodes} needs --node-rank R (this host's index, 0..${nnodes - 1})`);
  const nodeRank = count(h['--node-rank'] !== undefined ? '--node-rank' : 'SLURM_NODEID', h['--node-rank'] ?? slurmNode!, 0);
  if (nodeRank >= nnodes) throw new UsageError(`train: --node-rank ${nodeRank} must be below --nnodes ${nnodes}`);
  return {
    nnodes, nodeRank, ...(minNodes !== undefined ? { minNodes } : {}),
    ...(h['--master-addr'] !== undefined ? { masterAddr: h['--master-addr'] } : {}),
    ...(h['--master-port'] !== undefined ? { masterPort: count('--master-port', h['--master-port'], 1) } : {}),
  };
}

/**
 * The layouts of `verify CONFIG --nproc N [overrides] [--and [--nproc M] [overrides]]...`: the first
 * group is the first layout, and each --and group another, with the first group's overrides and its
 * own after them (its --nproc, if given, else the first's).
 */
export function verifyLayouts(args: readonly string[]): { nproc: number; overrides: string[] }[] {
  const groups: string[][] = [[]];
  for (const x of args) {
    if (x === '--and') groups.push([]);
    else groups.at(-1)!.push(x);
  }
  const first = parseTrainArgs(groups[0]!, 'verify');
  const layouts = groups.map((g, i) => {
    if (i === 0) return { nproc: first.nproc, overrides: first.overrides };
    const t = parseTrainArgs([first.config, ...g], 'verify');
    if (t.steps !== undefined) throw new UsageError('verify: --steps applies to every layout; give it before the first --and');
    return { nproc: t.nproc ?? first.nproc, overrides: [...first.overrides, ...t.overrides] };
  });
  return layouts.map(({ nproc, overrides }, i) => {
    if (nproc === undefined || nproc < 2) {
      throw new UsageError(`verify: give ${i === 0 ? 'the layout\'s' : `layout ${i + 1}'s`} rank count with --nproc N (N >= 2), e.g. flotilla verify examples/gpt-tiny.toml --nproc 2 --parallel.zero=3 --and --nproc 4 --parallel.pp=2`);
    }
    return { nproc, overrides };
  });
}

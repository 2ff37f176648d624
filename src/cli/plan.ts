// `flotilla plan CONFIG --nproc N [--nnodes M] [--memory GiB] [--json] [--top K] [--measure K]
// [--rounds K] [--section.field=value ...]`: which layouts the config's model can take on N x M ranks, their
// predicted peak memory per rank and step time, ranked (src/plan). Flags of layout fields pin them.
import { UsageError, parseNnodes } from './usage.js';

export interface PlanArgs {
  config: string;
  nproc: number;
  nnodes: number;
  memoryGiB?: number;
  json: boolean;
  top: number;
  measure: number;
  rounds?: number;
  overrides: string[];
}

export const PLAN_USAGE = 'flotilla plan <config.toml> --nproc N [--nnodes M] [--memory GiB] [--json] [--top K] [--measure K] [--rounds K] [--section.field=value ...]';

export function parsePlanArgs(args: readonly string[]): PlanArgs {
  let config: string | undefined;
  const vals: Record<string, string> = {};
  let json = false;
  const overrides: string[] = [];
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    const m = /^--(nproc|nnodes|memory|top|measure|rounds)(?:=(.*))?$/s.exec(a);
    if (a === '--json') json = true;
    else if (m) {
      const v = m[2] ?? args[++i];
      if (v === undefined || v === '' || v.startsWith('--')) throw new UsageError(`plan: --${m[1]} needs a value (${PLAN_USAGE})`);
      vals[m[1]!] = v;
    } else if (/^--[A-Za-z0-9_]+\.[A-Za-z0-9_]+=/s.test(a)) overrides.push(a);
    else if (/^--[A-Za-z0-9_]+\.[A-Za-z0-9_]+$/.test(a)) {
      const v = args[++i];
      if (v === undefined || v.startsWith('--')) throw new UsageError(`${a} needs a value: write ${a}=value`);
      overrides.push(`${a}=${v}`);
    } else if (a.startsWith('-')) throw new UsageError(`plan: unknown option ${a}; usage: ${PLAN_USAGE}`);
    else if (config === undefined) config = a;
    else throw new UsageError(`plan: one config file expected, got ${JSON.stringify(config)} and ${JSON.stringify(a)}`);
  }
  if (config === undefined) throw new UsageError(`plan: missing the config file: ${PLAN_USAGE} (e.g. flotilla plan examples/gpt-tiny.toml --nproc 2)`);
  const count = (k: string, min: number, what: string): number | undefined => {
    const v = vals[k];
    if (v === undefined) return undefined;
    if (!/^\d+$/.test(v) || Number(v) < min) throw new UsageError(`plan: --${k} needs ${what}, got ${JSON.stringify(v)}`);
    return Number(v);
  };
  const nproc = count('nproc', 1, 'a positive integer (ranks per host)');
  if (nproc === undefined) throw new UsageError(`plan: give the ranks per host with --nproc N, e.g. flotilla plan ${config} --nproc 2`);
  let nnodes = 1;
  if (vals.nnodes !== undefined) {
    const n = parseNnodes(vals.nnodes, (msg) => new UsageError(`plan: ${msg}`));
    if (n.minNodes !== undefined) throw new UsageError(`plan: --nnodes ${vals.nnodes}: plan for one number of hosts (--nnodes ${n.nnodes}); an elastic range is for flotilla train`);
    nnodes = n.nnodes;
  }
  let memoryGiB: number | undefined;
  if (vals.memory !== undefined) {
    memoryGiB = Number(vals.memory);
    if (!/^\d+(\.\d+)?$/.test(vals.memory) || !(memoryGiB > 0)) throw new UsageError(`plan: --memory needs the GiB each rank may use, a positive number (e.g. --memory 2.5), got ${JSON.stringify(vals.memory)}`);
  }
  const measure = count('measure', 0, 'a whole number of layouts to train and measure') ?? 0;
  if (measure > 0 && nnodes > 1) throw new UsageError(`plan: --measure trains on this host only; drop --nnodes ${nnodes} to measure, or --measure to plan for ${nnodes} hosts`);
  const rounds = count('rounds', 1, 'a positive integer (fresh launches per measurement)');
  return { config, nproc, nnodes, json, top: count('top', 1, 'a positive integer (rows to print)') ?? 20, measure, overrides, ...(memoryGiB !== undefined ? { memoryGiB } : {}), ...(rounds !== undefined ? { rounds } : {}) };
}

export async function planCommand(args: readonly string[], print: (line: string) => void, log: (line: string) => void): Promise<number> {
  const a = parsePlanArgs(args);
  const { loadConfig, ConfigError } = await import('../config/index.js');
  const cfg = loadConfig(a.config, a.overrides);
  const { plan, measureTop, formatPlan, planJson } = await import('../plan/plan.js');
  const world = a.nproc * a.nnodes;
  const opts = { config: a.config, overrides: a.overrides, nproc: a.nproc, nnodes: a.nnodes, ...(a.memoryGiB !== undefined ? { memoryGiB: a.memoryGiB } : {}), ...(a.rounds !== undefined ? { rounds: a.rounds } : {}), log };
  const { enumerateLayouts, layoutRefusals } = await import('../plan/enumerate.js');
  const { pinnedFields } = await import('../plan/plan.js');
  if (enumerateLayouts(cfg, world, pinnedFields(a.overrides)).length === 0) {
    // Say why the simplest layout (the config's own, or plain data parallelism) is refused.
    const own = { dp: -1, zero: cfg.parallel.zero, dpShard: cfg.parallel.dpShard, dpReplicate: cfg.parallel.dpReplicate, pp: cfg.parallel.pp, ppSchedule: cfg.parallel.ppSchedule, ppVirtualStages: cfg.parallel.ppVirtualStages,
      tp: cfg.parallel.tp, sequenceParallel: cfg.parallel.sequenceParallel, cp: cfg.parallel.cp, ep: cfg.parallel.ep, microBatches: cfg.data.microBatches, activationCheckpoint: cfg.train.activationCheckpoint, precision: cfg.train.precision };
    const dp = Math.max(1, Math.floor(world / (own.pp * own.tp * own.cp)));
    throw new ConfigError([`no layout of this model runs on ${world} rank(s) with the fields given; the config's own is refused: ${layoutRefusals(cfg, { ...own, dp }, world).join('; ')}`], a.config);
  }
  const r = await plan(cfg, opts);
  if (a.measure > 0) await measureTop(r, opts, a.measure);
  if (a.json) print(JSON.stringify(planJson(r), null, 1));
  else print(formatPlan(cfg, r, a.top, a.config));
  return 0;
}

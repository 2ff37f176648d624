// Every layout a config's model can take on a world, in the config's own field names, each with the
// overrides that make `flotilla train` run it. A candidate is kept only when the project's own
// checks accept it (validateConfig: layoutProblems, the model's shape rules, the batch split; and
// layoutProblems with the world), so the planner never proposes what training would refuse.
import { validateConfig } from '../config/validate.js';
import { layoutProblems } from '../parallel/layout.js';
import { SCHEDULE_NAMES, buildSchedule } from '../parallel/pipeline/schedule.js';
import type { FlotillaConfig } from '../config/schema.js';
import type { PlanLayout } from '../distributed/plan_terms.js';
import type { PlanField } from './terms.js';

export interface Candidate {
  layout: PlanLayout;
  overrides: string[];
}

/** Where each layout field lives in the config. */
export const FIELD_SECTION: Record<keyof PlanLayout, 'parallel' | 'data' | 'train'> = {
  dp: 'parallel', zero: 'parallel', dpShard: 'parallel', dpReplicate: 'parallel', pp: 'parallel', ppSchedule: 'parallel', ppVirtualStages: 'parallel',
  tp: 'parallel', sequenceParallel: 'parallel', cp: 'parallel', ep: 'parallel', microBatches: 'data', activationCheckpoint: 'train', precision: 'train',
};
export const LAYOUT_FIELDS = Object.keys(FIELD_SECTION) as (keyof PlanLayout)[];

const divisors = (n: number): number[] => Array.from({ length: n }, (_, i) => i + 1).filter((d) => n % d === 0);

/** The config with a layout applied (what the overrides do), without parsing. */
export function withLayout(cfg: FlotillaConfig, l: PlanLayout): FlotillaConfig {
  const c = structuredClone(cfg);
  for (const f of LAYOUT_FIELDS) (c[FIELD_SECTION[f]] as unknown as Record<string, unknown>)[f] = l[f];
  if (l.tp === 1) c.parallel.lossParallel = false;
  c.parallel.auto = false;
  if (layoutProblems(c.parallel).some((p) => p.startsWith('parallel.accumulate'))) c.parallel.accumulate = 'auto';
  return c;
}

/** The flags that make `flotilla train CONFIG` run this layout (every layout field, explicitly). */
export function overridesOf(cfg: FlotillaConfig, l: PlanLayout): string[] {
  const c = withLayout(cfg, l);
  const out = LAYOUT_FIELDS.map((f) => `--${FIELD_SECTION[f]}.${f}=${String(l[f])}`);
  if (c.parallel.lossParallel !== cfg.parallel.lossParallel) out.push('--parallel.lossParallel=false');
  if (c.parallel.accumulate !== cfg.parallel.accumulate) out.push('--parallel.accumulate=auto');
  if (cfg.parallel.auto) out.push('--parallel.auto=false');
  return out;
}

/** Why a layout cannot run on this world (empty when it can): the project's own checks. */
export function layoutRefusals(cfg: FlotillaConfig, l: PlanLayout, world: number): string[] {
  const c = withLayout(cfg, l);
  // validateConfig checks the batch split too: the layout's dp is explicit here.
  const p = [...validateConfig(c), ...layoutProblems(c.parallel, world)];
  if (l.pp > 1) {
    try {
      buildSchedule(l.ppSchedule, { pp: l.pp, micro: l.microBatches, ...(l.ppVirtualStages > 1 ? { virtualStages: l.ppVirtualStages } : {}) });
    } catch (e) {
      p.push((e as Error).message);
    }
  }
  return p;
}

/**
 * Every layout of the config's model on `world` ranks that the project's checks accept. `pinned`
 * fields keep the config's value (the flags given to `flotilla plan`). Shapes that change nothing
 * are left out: ZeRO over one rank, hybrid sharding with shards of one, micro-batch counts other
 * than 1, 2, 4, 8 and the config's own.
 */
export function enumerateLayouts(cfg: FlotillaConfig, world: number, pinned: ReadonlySet<PlanField> = new Set()): Candidate[] {
  const pick = <T>(f: PlanField, all: T[], current: T): T[] => (pinned.has(f) ? [current] : all);
  const out: Candidate[] = [];
  const L = cfg.model.nLayer;
  const cur = { ...cfg.parallel, ...cfg.data, ...cfg.train };
  for (const pp of pick('pp', divisors(world).filter((d) => d <= L), cur.pp)) {
    for (const tp of pick('tp', divisors(world / pp), cur.tp)) {
      if ((world / pp) % tp !== 0) continue;
      for (const cp of pick('cp', divisors(world / pp / tp), cur.cp)) {
        if ((world / pp / tp) % cp !== 0) continue;
        const dp = world / (pp * tp * cp);
        const eps = cfg.moe.experts > 0 ? divisors(dp * cp) : [1];
        for (const ep of pick('ep', eps, cur.ep)) {
          for (const zero of pick('zero', [0, 1, 2, 3] as const, cur.zero)) {
            if (zero > 0 && dp * cp === 1 && !pinned.has('zero')) continue;
            const reps = zero === 0 ? [1] : divisors(dp).filter((r) => dp / r > 1 || cp > 1);
            for (const dpReplicate of pick('dpReplicate', reps, cur.dpReplicate)) {
              const dpShard = zero === 0 ? -1 : dp / dpReplicate;
              const scheds: [PlanLayout['ppSchedule'], number][] = pp === 1 ? [[cur.ppSchedule, 1]]
                : SCHEDULE_NAMES.map((s) => [s, s === 'interleaved' ? 2 : 1] as [PlanLayout['ppSchedule'], number]).filter(([s, v]) => s !== 'interleaved' || L >= pp * v);
              for (const [ppSchedule, ppVirtualStages] of pinned.has('ppSchedule') ? scheds.filter(([s]) => s === cur.ppSchedule) : scheds) {
                const micros = [...new Set([1, 2, 4, 8, cfg.data.microBatches])].sort((a, b) => a - b);
                for (const microBatches of pick('microBatches', micros, cur.microBatches)) {
                  for (const sequenceParallel of pick('sequenceParallel', tp > 1 ? [false, true] : [false], cur.sequenceParallel)) {
                    for (const activationCheckpoint of pick('activationCheckpoint', ['none', 'selective', 'full'] as const, cur.activationCheckpoint)) {
                      for (const precision of pick('precision', ['fp32', 'bf16-mixed'] as const, cur.precision)) {
                        const layout: PlanLayout = {
                          dp, zero, dpShard, dpReplicate, pp, ppSchedule, ppVirtualStages: pinned.has('ppVirtualStages') ? cur.ppVirtualStages : ppVirtualStages,
                          tp, sequenceParallel, cp, ep, microBatches, activationCheckpoint, precision,
                        };
                        if (layoutRefusals(cfg, layout, world).length > 0) continue;
                        out.push({ layout, overrides: overridesOf(cfg, layout) });
                      }
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  return out;
}

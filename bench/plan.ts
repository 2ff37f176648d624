// The planner's predictions against measurement: for the demo model (examples/gpt-tiny.toml) and a
// 25M-parameter GPT, on 2 and 4 ranks, a fixed list of layouts is priced by the planner (src/plan,
// what `flotilla plan` does) and each is then trained for a few steps through `flotilla train`
// and measured from outside (what `flotilla plan --measure` does: every rank's VmHWM, the median
// step time). Prints and (--write) puts into docs/BENCHMARKS.md ("plan") per layout the predicted
// and measured peak memory per rank and step time with their errors, and whether the layout ranked
// first was within 10% of the fastest measured. Each (model, world) pair is written as soon as it
// is done, so a long run leaves what it finished.
//   node --import tsx bench/plan.ts [--models tiny,25m] [--worlds 2,4] [--steps 8] [--rounds 3] [--write] [--resume] [--reprice]
// --rounds K: fresh launches per measurement, the median kept, for the planner's calibration and
// for each layout's measurement alike (what `flotilla plan --rounds K --measure` does).
// --resume keeps the pairs already in bench/out/plan.json; --reprice prices them again with the
// current planner and writes the table without training anything.
import { mkdirSync, readFileSync, writeFileSync, existsSync } from 'node:fs';
import { join } from 'node:path';
import { cpus, loadavg } from 'node:os';
import { loadConfig } from '../src/config/index.js';
import { plan, describePlanLayout, type PlanRow } from '../src/plan/plan.js';
import { LAYOUT_FIELDS, FIELD_SECTION, layoutRefusals, overridesOf } from '../src/plan/enumerate.js';
import { MEASURE_STEPS, measureLayout } from '../src/plan/measure.js';
import type { PlanLayout } from '../src/distributed/plan_terms.js';
import { writeSection } from './report.js';

const argv = process.argv.slice(2);
const opt = (name: string, dflt: string): string => {
  const i = argv.indexOf(name);
  return i >= 0 ? argv[i + 1]! : dflt;
};
const models = opt('--models', 'tiny,25m').split(',');
const worlds = opt('--worlds', '2,4').split(',').map(Number);
const steps = Number(opt('--steps', String(MEASURE_STEPS)));
const rounds = Number(opt('--rounds', '3'));
const write = argv.includes('--write');
const reprice = argv.includes('--reprice');
const CONFIG = 'examples/gpt-tiny.toml';
const MODELS: Record<string, { label: string; overrides: string[] }> = {
  tiny: { label: 'the demo GPT (examples/gpt-tiny.toml, 0.94M parameters, global batch 16 x 128)', overrides: [] },
  '25m': { label: 'a 25M-parameter GPT (8 blocks, width 512, 8 heads, BPE-512 vocabulary, global batch 8 x 128)', overrides: ['--model.nLayer=8', '--model.nEmbd=512', '--model.nHead=8', '--data.globalBatch=8', '--parallel.bucketSizeMb=0'] },
};

/** The layouts measured on each world, as flags over the config (everything else as the config has it). */
const LAYOUTS: Record<number, string[][]> = {
  2: [
    [], ['--parallel.zero=1'], ['--parallel.zero=2'], ['--parallel.zero=3'],
    ['--parallel.pp=2', '--parallel.dp=1', '--data.microBatches=4'], ['--parallel.pp=2', '--parallel.dp=1', '--parallel.ppSchedule=zb', '--data.microBatches=4'],
    ['--parallel.pp=2', '--parallel.dp=1', '--parallel.ppSchedule=gpipe', '--data.microBatches=4'],
    ['--parallel.tp=2', '--parallel.dp=1'], ['--parallel.tp=2', '--parallel.dp=1', '--parallel.sequenceParallel=true'],
    ['--train.activationCheckpoint=full'], ['--train.activationCheckpoint=selective'], ['--train.precision=bf16-mixed'],
    ['--parallel.cp=2', '--parallel.dp=1'], ['--parallel.zero=3', '--data.microBatches=2'],
  ],
  4: [
    [], ['--parallel.zero=1'], ['--parallel.zero=3'], ['--parallel.zero=3', '--parallel.dpReplicate=2'],
    ['--parallel.pp=2', '--parallel.dp=2', '--data.microBatches=2'], ['--parallel.pp=2', '--parallel.dp=2', '--parallel.ppSchedule=zb', '--data.microBatches=2'],
    ['--parallel.tp=2', '--parallel.dp=2'], ['--parallel.tp=2', '--parallel.dp=2', '--parallel.sequenceParallel=true'],
    ['--train.activationCheckpoint=full'], ['--train.precision=bf16-mixed'], ['--parallel.cp=2', '--parallel.dp=2'], ['--parallel.zero=2'],
  ],
};

interface Result { model: string; world: number; rows: PlanRow[]; rankedFirst: string; fastest: string; firstVsFastest: number; load?: number[] }
const RESULTS = join('bench', 'out', 'plan.json');
const results: Result[] = existsSync(RESULTS) && argv.includes('--resume') ? JSON.parse(readFileSync(RESULTS, 'utf8')) as Result[] : [];

const pct = (p: number, m: number) => ((p - m) / m) * 100;
const signed = (x: number) => `${x >= 0 ? '+' : ''}${x.toFixed(0)}%`;

// --reprice: the stored measurements priced again by the current planner (its calibrations come from
// the cache); the measured numbers are kept as they were.
if (reprice) {
  for (const res of results) {
    const base = MODELS[res.model]!.overrides;
    const cfg0 = loadConfig(CONFIG, base);
    const candidates = res.rows.map((x) => ({ layout: x.layout, overrides: overridesOf(cfg0, x.layout) }));
    const r = await plan(cfg0, { config: CONFIG, overrides: base, nproc: res.world, nnodes: 1, candidates, log: (l) => console.log(l) });
    for (const row of r.rows) row.measured = res.rows.find((x) => JSON.stringify(x.layout) === JSON.stringify(row.layout))!.measured;
    const first = r.rows.find((x) => x.fits) ?? r.rows[0]!;
    const fastest = r.rows.reduce((a, b) => (b.measured!.stepMs < a.measured!.stepMs ? b : a));
    Object.assign(res, { rows: r.rows, rankedFirst: describePlanLayout(first.layout), fastest: describePlanLayout(fastest.layout), firstVsFastest: pct(first.measured!.stepMs, fastest.measured!.stepMs) });
  }
  writeFileSync(RESULTS.replace(/\.json$/, '-repriced.json'), JSON.stringify(results));
}

for (const model of reprice ? [] : models) {
  for (const world of worlds) {
    if (results.some((r) => r.model === model && r.world === world)) continue;
    const base = MODELS[model]!.overrides;
    const cfg0 = loadConfig(CONFIG, base);
    const candidates = LAYOUTS[world]!.map((flags) => {
      const c = loadConfig(CONFIG, [...base, ...flags]);
      const layout = Object.fromEntries(LAYOUT_FIELDS.map((f) => [f, (c[FIELD_SECTION[f]] as unknown as Record<string, unknown>)[f]])) as unknown as PlanLayout;
      layout.dp = c.parallel.dp === -1 ? world / (layout.pp * layout.tp * layout.cp) : c.parallel.dp;
      layout.dpShard = layout.zero === 0 ? -1 : layout.dp / layout.dpReplicate;
      const refused = layoutRefusals(cfg0, layout, world);
      if (refused.length > 0) throw new Error(`${flags.join(' ')} on ${world}: ${refused.join('; ')}`);
      return { layout, overrides: overridesOf(cfg0, layout) };
    });
    console.log(`== ${model} on ${world} ranks: ${candidates.length} layouts`);
    const r = await plan(cfg0, { config: CONFIG, overrides: base, nproc: world, nnodes: 1, candidates, rounds, log: (l) => console.log(l) });
    const load: number[] = [];
    for (const row of r.rows) {
      load.push(loadavg()[0]!);
      const m = await measureLayout(CONFIG, [...base, ...row.overrides], world, { steps, launches: rounds });
      row.measured = { peakMemoryMiB: Math.max(...m.peakMiB), rankMemoryMiB: m.peakMiB, stepMs: m.stepMs, steps: m.steps, launchMs: m.launchMs };
      console.log(`${describePlanLayout(row.layout).padEnd(34)} memory ${row.peakMemoryMiB.toFixed(0)} vs ${row.measured.peakMemoryMiB.toFixed(0)} MiB (${signed(pct(row.peakMemoryMiB, row.measured.peakMemoryMiB))}), step ${row.stepMs.toFixed(0)} vs ${m.stepMs.toFixed(0)} ms (${signed(pct(row.stepMs, m.stepMs))}) [launches ${m.launchMs.map((s) => s.toFixed(0)).join(' ')}]`);
    }
    const fastest = r.rows.reduce((a, b) => (b.measured!.stepMs < a.measured!.stepMs ? b : a));
    const first = r.rows.find((x) => x.fits) ?? r.rows[0]!;
    results.push({ model, world, rows: r.rows, rankedFirst: describePlanLayout(first.layout), fastest: describePlanLayout(fastest.layout), firstVsFastest: pct(first.measured!.stepMs, fastest.measured!.stepMs), load });
    mkdirSync(join('bench', 'out'), { recursive: true });
    writeFileSync(RESULTS, JSON.stringify(results));
    if (write) writeSection('plan', render());
  }
}
if (write) writeSection(reprice ? 'plan-repriced' : 'plan', render());
console.log(render());

function render(): string {
  const out = [
    reprice ? '### The same measurements priced again by the planner as it is now (`--reprice`)' : '## Layout planner: predicted against measured (`flotilla plan`)',
    '',
    ...(reprice ? ['The measured columns are the table\'s above, unchanged; the predictions are recomputed with the current calibration (measured again where the planner\'s code changed).', ''] : []),
    `\`node --import tsx bench/plan.ts --models ${models.join(',')} --worlds ${worlds.join(',')} --steps ${steps} --rounds ${rounds}${reprice ? ' --resume --reprice' : ''} --write\` — each layout priced by the planner (src/plan; what`,
    `\`flotilla plan CONFIG --nproc N --rounds ${rounds}\` prints), then trained through \`flotilla train --nproc N\` for ${steps} steps in ${rounds} fresh launch(es) and measured from outside (what \`--measure\` does):`,
    'peak memory is the largest VmHWM over the ranks (the prediction is the largest rank\'s), step time the median of the steady steps (the first two, which warm up, and the last, which evaluates, left out), and of the launches the one of median step time',
    '(each launch\'s is listed; the planner\'s calibrations take the median of as many launches).',
    'Errors are (predicted - measured) / measured. The issue\'s bar: memory within 10%, step time within 15%, the layout ranked first within 10% of the fastest measured.',
    '',
  ];
  for (const r of results) {
    const mem = r.rows.map((x) => Math.abs(pct(x.peakMemoryMiB, x.measured!.peakMemoryMiB)));
    const time = r.rows.map((x) => Math.abs(pct(x.stepMs, x.measured!.stepMs)));
    out.push(`${reprice ? '####' : '###'} ${MODELS[r.model]!.label}, ${r.world} ranks`, '');
    out.push('| layout | predicted MiB | measured MiB (per rank) | error | predicted ms | measured ms (each launch) | error |', '|---|---|---|---|---|---|---|');
    for (const x of r.rows) {
      out.push(`| ${describePlanLayout(x.layout)} | ${x.peakMemoryMiB.toFixed(0)} | ${x.measured!.peakMemoryMiB.toFixed(0)} (${x.measured!.rankMemoryMiB.map((v) => v.toFixed(0)).join(', ')}) | ${signed(pct(x.peakMemoryMiB, x.measured!.peakMemoryMiB))} | ${x.stepMs.toFixed(0)} | ${x.measured!.stepMs.toFixed(0)}${x.measured!.launchMs ? ` (${x.measured!.launchMs.map((v) => v.toFixed(0)).join(', ')})` : ''} | ${signed(pct(x.stepMs, x.measured!.stepMs))} |`);
    }
    const within = (xs: number[], b: number) => xs.filter((e) => e <= b).length;
    out.push('', `Memory within 10%: ${within(mem, 10)} of ${mem.length} (largest error ${Math.max(...mem).toFixed(0)}%); step time within 15%: ${within(time, 15)} of ${time.length} (largest ${Math.max(...time).toFixed(0)}%, median ${[...time].sort((a, b) => a - b)[Math.floor(time.length / 2)]!.toFixed(0)}%).`,
      `Ranked first: ${r.rankedFirst}; fastest measured: ${r.fastest}; the first's measured step is ${r.firstVsFastest.toFixed(0)}% slower than the fastest.`,
      ...(r.load ? [`The machine's 1-minute load average when each layout started: ${Math.min(...r.load).toFixed(0)} to ${Math.max(...r.load).toFixed(0)} on ${cpus().length} cores (the run's own ranks count in it).`] : []), '');
  }
  return out.join('\n');
}

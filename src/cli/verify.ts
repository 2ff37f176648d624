// `flotilla verify CONFIG --nproc N [--steps K] [--section.field=value ...]`: trains K steps under the
// config's layout on N ranks and the same K steps in one process on the same global batches, then
// compares each rank's loss and gradient norm per step and every rank's final parameters against
// the single process. It is how a user convinces themselves that a layout trains the same model.
// In float32 the single process runs the op-by-op kernels (`[train] kernels = "eager"`), so a run
// with the fused kernels (the default) has them checked too, under its layout (referenceKernels).
//
// Both runs record into a temporary directory through the trainer's recordDir (per rank: the steps
// as JSON and the full parameters as safetensors); nothing is written to the config's run directory.
import { mkdtempSync, readFileSync, rmSync, existsSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { loadConfig, checkRunnable, ConfigError, type FlotillaConfig } from '../config/index.js';
import { dataParallelDegree, PARALLEL_DEFAULTS } from '../parallel/layout.js';

/** Relative tolerances: float32 training under a different reduction order stays far inside them. */
export const VERIFY_TOLERANCE = { loss: 1e-4, gradNorm: 1e-4, params: 1e-4 };
/**
 * With parallel.reduceDtype = "bf16" the layout's gradients are rounded to bfloat16 in the
 * collective (8 significant bits) and the single process has no collective: a few bf16 ulps.
 */
export const VERIFY_TOLERANCE_BF16_REDUCE = { loss: 5e-3, gradNorm: 2e-2, params: 1e-2 };
/**
 * Tensor parallelism under bf16-mixed sums bfloat16 partial products of the row-parallel layers
 * (each rounded to bfloat16 before the sum, as in Megatron), where one process rounds the whole
 * product once: the same few bf16 ulps as a bf16 reduction.
 */
function toleranceFor(cfg: FlotillaConfig): { tol: typeof VERIFY_TOLERANCE; why?: string } {
  if (cfg.parallel.reduceDtype === 'bf16') return { tol: VERIFY_TOLERANCE_BF16_REDUCE, why: 'parallel.reduceDtype = "bf16"' };
  // ZeRO-3 gathers every parameter in bfloat16 ([Note: bf16 gathers]): its LayerNorm and embedding
  // weights are bfloat16 values upcast, where one process reads them in float32.
  if (cfg.parallel.zero === 3 && cfg.train.precision === 'bf16-mixed') return { tol: VERIFY_TOLERANCE_BF16_REDUCE, why: 'ZeRO-3 gathers LayerNorm and embedding weights in bfloat16' };
  if (cfg.parallel.tp > 1 && cfg.train.precision === 'bf16-mixed') return { tol: VERIFY_TOLERANCE_BF16_REDUCE, why: 'tensor-parallel partial sums in bfloat16' };
  // An ep rank stacks the rows its experts received from every ep rank: bfloat16 GEMMs over stacks
  // of another shape than one process's round differently (float32 ones differ by ~1e-7).
  if (cfg.parallel.ep > 1 && cfg.train.precision === 'bf16-mixed') return { tol: VERIFY_TOLERANCE_BF16_REDUCE, why: 'expert parallelism runs the bfloat16 expert GEMMs on stacks of other shapes' };
  // Ring attention upcasts bfloat16 q, k and v and computes its scores, softmax and sums in float32
  // blocks, where one process multiplies them in bfloat16: more precise, and therefore different.
  if (cfg.parallel.cp > 1 && cfg.train.precision === 'bf16-mixed') return { tol: VERIFY_TOLERANCE_BF16_REDUCE, why: 'ring attention computes its blocks in float32 where one process runs bfloat16 products' };
  return { tol: VERIFY_TOLERANCE };
}

/** One layout to verify: its rank count and its overrides (on top of the config). */
export interface VerifyLayout {
  nproc: number;
  overrides: string[];
}

export interface VerifyArgs {
  config: string;
  steps: number;
  /** The layouts, each compared with the one process that trains its global batches. */
  layouts: VerifyLayout[];
}

interface Record_ {
  rank: number;
  steps: { step: number; loss: number; gradNorm: number }[];
  /** The parameters the rank trains (requiresGrad); the rest are frozen (a LoRA run's base). */
  trained?: string[];
}

/**
 * Overrides that make both runs comparable and keep them out of the user's run directory. Both
 * train `steps` steps: with train.epochs set the steps would be the epochs', so it is set to 0. The
 * loader's rows are one stream over the epochs either way ([Note: example rows] in
 * src/data/example_loader.ts): the runs read the same rows as the first steps of the epochs would.
 */
export function runOverrides(dir: string, steps: number): string[] {
  return [
    `--train.steps=${steps}`, '--train.epochs=0', '--train.evalEvery=0', '--train.evalBatches=1', '--log.progress=off', '--log.metrics=',
    `--train.runDir=${dir}`, '--model.dropout=0', '--lora.dropout=0', '--checkpoint.every=0',
  ];
}

/**
 * The single-process twin of a layout: same global batch and micro-batch size, no parallelism. The
 * settings only ranks use (the backend, the pipeline's schedule) take their defaults, so layouts
 * that differ in them alone share one reference.
 */
function referenceOverrides(cfg: FlotillaConfig, dp: number): string[] {
  return [
    '--parallel.dp=-1', '--parallel.pp=1', '--parallel.zero=0', '--parallel.dpShard=-1', '--parallel.dpReplicate=1', '--parallel.accumulate=auto', '--parallel.tp=1', '--parallel.sequenceParallel=false', '--parallel.lossParallel=false', '--parallel.ep=1', '--parallel.cp=1',
    `--parallel.backend=${PARALLEL_DEFAULTS.backend}`, `--parallel.ppSchedule=${PARALLEL_DEFAULTS.ppSchedule}`, `--parallel.ppVirtualStages=${PARALLEL_DEFAULTS.ppVirtualStages}`,
    `--data.microBatches=${cfg.data.microBatches * dp}`,
    `--train.kernels=${referenceKernels(cfg)}`,
  ];
}

/**
 * In float32 the reference runs op by op, so under `[train] kernels = "fused"` (the default) verify
 * checks the fused kernels and the layout together. Under bf16-mixed it runs the layout's kernels:
 * they accumulate in float32 where the op-by-op path rounds each op to bfloat16, a difference that a
 * few AdamW steps carry past the bfloat16 tolerance of a layout (the kernels' bfloat16 paths are
 * tested against eager on their own, test/kernels_*.test.ts).
 */
function referenceKernels(cfg: FlotillaConfig): FlotillaConfig['train']['kernels'] {
  return cfg.train.precision === 'fp32' ? 'eager' : cfg.train.kernels;
}

function describe(cfg: FlotillaConfig, config: string, steps: number, nproc: number): string {
  const p = cfg.parallel;
  return `verify: ${steps} step(s) of ${config} on ${nproc} ranks (backend ${p.backend}; kernels ${cfg.train.kernels}${referenceKernels(cfg) !== cfg.train.kernels ? `, the one process ${referenceKernels(cfg)}` : ''}; parallel: pp ${p.pp}, tp ${p.tp}${p.sequenceParallel ? ' + sequence parallel' : ''}${p.lossParallel ? ' + loss parallel' : ''}, zero ${p.zero}, dpShard ${p.dpShard}, dpReplicate ${p.dpReplicate}${p.ep > 1 ? `, ep ${p.ep}` : ''}${p.cp > 1 ? `, cp ${p.cp}` : ''}) against one process`;
}

/**
 * Verifies every layout: the layouts of one rank count and backend train one after another in one
 * world (`flotilla train-series`, src/cli/train_run.ts), each distinct one-process reference trains
 * once in this process, then each layout is compared with its reference and printed as a block of
 * its own (its `verify:` line, the table, PASS or FAIL). Exit status 1 if any layout fails.
 */
export async function verifyCommand(a: VerifyArgs, mainScript: string, print: (l: string) => void): Promise<number> {
  const layouts = a.layouts.map((l, i) => {
    const cfg = loadConfig(a.config, l.overrides);
    const problems = checkRunnable(cfg, l.nproc);
    if (problems.length > 0) throw new ConfigError(problems, a.layouts.length > 1 ? `${a.config} (layout ${i + 1}: --nproc ${l.nproc} ${l.overrides.join(' ')})` : a.config);
    return { ...l, cfg, dp: dataParallelDegree(cfg.parallel, l.nproc) }; // the layout's own rule (src/parallel/layout.ts)
  });
  // A .jsonl of examples is prepared once before any rank starts, as `flotilla train` does (a
  // layout's overrides may name other data: each distinct source and its preparation is prepared).
  const { prepareRunData } = await import('./train_run.js');
  const prepared = new Set<string>();
  for (const l of layouts) {
    const d = l.cfg.data;
    const key = JSON.stringify([d.source, d.sources, d.valSource, d.tokenizer, d.format, d.chatTemplate, d.trainOn]);
    if (prepared.has(key)) continue;
    prepared.add(key);
    await prepareRunData(l.cfg, a.config);
  }
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-verify-'));
  try {
    const { writeSeries } = await import('./train_run.js');
    process.env.FLOTILLA_REPORT = '0'; // the ranks' run directories are compared, then deleted: no report.html
    const { runLauncher, parseBackend } = await import('./run.js');
    // One world per rank count and backend (as the launcher resolves it: "auto" trains with "mpi" or "gloo").
    const worlds = new Map<string, number[]>();
    const backendOf = (l: (typeof layouts)[number]) => parseBackend(l.cfg.parallel.backend, 1);
    for (const [i, l] of layouts.entries()) {
      const key = `${l.nproc} ${backendOf(l)}`;
      worlds.set(key, [...(worlds.get(key) ?? []), i]);
    }
    const exitOf = new Map<number, number>();
    for (const [w, members] of [...worlds.values()].entries()) {
      const series = join(dir, `world-${w}.json`);
      writeSeries(series, members.map((i) => [a.config, ...layouts[i]!.overrides, ...runOverrides(join(dir, `run-layout-${i}`), a.steps), '--record', join(dir, `layout-${i}`)]));
      const first = layouts[members[0]!]!;
      const code = await runLauncher(['--nproc', String(first.nproc), '--backend', backendOf(first), mainScript, 'train-series', series]);
      for (const i of members) exitOf.set(i, code);
    }
    // The references: one process on the same global batches, trained once per distinct config.
    const { train } = await import('../train/trainer.js');
    const { resolveExampleSources } = await import('../data/example_source.js');
    const references = new Map<string, string>();
    let failed = 0;
    for (const [i, l] of layouts.entries()) {
      if (a.layouts.length > 1) print('');
      print(describe(l.cfg, a.config, a.steps, l.nproc));
      if (l.cfg.model.dropout > 0) print(`verify: model.dropout=${l.cfg.model.dropout} set to 0 for both runs (dropout draws differ between layouts)`);
      if (l.cfg.train.epochs > 0) print(`verify: train.epochs=${l.cfg.train.epochs} set to 0 for both runs: they train --steps ${a.steps}, the first rows of the epochs`);
      if (l.cfg.lora.rank > 0 && l.cfg.lora.dropout > 0) print(`verify: lora.dropout=${l.cfg.lora.dropout} set to 0 for both runs (data-parallel ranks draw their own rows' masks)`);
      const layoutDir = join(dir, `layout-${i}`);
      if (!existsSync(join(layoutDir, 'rank0.json'))) {
        print(`FAIL: the ${l.nproc}-rank run exited with status ${exitOf.get(i)} before this layout finished`);
        failed++;
        continue;
      }
      const refCfg = loadConfig(a.config, [...l.overrides, ...runOverrides(join(dir, 'run-reference'), a.steps), ...referenceOverrides(l.cfg, l.dp)]);
      const key = JSON.stringify(refCfg);
      let refDir = references.get(key);
      if (refDir === undefined) {
        refDir = join(dir, `reference-${references.size}`);
        resolveExampleSources(refCfg.data); // trained here, as a rank does (trainHere): from the prepared directory
        await train(refCfg, { recordDir: refDir, print: () => {} });
        rmSync(join(dir, 'run-reference'), { recursive: true, force: true });
        references.set(key, refDir);
      }
      if ((await compare(layoutDir, refDir, l.nproc, print, toleranceFor(l.cfg))) !== 0) failed++;
    }
    if (layouts.length > 1) print(`\nverify: ${layouts.length - failed} of ${layouts.length} layouts PASS${failed > 0 ? `, ${failed} FAIL` : ''}`);
    return failed > 0 ? 1 : 0;
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

async function compare(layoutDir: string, refDir: string, nproc: number, print: (l: string) => void, { tol, why }: { tol: typeof VERIFY_TOLERANCE; why?: string }): Promise<number> {
  const { loadSafetensors } = await import('../checkpoint/safetensors.js');
  const { tidy } = await import('../tensor/index.js');
  const read = (d: string, r: number) => JSON.parse(readFileSync(join(d, `rank${r}.json`), 'utf8')) as Record_;
  const ref = read(refDir, 0);
  const ranks = Array.from({ length: nproc }, (_, r) => read(layoutDir, r));
  const rel = (a: number, b: number) => Math.abs(a - b) / Math.max(Math.abs(b), 1e-12);
  let ok = true;
  print('step  loss (1 process)  max |Δloss| rel  grad norm (1 process)  max |Δnorm| rel');
  for (const [i, s] of ref.steps.entries()) {
    const dl = Math.max(...ranks.map((r) => rel(r.steps[i]!.loss, s.loss)));
    const dn = Math.max(...ranks.map((r) => rel(r.steps[i]!.gradNorm, s.gradNorm)));
    if (!(dl <= tol.loss) || !(dn <= tol.gradNorm)) ok = false;
    print(`${String(s.step).padStart(4)}  ${s.loss.toFixed(6).padStart(16)}  ${dl.toExponential(2).padStart(15)}  ${s.gradNorm.toFixed(6).padStart(21)}  ${dn.toExponential(2).padStart(15)}`);
  }
  // Parameters: every rank's copy (a pipeline rank holds its stages) against the single process:
  // ||Δθ|| / ||θ|| over all the tensors a rank holds decides; the worst single tensor is shown. With
  // frozen parameters (a LoRA run) the trained ones are also measured on their own: a large frozen
  // base in the same norm would hide a wrong adapter, and a frozen one must not move at all.
  const refParams = loadSafetensors(join(refDir, 'rank0.safetensors'));
  const trained = ref.trained && ref.trained.length < Object.keys(refParams).length ? new Set(ref.trained) : undefined;
  let worstRank = 0, worstTrained = 0, frozenMoved = 0;
  let worstTensor = 0;
  let where = 'every tensor equal';
  for (let r = 0; r < nproc; r++) {
    const file = join(layoutDir, `rank${r}.safetensors`);
    if (!existsSync(file)) {
      print(`FAIL: rank ${r} saved no parameters`);
      return 1;
    }
    const mine = loadSafetensors(file);
    let d2 = 0, n2 = 0, td2 = 0, tn2 = 0;
    for (const [name, t] of Object.entries(mine)) {
      const b = refParams[name];
      if (!b) {
        print(`FAIL: rank ${r} holds '${name}', which the single-process model does not have`);
        return 1;
      }
      const [dd, nn] = tidy(() => {
        const b64 = b.to('float64');
        return [t.to('float64').sub(b64).pow(2).sum().item(), b64.pow(2).sum().item()];
      });
      d2 += dd;
      n2 += nn;
      if (trained?.has(name)) [td2, tn2] = [td2 + dd, tn2 + nn];
      else if (trained && dd > 0) frozenMoved++;
      const d = Math.sqrt(dd / Math.max(nn, 1e-24));
      if (d > worstTensor) [worstTensor, where] = [d, `rank ${r}, ${name}`];
    }
    const d = Math.sqrt(d2 / Math.max(n2, 1e-24));
    if (!(d <= worstRank)) worstRank = d;
    const td = Math.sqrt(td2 / Math.max(tn2, 1e-24));
    if (!(td <= worstTrained)) worstTrained = td;
  }
  if (!(worstRank <= tol.params)) ok = false;
  print(`max parameter difference ||Δθ|| / ||θ|| over a rank's parameters: ${worstRank.toExponential(2)}; worst tensor ${worstTensor.toExponential(2)} (${where})`);
  if (trained) {
    if (!(worstTrained <= tol.params) || frozenMoved > 0) ok = false;
    print(`trained parameters alone (${trained.size} tensors): ${worstTrained.toExponential(2)}; frozen tensors that differ from the single process: ${frozenMoved}`);
  }
  print(
    `${ok ? 'PASS' : 'FAIL'} (tolerance: loss ${tol.loss}, grad norm ${tol.gradNorm}, parameters ${tol.params}, all relative${why ? `; ${why}` : ''})`,
  );
  return ok ? 0 : 1;
}

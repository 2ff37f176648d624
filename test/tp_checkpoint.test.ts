// Checkpoints of tensor-parallel runs, with real ranks: a tp=2 run (sequence parallel) saves its
// weight slices and optimizer state at step 3, resumes itself bit-identically, and its checkpoint
// resumes in one process and under ZeRO-3 with one process's numbers; a one-process checkpoint
// resumes under tp=2 x pp=2 with loss parallelism. The test model divides by 2 (vocabulary 260,
// width 32, 2 heads), since tensor parallelism needs that.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { checkpointOf, runOf, same, train, trainSeries, withoutNproc, work, type RunResult } from './helpers/ckpt_runs.js';
import { pool, started } from './helpers/pool.js';

// Op-by-op kernels: these float32 runs compare parameters per tensor at 1e-4 after six AdamW steps,
// and a tp head without loss parallelism makes logits where one process's fused loss starts from the
// hidden state; that rounding, carried by AdamW, reached 1.03e-4 on a bias. The fused kernels under
// tp + sp are compared with one process in float64 (test/kernels_fused_layouts.test.ts).
const MODEL = ['--model.vocabSize=260', '--model.nEmbd=32', '--model.nHead=2', '--train.kernels=eager'];
const TP2 = ['--nproc', '2', '--parallel.tp=2', '--parallel.sequenceParallel=true', '--data.microBatches=2'];

// The 2-rank runs train in one world (flotilla train-series): tp=2, its resume under itself, and its
// checkpoint under ZeRO-3; beside it the one-process reference; then the resumes that need both.
// Each test awaits the runs it compares.
const launch = pool();
const series = (nproc: number, runs: { name: string; extra: string[] }[]): Promise<RunResult[]> => started(launch(() => trainSeries(nproc, runs)));
const step3 = (name: string): string => join(work, name, 'checkpoints', 'step-000003');

const reference = runOf(series(1, [{ name: 'tp-ref', extra: MODEL }]), 0);
const world2 = series(2, [
  { name: 'tp2', extra: [...MODEL, ...withoutNproc(TP2)] },
  { name: 'tp2-self', extra: [...MODEL, ...withoutNproc(TP2), '--resume', step3('tp2')] },
  { name: 'tp2-into-zero3', extra: [...MODEL, '--parallel.zero=3', '--resume', step3('tp2')] },
]);
const [tp2, tp2Self, tp2IntoZero3] = [0, 1, 2].map((i) => runOf(world2, i)) as [Promise<RunResult>, Promise<RunResult>, Promise<RunResult>];
const tp2IntoOne = started(world2.then(() => launch(() => train('tp2-into-one', [...MODEL, '--resume', step3('tp2')]))));
const tp2Into = [['one', tp2IntoOne], ['zero3', tp2IntoZero3]] as const;
const oneIntoTp2pp2 = started(reference.then(() => launch(() => train('one-into-tp2pp2', [...MODEL, '--nproc', '4', '--parallel.tp=2', '--parallel.pp=2', '--parallel.lossParallel=true', '--data.microBatches=2', '--resume', step3('tp-ref')]))));

test('tp=2 with sequence parallelism trains like one process and resumes itself bit-identically', async () => {
  const ref = await reference;
  const tp = await tp2;
  same(tp, ref, 1, 1e-5, 'tp=2 vs one process');
  // The row-parallel weights' column slices are strided pieces, not one piece per row.
  const meta = JSON.parse(readFileSync(join(checkpointOf(tp, 3), 'meta.json'), 'utf8')) as { pieces: { name: string; runs?: { count: number } }[] };
  const proj = meta.pieces.filter((p) => p.name === 'layers.0.mlp.proj.weight');
  assert.ok(proj.length <= 6 && proj.some((p) => (p.runs?.count ?? 1) === 32), `mlp.proj.weight pieces: ${JSON.stringify(proj)}`);
  const self = await tp2Self;
  assert.match(self.out, /saved by 2 rank\(s\), tensor parallel 2 \+ sequence parallel/);
  same(self, tp, 4, 0, 'tp=2 resumed under tp=2');
});

test('a tp=2 checkpoint resumes in one process and under ZeRO-3 on 2 ranks with one process\'s numbers', async () => {
  for (const [slug, run] of tp2Into) {
    same(await run, await reference, 4, 1e-5, `tp=2 checkpoint resumed as ${slug}`);
  }
});

test('a one-process checkpoint resumes under tp=2 x pp=2 with loss parallelism', async () => {
  const r = await oneIntoTp2pp2;
  assert.match(r.out, /tensor parallel 2 \+ loss parallel/);
  same(r, await reference, 4, 1e-5, 'one-process checkpoint resumed under tp=2 x pp=2');
});

// One rank of the checkpoint benchmark: for each model size and ZeRO stage, two training steps
// (so AdamW has state), then blocking saves, background saves (the time the caller is blocked,
// and the time until the checkpoint is published), a load of the same checkpoint, and the bytes
// this rank wrote. Prints one JSON line.
import { mkdtempSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import * as ft from '../src/tensor/index.js';
import { GPT, type GPTConfig } from '../src/models/gpt.js';
import { gptUnits } from '../src/models/gpt_parallel.js';
import { AdamW } from '../src/optim/index.js';
import { initProcessGroup, destroyProcessGroup } from '../src/distributed/process_group.js';
import { DataParallel, type ZeroStage } from '../src/parallel/data_parallel/data_parallel.js';
import { placementsOf } from '../src/parallel/placement.js';
import { layoutFor } from '../src/parallel/layout.js';
import { Checkpointer, loadCheckpoint } from '../src/checkpoint/checkpoint.js';

const { models, stages, saves } = JSON.parse(process.argv[2] ?? '{}') as { models: Record<string, Partial<GPTConfig>>; stages: ZeroStage[]; saves: number };
ft.setNumThreads(1);
const world = initProcessGroup();
const out: Record<string, unknown> = { rank: world.rank };
const root = world.rank === 0 ? mkdtempSync(join(tmpdir(), 'flotilla-bench-ckpt-')) : '';
const info = { layout: { worldSize: world.size, description: '', ...layoutFor({}, world.size) }, config: {}, data: { step: 0, micro: 0, seed: 0, globalBatch: 8, seqLen: 128 }, rng: { kind: 'seed-per-step' as const, seed: 0 }, schedule: { step: 0 } };
// Every rank learns rank 0's directory through a broadcast of its bytes.
const dirT = ft.zeros([256], { dtype: 'uint8' });
if (world.rank === 0) ft.noGrad(() => dirT.narrow(0, 0, root.length).copy_(ft.tensor(Uint8Array.from(Buffer.from(root)), { dtype: 'uint8' })));
world.broadcast(dirT, 0).wait();
const dir = Buffer.from(Uint8Array.from(dirT.toNumbers())).toString().replace(/\0+$/, '');
for (const [size, cfg] of Object.entries(models)) {
  for (const zero of stages) {
    const model = new GPT({ vocabSize: 256, blockSize: 128, dropout: 0, bias: true, ...cfg }, { initSeed: 0 });
    const dp = new DataParallel(model, { group: world, zero, bucketSizeMb: 2, units: gptUnits });
    const opt = new AdamW(model.parameters(), { lr: 1e-4 }, { grads: dp });
    const x = ft.randint(0, 256, [4, 128]);
    const y = ft.randint(0, 256, [4, 128]);
    const step = () => ft.tidy(() => {
      opt.zeroGrad();
      dp.forward(x, y).loss!.backward();
      dp.finishGradSync();
      opt.step();
    });
    for (let i = 0; i < 2; i++) step();
    dp.waitParams();
    const state = { placements: placementsOf(model.namedParameters(), { dp }), optimizer: opt };
    const r: Record<string, number[]> = { blocking: [], asyncBlocked: [], asyncPublished: [], load: [], bytes: [], stepMs: [], stepWithSaveMs: [] };
    for (const mode of ['blocking', 'async'] as const) {
      const ck = new Checkpointer({ dir: join(dir, `${size}-z${zero}-${mode}`), keep: 2, async: mode === 'async', world });
      for (let k = 1; k <= saves; k++) {
        world.barrier().wait();
        const t0 = performance.now();
        const rep = await ck.save(k, state, info);
        if (mode === 'blocking') r.blocking!.push(rep.blockedMs);
        else {
          r.asyncBlocked!.push(rep.blockedMs);
          // Training continues while the writer works: time a step now, then wait for publication.
          const s0 = performance.now();
          step();
          r.stepWithSaveMs!.push(performance.now() - s0);
          await ck.finishPending();
          r.asyncPublished!.push(performance.now() - t0);
          const s1 = performance.now();
          step();
          r.stepMs!.push(performance.now() - s1);
          dp.waitParams();
        }
      }
      await ck.close();
      if (mode === 'blocking') {
        world.barrier().wait(); // rank 0 publishes (renames into place) after the others return
        const ckpt = join(dir, `${size}-z${zero}-${mode}`, `step-${String(saves).padStart(6, '0')}`);
        r.bytes!.push(statSync(join(ckpt, `rank-${String(world.rank).padStart(5, '0')}.safetensors`)).size);
        for (let k = 0; k < 2; k++) {
          world.barrier().wait();
          const t0 = performance.now();
          loadCheckpoint(ckpt, state.placements, { optimizer: opt });
          r.load!.push(performance.now() - t0);
        }
      }
    }
    out[`${size}-zero${zero}`] = { ...r, numParams: model.numParams() };
    dp.dispose();
    opt.dispose();
    model.dispose();
  }
}
world.barrier().wait();
if (world.rank === 0) rmSync(dir, { recursive: true, force: true });
process.stdout.write(`BENCH ${JSON.stringify(out)}\n`);
destroyProcessGroup();

// Activation memory with `full` checkpointing, measured from outside the process: peak resident
// memory (VmHWM in /proc/<pid>/status) of a child that trains 3 steps of an 8-layer GPT
// (width 256, batch 8 x 128, float32), minus the peak of the same model at batch 1 x 8 (parameters,
// gradients, optimizer state and the runtime). The target is at most 1/3 of the activation memory
// without checkpointing. All three children run with the default allocator, the tensor cache
// ([Note: allocator tuning]): freed blocks are kept for the next step, by size class, so what stays
// resident follows what a step holds. This machine measured 0.20-0.24 (FLOTILLA_MALLOC=lean, which keeps
// nothing: 0.17-0.20; FLOTILLA_MALLOC=tuned, malloc's fragmented heap: 0.42-0.54).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { procStatusBytes } from '../src/io/proc_status.js';
import { REPO_ROOT } from './helpers/world.js';
import { withoutAllocatorSettings } from '../src/tensor/allocator.js';

function peakMiB(o: object): Promise<number> {
  return new Promise((resolve, reject) => {
    const env = withoutAllocatorSettings(process.env); // the default allocator whatever this process's environment says
    const c = spawn(process.execPath, ['--import', 'tsx', 'bench/precision_child.ts', JSON.stringify(o)], { cwd: REPO_ROOT, stdio: ['pipe', 'pipe', 'pipe'], env });
    let err = '';
    c.stderr.on('data', (d: Buffer) => (err += d.toString()));
    c.stdout.on('data', (d: Buffer) => {
      if (!d.toString().includes('done')) return;
      const hwm = procStatusBytes(c.pid!)!.VmHWM!;
      c.stdin.end();
      resolve(hwm / 2 ** 20);
    });
    c.on('exit', (code) => { if (code !== 0) reject(new Error(`child exited ${code}: ${err}`)); });
  });
}

test('activation_checkpoint_full: nLayer=8 keeps at most 1/3 of the activation memory of no checkpointing (peak RSS from outside)', { skip: process.platform !== 'linux' ? 'needs /proc' : false }, async () => {
  const model = { nLayer: 8, nEmbd: 256, precision: 'fp32', steps: 3 };
  const base = await peakMiB({ ...model, batch: 1, seq: 8, ac: 'none' });
  const none = await peakMiB({ ...model, batch: 8, seq: 128, ac: 'none' });
  const full = await peakMiB({ ...model, batch: 8, seq: 128, ac: 'full' });
  const ratio = (full - base) / (none - base);
  console.log(`activation memory: none ${(none - base).toFixed(1)} MiB, full ${(full - base).toFixed(1)} MiB, ratio ${ratio.toFixed(3)}`);
  assert.ok(none - base > 100, `without checkpointing the activations should be large (${(none - base).toFixed(1)} MiB)`);
  assert.ok(ratio <= 1 / 3, `full checkpointing keeps ${ratio.toFixed(3)} of the activation memory (the target is at most 1/3)`);
});

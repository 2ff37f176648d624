// Consolidation: one safetensors file of the whole model, under the parameter names, readable by
// PyTorch's and Hugging Face's safetensors loaders, with the model config in its metadata.
import { tidy, zeros, type Tensor } from '../tensor/index.js';
import { saveSafetensors } from './safetensors.js';
import { readMeta, numelOf, type CheckpointMeta } from './format.js';
import { loadCheckpoint } from './checkpoint.js';
import { resolveCheckpoint } from './format.js';
import type { ParamPlacement } from '../parallel/placement.js';

/** Every parameter of a checkpoint as one full tensor, in one process (reads only parameter pieces). */
export function consolidate(arg: string): { meta: CheckpointMeta; tensors: Record<string, Tensor> } {
  const dir = resolveCheckpoint(arg);
  const meta = readMeta(dir);
  const tensors: Record<string, Tensor> = {};
  const placements: ParamPlacement[] = Object.entries(meta.params).map(([name, info]) => {
    const t = zeros(info.shape, { dtype: info.dtype });
    tensors[name] = t;
    const all = { offset: 0, numel: numelOf(info.shape) };
    return { name, param: t, shape: info.shape, dtype: info.dtype, held: all, stateHeld: all, writes: all, values: () => t.view(-1) };
  });
  try {
    tidy(() => loadCheckpoint(dir, placements));
  } catch (e) {
    for (const t of Object.values(tensors)) t.dispose();
    throw e;
  }
  return { meta, tensors };
}

/** A checkpoint's [model] section, with its [moe] section as `moe` when it has experts. */
export function withMoE(config: Record<string, Record<string, unknown> | undefined>): Record<string, unknown> {
  const moe = config.moe;
  return { ...(config.model ?? {}), ...(moe && Number(moe.experts) > 0 ? { moe } : {}) };
}

/** Writes the checkpoint's parameters to `out` (atomically); returns what it wrote. */
export function exportCheckpoint(arg: string, out: string): { step: number; params: number; elements: number; out: string } {
  const { meta, tensors } = consolidate(arg);
  try {
    const names = Object.keys(tensors).sort();
    const ordered: Record<string, Tensor> = {};
    for (const n of names) ordered[n] = tensors[n]!;
    saveSafetensors(out, ordered, {
      format: 'pt',
      // The [moe] section rides along inside the model's config: an MoE model needs it to be built.
      'flotilla.model': JSON.stringify(withMoE(meta.config)),
      'flotilla.step': String(meta.step),
      'flotilla.data': JSON.stringify({ tokenizer: (meta.config.data as Record<string, unknown> | undefined)?.tokenizer ?? 'byte' }),
    });
    return { step: meta.step, params: names.length, elements: names.reduce((a, n) => a + tensors[n]!.numel(), 0), out };
  } finally {
    for (const t of Object.values(tensors)) t.dispose();
  }
}

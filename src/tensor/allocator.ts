// [Note: allocator tuning]
// libtorch allocates CPU tensors with malloc. glibc serves a large block from its heap or from a fresh
// mmap, and hands freed memory back to the OS once more than a threshold sits free at the heap's top.
// A training step frees its activations in large runs (a scope's end, a backward pass), so with
// glibc's defaults a flotilla process gave most of a step's memory back and faulted it in again, zeroed
// page by page, in the next step: 7,400 page faults per step of the benchmark GPT against PyTorch's
// 900, and a backward pass 3-5% slower. Keeping freed memory for reuse, as PyTorch's own GPU allocator
// does, removes them: blocks up to 32 MiB (glibc's own ceiling for this threshold) come from the heap,
// and up to 512 MiB may stay free at its top. The resident size then stays near a step's peak, which
// the next step needs again (at the end of a run, releaseFreedMemory in native.ts hands it back).
// Buffers that ZeRO allocates and frees around every use live on mapped pages instead
// (emptyMapped, [Note: mapped storage] in native/tensor.cc), so they never leave holes here that
// only smaller tensors could fill. A user's own malloc settings (MALLOC_*_ environment variables or
// glibc.malloc tunables) win; FLOTILLA_MALLOC=default keeps glibc's defaults.
//
// FLOTILLA_MALLOC=lean sets LEAN_MALLOC_OPTIONS instead: blocks from 256 KiB get mappings of their
// own, unmapped when freed, and at most 1 MiB stays free at the heap's top, so the resident size
// follows what the process holds. It is for measuring memory, or for a run that must fit: with the
// tuned settings a checkpointed 8-block GPT keeps 0.42-0.54 of the activation memory of the same
// model without checkpointing resident (freed activations stay in the heap, fragmented), with lean
// ones 0.17-0.20; but a checkpointed training run spent about 2.5x the CPU time under lean settings
// (page faults and zeroing on every large allocation), so no run switches by itself.

export const MALLOC_OPTIONS = { mmapThreshold: 32 * 2 ** 20, trimThreshold: 512 * 2 ** 20 } as const;
export const LEAN_MALLOC_OPTIONS = { mmapThreshold: 256 * 2 ** 10, trimThreshold: 2 ** 20 } as const;

/** tuned: flotilla sets MALLOC_OPTIONS, or LEAN_MALLOC_OPTIONS when lean. */
export type AllocatorChoice = { tuned: true; lean?: true } | { tuned: false; why: string };

/** Whether this process should set MALLOC_OPTIONS, given its environment; pure, for tests. */
export function allocatorChoice(env: NodeJS.ProcessEnv): AllocatorChoice {
  const mode = env.FLOTILLA_MALLOC?.trim() || 'tuned';
  if (mode !== 'tuned' && mode !== 'default' && mode !== 'lean') {
    throw new Error(`FLOTILLA_MALLOC must be "tuned", "lean" or "default", not "${mode}"`);
  }
  if (mode === 'default') return { tuned: false, why: 'FLOTILLA_MALLOC=default' };
  const own = Object.keys(env).filter((k) => /^MALLOC_\w+_$/.test(k));
  if (own.length > 0) return { tuned: false, why: `${own.join(', ')} set` };
  if (/glibc\.malloc\./.test(env.GLIBC_TUNABLES ?? '')) return { tuned: false, why: 'glibc.malloc tunables set' };
  return mode === 'lean' ? { tuned: true, lean: true } : { tuned: true };
}

/** Applies the choice through set (the addon's mallopt, once, when the addon loads). */
export function tuneAllocator(set: (mmapThreshold: number, trimThreshold: number) => boolean): AllocatorChoice {
  const choice = allocatorChoice(process.env);
  const o = choice.tuned && choice.lean ? LEAN_MALLOC_OPTIONS : MALLOC_OPTIONS;
  if (choice.tuned && !set(o.mmapThreshold, o.trimThreshold)) return { tuned: false, why: 'not glibc' };
  return choice;
}


// [Note: allocator tuning]
// libtorch allocates CPU tensors with malloc. glibc serves a large block from its heap or from a fresh
// mmap, and hands freed memory back to the OS once more than a threshold sits free at the heap's top.
// A training step frees its activations in large runs (a scope's end, a backward pass), so with
// glibc's defaults a flotilla process gave most of a step's memory back and faulted it in again, zeroed
// page by page, in the next step: 7,400 page faults per step of the benchmark GPT against PyTorch's
// 900, and a backward pass 3-5% slower. Keeping freed memory in malloc's heap (`tuned`: blocks up to
// 32 MiB from the heap, up to 512 MiB free at its top) removed the faults, but the heap fragments: a
// checkpointed 8-block GPT kept 0.42-0.54 of the activation memory of the same model without
// checkpointing resident, where it holds 0.17-0.20.
//
// So by default (`cache`) tensor storage from TENSOR_CACHE.minBytes up comes from the tensor cache
// ([Note: tensor cache] in native/tensor_cache.cc): every block a mapping of its own, kept when freed
// for the next request of its size class (or one up to half its size, which gets the block cut to its
// class and the rest unmapped), as PyTorch's GPU allocator keeps its blocks. A step reuses the blocks
// of the step before (no faults), and the resident size follows the sizes a step holds at once, not the
// heap's history. After every step the trainer calls releaseIdleMemory (native.ts), which unmaps the
// blocks no request took since its previous call: construction's leftovers, an evaluation batch's.
// Freed blocks beyond the cap (1/8 of physical memory, as a machine runs several ranks) are unmapped
// oldest first in any case. Smaller tensors stay with malloc, tuned as above. At the end of a run
// releaseFreedMemory empties the cache and trims the heap. What the cache cannot do is lend a block
// kept from one phase to another of other sizes (weight gradients of backward to activations of
// forward), as a heap does: a width-512 step keeps 40-50 MiB more resident than lean settings would,
// still less than `tuned`. Buffers that ZeRO allocates and frees around every use live on mapped pages
// of their own (emptyMapped, [Note: mapped storage] in native/tensor.cc), unmapped at once when freed.
//
// FLOTILLA_MALLOC picks another mode: `tuned` (malloc only, thresholds as above), `lean` (malloc
// only, LEAN_MALLOC_OPTIONS: blocks from 256 KiB get mappings of their own, unmapped when freed, so the
// resident size is what the process holds, at about 2.5x the CPU time of a checkpointed run in page
// faults and zeroing), or `default` (glibc's own settings, no cache). A user's own malloc settings
// (MALLOC_*_ environment variables or glibc.malloc tunables) win over every mode.
import { totalmem } from 'node:os';

export const MALLOC_OPTIONS = { mmapThreshold: 32 * 2 ** 20, trimThreshold: 512 * 2 ** 20 } as const;
const LEAN_MALLOC_OPTIONS = { mmapThreshold: 256 * 2 ** 10, trimThreshold: 2 ** 20 } as const;
export const TENSOR_CACHE = { minBytes: 256 * 2 ** 10, capBytes: Math.floor(totalmem() / 8) } as const;

export type AllocatorMode = 'cache' | 'tuned' | 'lean';
/** What this process runs with: a flotilla mode, or glibc's own settings and why. */
export type AllocatorChoice = { mode: AllocatorMode } | { mode: 'default'; why: string };

export interface TensorCacheStats {
  on: boolean;
  /** bytes of blocks handed out, and of freed blocks kept */
  liveBytes: number;
  cachedBytes: number;
  /** requests served by a kept block, by a new mapping; blocks unmapped from the cache */
  hits: number;
  misses: number;
  evictions: number;
}

/** The allocator mode for this environment; pure, for tests. */
export function allocatorChoice(env: NodeJS.ProcessEnv): AllocatorChoice {
  const mode = env.FLOTILLA_MALLOC?.trim() || 'cache';
  if (mode !== 'cache' && mode !== 'tuned' && mode !== 'default' && mode !== 'lean') {
    throw new Error(`FLOTILLA_MALLOC must be "cache", "tuned", "lean" or "default", not "${mode}"`);
  }
  if (mode === 'default') return { mode, why: 'FLOTILLA_MALLOC=default' };
  const own = Object.keys(env).filter((k) => /^MALLOC_\w+_$/.test(k));
  if (own.length > 0) return { mode: 'default', why: `${own.join(', ')} set` };
  if (/glibc\.malloc\./.test(env.GLIBC_TUNABLES ?? '')) return { mode: 'default', why: 'glibc.malloc tunables set' };
  return { mode };
}

/** env without the variables allocatorChoice reads: a child started with it runs the default mode. */
export function withoutAllocatorSettings(env: NodeJS.ProcessEnv): NodeJS.ProcessEnv {
  return Object.fromEntries(Object.entries(env).filter(([k]) => !/^MALLOC_\w+_$|^GLIBC_TUNABLES$|^FLOTILLA_MALLOC$/.test(k)));
}

/**
 * Applies the choice once, when the addon loads: setMalloc is the addon's mallopt, setCache its tensor
 * cache. Where the C library is not glibc, malloc keeps its settings and the cache still runs.
 */
export function tuneAllocator(setMalloc: (mmapThreshold: number, trimThreshold: number) => void, setCache: (minBytes: number, capBytes: number) => void): AllocatorChoice {
  const choice = allocatorChoice(process.env);
  if (choice.mode === 'default') return choice;
  const o = choice.mode === 'lean' ? LEAN_MALLOC_OPTIONS : MALLOC_OPTIONS;
  setMalloc(o.mmapThreshold, o.trimThreshold);
  if (choice.mode === 'cache') setCache(TENSOR_CACHE.minBytes, TENSOR_CACHE.capBytes);
  return choice;
}

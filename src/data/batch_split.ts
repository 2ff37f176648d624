// The rule on the global batch's split, stated once: the config's validation, the launcher's and
// every rank's check before starting, the planner (through the validation) and the data loader
// call it. No imports, so checking a config loads nothing.

/**
 * Each of `dp` data-parallel ranks reads globalBatch / dp samples per step, in `microBatches` equal
 * micro-batches, so globalBatch must be a multiple of dp x microBatches. Returns the problem, naming
 * the fix, or undefined when the batch splits. `words`: 'world' when dp is resolved for a world;
 * 'config' when it is parallel.dp as written, where -1 (the world decides) checks the micro-batches only.
 */
export function globalBatchProblem(s: { globalBatch: number; microBatches: number; dp: number }, words: 'world' | 'config' = 'world'): string | undefined {
  const known = s.dp > 0;
  const parts = s.microBatches * (known ? s.dp : 1);
  if (s.globalBatch % parts === 0) return undefined;
  if (words === 'config') {
    const by = known ? `parallel.dp x data.microBatches (${s.dp} x ${s.microBatches} = ${parts})` : `data.microBatches (${parts})`;
    return `data.globalBatch (${s.globalBatch}) must be a multiple of ${by}`;
  }
  const lower = Math.floor(s.globalBatch / parts) * parts;
  return `data.globalBatch=${s.globalBatch} does not split over ${s.dp} data-parallel rank(s) x ${s.microBatches} micro-batch(es) = ${parts} equal parts; ` +
    `set data.globalBatch to a multiple of ${parts} (e.g. ${lower > 0 ? `${lower} or ` : ''}${lower + parts}) or change data.microBatches`;
}

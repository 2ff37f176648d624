// The prefetch worker (src/data/prefetch.ts): fills ring slots with the batches it is asked for.
import { parentPort, workerData } from 'node:worker_threads';
import { TokenCorpus } from './corpus_files.js';
import { Sampler } from './sampler.js';
import { ExampleRows, planesOf } from './examples.js';
import { ringLayout, sourceBt, type PrefetchInit } from './prefetch.js';

const init = workerData as PrefetchInit;
const { source, depth } = init;
const layout = ringLayout(source, depth);
const tags = new Int32Array(init.shared, 0, depth);
const data = new Int32Array(init.shared, layout.tagsBytes);
const bt = sourceBt(source);
let fill: ((step: number, micro: number, slot: Int32Array) => void) | undefined;
let failed = false;

function filler(): (step: number, micro: number, slot: Int32Array) => void {
  if (source.kind === 'examples') {
    const rows = ExampleRows.fromSpec(source.spec);
    return (step, micro, slot) => rows.fill(step, micro, planesOf(slot, bt));
  }
  const spec = source.spec;
  const sampler = new Sampler(
    spec.sources.map((s) => ({ corpus: new TokenCorpus(s.specs, { name: s.name, vocabSize: s.vocabSize }), weight: s.weight })),
    spec,
  );
  return (step, micro, slot) => sampler.fill(source.seed, step, micro, slot.subarray(0, bt), slot.subarray(bt, 2 * bt));
}

parentPort!.on('message', (pos: number) => {
  if (failed) return;
  const slot = pos % depth;
  try {
    fill ??= filler();
    const M = source.spec.microBatches;
    const base = slot * layout.slotInts;
    fill(Math.floor(pos / M), pos % M, data.subarray(base, base + layout.slotInts));
    Atomics.store(tags, slot, pos + 1);
  } catch (e) {
    failed = true;
    init.port.postMessage((e as Error).message ?? String(e));
    Atomics.store(tags, slot, -1);
  }
  Atomics.notify(tags, slot);
});

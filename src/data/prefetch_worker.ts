// The prefetch worker (src/data/prefetch.ts): fills ring slots with the batches it is asked for.
import { parentPort, workerData } from 'node:worker_threads';
import { TokenCorpus } from './corpus_files.js';
import { Sampler } from './sampler.js';
import { ringLayout, type PrefetchInit } from './prefetch.js';

const init = workerData as PrefetchInit;
const { spec, seed, depth } = init;
const layout = ringLayout(spec, depth);
const tags = new Int32Array(init.shared, 0, depth);
const data = new Int32Array(init.shared, layout.tagsBytes);
const half = layout.slotInts / 2;
let sampler: Sampler | undefined;
let failed = false;

parentPort!.on('message', (pos: number) => {
  if (failed) return;
  const slot = pos % depth;
  try {
    sampler ??= new Sampler(
      spec.sources.map((s) => ({ corpus: new TokenCorpus(s.specs, { name: s.name, vocabSize: s.vocabSize }), weight: s.weight })),
      spec,
    );
    const step = Math.floor(pos / spec.microBatches);
    const micro = pos % spec.microBatches;
    const base = slot * layout.slotInts;
    sampler.fill(seed, step, micro, data.subarray(base, base + half), data.subarray(base + half, base + layout.slotInts));
    Atomics.store(tags, slot, pos + 1);
  } catch (e) {
    failed = true;
    init.port.postMessage((e as Error).message ?? String(e));
    Atomics.store(tags, slot, -1);
  }
  Atomics.notify(tags, slot);
});

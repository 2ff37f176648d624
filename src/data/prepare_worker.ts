// A `flotilla prepare` worker thread: tokenizes the units it is sent (src/data/prepare_unit.ts) and
// reports progress (input bytes), each finished shard, or the first error.
import { parentPort, workerData } from 'node:worker_threads';
import { processUnit, type UnitContext, type UnitJob } from './prepare_unit.js';

const ctx = workerData as UnitContext;
parentPort!.on('message', (job: UnitJob) => {
  let pending = 0;
  const progress = (bytes: number): void => {
    pending += bytes;
    if (pending >= 1 << 20) {
      parentPort!.postMessage({ type: 'progress', bytes: pending });
      pending = 0;
    }
  };
  processUnit(job, ctx, progress).then(
    (record) => parentPort!.postMessage({ type: 'done', index: job.index, record, bytes: pending }),
    (e: Error) => parentPort!.postMessage({ type: 'error', index: job.index, message: e.message, bad: e.name === 'BadInputError' }),
  );
});

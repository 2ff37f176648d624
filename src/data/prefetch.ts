// Batches prepared ahead on a worker thread, off the step's critical path.
//
// The worker rebuilds the loader's tensor-free half from plain data (a text loader's Sampler: the
// same windows; an example loader's ExampleRows: the same rows, src/data/examples.ts) and fills a
// ring of `depth` slots in shared memory, each slot the int32 planes of one micro-batch (x, y; or
// the example planes); each slot carries a tag, the position it holds + 1. take(pos) waits on that
// tag (Atomics.wait: the training step is synchronous), hands the slot to the loader to make
// tensors of, and asks for position pos + depth in the freed slot. A jump of the cursor (resume)
// starts a new worker rather than racing an old one's writes.
import { MessageChannel, receiveMessageOnPort, type MessagePort, type Worker } from 'node:worker_threads';
import type { SamplerSpec } from './sampler.js';
import { PLANES, type ExampleRowsSpec } from './examples.js';
import { siblingUrl, startWorker, type StartedWorker } from './workers.js';

/** What fills the slots: a text loader's windows (x, y) or an example loader's rows (PLANES planes). */
export type PrefetchSource =
  | { kind: 'windows'; spec: SamplerSpec; seed: number }
  | { kind: 'examples'; spec: ExampleRowsSpec };

/** What the worker is started with. */
export interface PrefetchInit {
  source: PrefetchSource;
  depth: number;
  shared: SharedArrayBuffer;
  port: MessagePort;
}

/** B x T of one micro-batch. */
export function sourceBt(src: PrefetchSource): number {
  const s = src.spec;
  const seqLen = src.kind === 'windows' ? src.spec.seqLen : src.spec.pack.seqLen;
  return (s.globalBatch / s.dpSize / s.microBatches) * seqLen;
}

/** Byte layout of the shared ring: `depth` Int32 tags, then per slot its planes (B * T int32 each). */
export function ringLayout(src: PrefetchSource, depth: number): { tagsBytes: number; slotInts: number; bytes: number } {
  const slotInts = (src.kind === 'windows' ? 2 : PLANES) * sourceBt(src);
  const tagsBytes = 4 * depth;
  return { tagsBytes, slotInts, bytes: tagsBytes + 4 * slotInts * depth };
}

const WAIT_LIMIT_MS = 120_000;

export class Prefetcher {
  private readonly started: StartedWorker;
  private readonly worker: Worker;
  private readonly tags: Int32Array;
  private readonly data: Int32Array;
  private readonly slotInts: number;
  private readonly errors: MessagePort;
  private next: number;
  private closed = false;

  constructor(source: PrefetchSource, start: number, private readonly depth: number) {
    const layout = ringLayout(source, depth);
    const shared = new SharedArrayBuffer(layout.bytes);
    this.tags = new Int32Array(shared, 0, depth);
    this.data = new Int32Array(shared, layout.tagsBytes);
    this.slotInts = layout.slotInts;
    const { port1, port2 } = new MessageChannel();
    this.errors = port1;
    const init: PrefetchInit = { source, depth, shared, port: port2 };
    this.started = startWorker(siblingUrl('prefetch_worker'), { workerData: init, transferList: [port2] });
    this.worker = this.started.worker;
    this.worker.unref();
    this.next = start;
    for (let i = 0; i < depth; i++) this.request(start + i);
  }

  private request(pos: number): void {
    this.worker.postMessage(pos);
    this.next = pos + 1;
  }

  /** Whether take(pos) can be served by this ring (pos is the next position it expects). */
  serves(pos: number): boolean {
    return !this.closed && pos === this.next - this.depth;
  }

  /** The batch at `pos` (which must be the next in order), its slot turned into whatever `make` builds. */
  take<T>(pos: number, make: (slot: Int32Array) => T): T {
    if (!this.serves(pos)) throw new Error(`internal: prefetcher asked for position ${pos}, expected ${this.next - this.depth}`);
    const slot = pos % this.depth;
    const waitStart = Date.now();
    for (;;) {
      const tag = Atomics.load(this.tags, slot);
      if (tag === pos + 1) break;
      if (tag === -1) {
        const msg = receiveMessageOnPort(this.errors)?.message as string | undefined;
        this.close();
        throw new Error(msg ?? 'the data prefetch worker failed');
      }
      // Blocked here, this thread sees no worker events: the start state is read from shared memory.
      const problem = this.started.problem();
      if (problem !== undefined) {
        this.close();
        throw new Error(`data prefetch: ${problem}; set data.prefetch = 0 to read inline`);
      }
      if (Date.now() - waitStart > WAIT_LIMIT_MS) {
        this.close();
        throw new Error(`the data prefetch worker gave no batch for ${WAIT_LIMIT_MS / 1000} s; set data.prefetch = 0 to read inline`);
      }
      Atomics.wait(this.tags, slot, tag, 1000);
    }
    const base = slot * this.slotInts;
    const out = make(this.data.subarray(base, base + this.slotInts));
    Atomics.store(this.tags, slot, 0);
    this.request(pos + this.depth);
    return out;
  }

  close(): void {
    if (this.closed) return;
    this.closed = true;
    void this.worker.terminate();
    this.errors.close();
  }
}

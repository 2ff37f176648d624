// Writes a checkpoint file from bytes already copied out of the tensors, hashing them on the way
// (SHA-256 of exactly the bytes written: nobody re-reads the file to checksum it) and fsync-ing it
// before it reports. The writing happens on a worker thread, so a training step runs while the disk
// works; a blocking save waits for it.
import { Worker } from 'node:worker_threads';

export interface WrittenFile {
  path: string;
  bytes: number;
  sha256: string;
}

// The worker is plain JavaScript evaluated from this string, so it starts the same way under tsx,
// from compiled JavaScript and from an installed package (no module path to resolve).
const WORKER_SOURCE = `
const { parentPort } = require('node:worker_threads');
const { closeSync, fsyncSync, openSync, writeSync } = require('node:fs');
const { createHash } = require('node:crypto');
parentPort.on('message', ({ id, path, staged, length }) => {
  try {
    const hash = createHash('sha256');
    const fd = openSync(path, 'wx');
    let bytes = 0;
    try {
      for (const c of [new Uint8Array(staged, 0, length)]) {
        let done = 0;
        while (done < c.byteLength) done += writeSync(fd, c, done, c.byteLength - done);
        hash.update(c);
        bytes += c.byteLength;
      }
      fsyncSync(fd);
    } finally {
      closeSync(fd);
    }
    parentPort.postMessage({ id, ok: true, file: { path, bytes, sha256: hash.digest('hex') } });
  } catch (e) {
    parentPort.postMessage({ id, ok: false, error: String(e && e.message || e) });
  }
});
`;

/** One background writer thread; files are written one after another in submission order. */
export class BackgroundWriter {
  private worker: Worker | undefined;
  private nextId = 0;
  private readonly waiting = new Map<number, { resolve: (f: WrittenFile) => void; reject: (e: Error) => void }>();

  private start(): Worker {
    if (this.worker) return this.worker;
    const w = new Worker(WORKER_SOURCE, { eval: true, execArgv: [] });
    w.on('message', (m: { id: number; ok: boolean; file?: WrittenFile; error?: string }) => {
      const p = this.waiting.get(m.id);
      if (!p) return;
      this.waiting.delete(m.id);
      if (this.waiting.size === 0) w.unref();
      if (m.ok) p.resolve(m.file!);
      else p.reject(new Error(m.error));
    });
    w.on('error', (e) => this.failAll(e));
    w.on('exit', (code) => {
      this.worker = undefined;
      if (this.waiting.size > 0) this.failAll(new Error(`checkpoint writer thread exited (code ${code}) with writes pending`));
    });
    this.worker = w;
    return w;
  }

  private failAll(e: Error): void {
    for (const p of this.waiting.values()) p.reject(e);
    this.waiting.clear();
  }

  /**
   * Writes the first `length` bytes of a staging buffer to path (which must not exist). The buffer
   * is shared with the thread, not copied: the caller must not change it until the promise settles.
   */
  write(path: string, staged: SharedArrayBuffer, length: number): Promise<WrittenFile> {
    const w = this.start();
    const id = this.nextId++;
    return new Promise<WrittenFile>((resolve, reject) => {
      this.waiting.set(id, { resolve, reject });
      w.ref(); // a pending write keeps the process alive; an idle writer does not
      w.postMessage({ id, path, staged, length });
    });
  }

  async close(): Promise<void> {
    const w = this.worker;
    this.worker = undefined;
    if (w) await w.terminate();
  }
}

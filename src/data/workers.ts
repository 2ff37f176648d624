// Starting a worker thread on one of this directory's modules, from sources (.ts, through tsx) or
// from compiled .js alike, and knowing whether it started.
//
// Every worker starts from a short bootstrap. For a .ts module it first registers tsx in the
// worker's own thread (`bin/flotilla.js` and `node --import tsx` register it in the main thread
// only; Node 20 does not carry that into workers). It then imports the module and records in a
// small shared buffer whether that worked, why not, or that the thread exited. The buffer is what
// makes a failed start visible to a caller blocked in Atomics.wait (the prefetcher), which sees no
// events; `ready` gives the same answer to callers that await.
import { Worker, setEnvironmentData, type WorkerOptions } from 'node:worker_threads';
import { basename } from 'node:path';
import { fileURLToPath } from 'node:url';

/** The state word of the shared buffer. */
const STARTING = 0;
const READY = 1;
const FAILED = 2;
const EXITED = 3;
const TEXT_BYTES = 2048;
const KEY = 'flotilla.workerStart';

// Node 20 has Atomics.waitAsync; the TypeScript library this project targets does not declare it.
interface WaitAsync {
  waitAsync(a: Int32Array, index: number, value: number): { async: false; value: string } | { async: true; value: Promise<string> };
}

export interface StartedWorker {
  readonly worker: Worker;
  /** Resolves once the module has loaded; rejects with why the worker could not start. */
  readonly ready: Promise<void>;
  /** Without waiting: why the worker failed to start or has exited, or undefined while it is starting or running. */
  problem(): string | undefined;
}

// Runs in the worker as a CommonJS script. Only the first report counts, except that a thread that
// started and later exits says so.
const bootSource = (moduleUrl: string, tsxApi: string | undefined): string => `
const { getEnvironmentData } = require('node:worker_threads');
const shared = getEnvironmentData(${JSON.stringify(KEY)});
const state = new Int32Array(shared, 0, 2);
const report = (code, text) => {
  const now = Atomics.load(state, 0);
  if (now !== ${STARTING} && !(now === ${READY} && code === ${EXITED})) return;
  const bytes = Buffer.from(String(text)).subarray(0, ${TEXT_BYTES});
  new Uint8Array(shared, 8, ${TEXT_BYTES}).set(bytes);
  Atomics.store(state, 1, bytes.length);
  Atomics.store(state, 0, code);
  Atomics.notify(state, 0);
};
process.on('exit', (c) => report(Atomics.load(state, 0) === ${READY} ? ${EXITED} : ${FAILED}, 'the thread exited with code ' + c + (Atomics.load(state, 0) === ${READY} ? '' : ' while loading its module')));
(async () => {
  ${tsxApi !== undefined ? `(await import(${JSON.stringify(tsxApi)})).register();` : ''}
  await import(${JSON.stringify(moduleUrl)});
})().then(() => report(${READY}, ''), (e) => {
  report(${FAILED}, (e && e.message) || String(e));
  throw e;
});
`;

/** Starts a worker thread on the module at `url` (options as for `new Worker`). */
export function startWorker(url: URL, opts: WorkerOptions = {}): StartedWorker {
  const what = `worker thread ${basename(fileURLToPath(url))}`;
  const tsxApi = url.pathname.endsWith('.ts') ? import.meta.resolve('tsx/esm/api') : undefined;
  const shared = new SharedArrayBuffer(8 + TEXT_BYTES);
  const state = new Int32Array(shared, 0, 2);
  // Environment data is copied into the worker when it is constructed: set it just for this one.
  setEnvironmentData(KEY, shared);
  let worker: Worker;
  try {
    worker = new Worker(bootSource(url.href, tsxApi), { ...opts, eval: true });
  } finally {
    setEnvironmentData(KEY, undefined);
  }
  const text = (): string => Buffer.from(new Uint8Array(shared, 8, Atomics.load(state, 1))).toString();
  const problem = (): string | undefined => {
    const s = Atomics.load(state, 0);
    if (s === FAILED) return `the ${what} could not start: ${text()}`;
    if (s === EXITED) return `the ${what} stopped: ${text()}`;
    return undefined;
  };
  const ready = new Promise<void>((resolve, reject) => {
    let settled = false;
    const settle = (why: string | undefined): void => {
      if (settled) return;
      settled = true;
      worker.off('exit', onExit);
      if (why === undefined) {
        // Started: later errors are the caller's to handle (an unhandled one stays loud).
        worker.off('error', onError);
        resolve();
      } else {
        reject(new Error(why)); // the thread's own error event, which follows, is this one
      }
    };
    const onError = (e: Error): void => settle(`the ${what} could not start: ${e.message}`);
    const onExit = (code: number): void => settle(problem() ?? `the ${what} could not start: it exited with code ${code}`);
    worker.on('error', onError);
    worker.on('exit', onExit);
    const check = (): void => {
      const s = Atomics.load(state, 0);
      if (s === READY) settle(undefined);
      else if (s !== STARTING) settle(problem());
    };
    // A pending waitAsync does not keep the process alive, so an unref'd worker stays unref'd.
    const w = (Atomics as unknown as WaitAsync).waitAsync(state, 0, STARTING);
    if (w.async) void w.value.then(check);
    else check();
  });
  ready.catch(() => undefined); // callers that only poll problem() need not handle it
  return { worker, ready, problem };
}

/** The URL of a sibling module, with this module's own extension (.ts in a checkout, .js compiled). */
export function siblingUrl(name: string): URL {
  const ext = import.meta.url.endsWith('.ts') ? '.ts' : '.js';
  return new URL(`./${name}${ext}`, import.meta.url);
}

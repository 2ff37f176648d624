// Starting a worker thread on one of this directory's modules, from sources (.ts, through tsx) or
// from compiled .js alike. A .ts worker starts with a two-line bootstrap that registers tsx in the
// worker's own thread first: `bin/flotilla.js` registers tsx in the main thread only, and Node 20
// does not carry that registration into workers.
import { Worker, type WorkerOptions } from 'node:worker_threads';

export function startWorker(url: URL, opts: WorkerOptions = {}): Worker {
  if (!url.pathname.endsWith('.ts')) return new Worker(url, opts);
  const api = import.meta.resolve('tsx/esm/api');
  const boot = `import(${JSON.stringify(api)}).then((m) => { m.register(); return import(${JSON.stringify(url.href)}); })`;
  return new Worker(boot, { ...opts, eval: true });
}

/** The URL of a sibling module, with this module's own extension (.ts in a checkout, .js compiled). */
export function siblingUrl(name: string): URL {
  const ext = import.meta.url.endsWith('.ts') ? '.ts' : '.js';
  return new URL(`./${name}${ext}`, import.meta.url);
}

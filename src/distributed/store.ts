// The rendezvous store a world meets through, chosen from the launch contract:
//
//   FLOTILLA_STORE_FILE set (flotilla run on one node sets it):
//       c10d's FileStore at that path. No network listener at all; the file lives in a directory
//       only this user can enter (mode 0700, checked here), so other users cannot read or write keys.
//   otherwise (several nodes, or ranks started by hand or by mpirun/srun):
//       flotilla's own store (store_server.ts). Rank 0 serves it on MASTER_ADDR:MASTER_PORT, bound to
//       that address only, and every rank (rank 0 included) connects as a client and proves it knows
//       FLOTILLA_JOB_SECRET before it may read or write a key. A non-loopback MASTER_ADDR requires a
//       secret; on a loopback address the secret may be left unset (every rank is then on this host).
//
// close() releases everything at once: the client connection, and on rank 0 the server's listener
// and its thread.
//
// [Note: store cycles] A process may destroy its world and join a new one (destroyProcessGroup, then
// initProcessGroup), and every rank counts those cycles alike. Each cycle meets in a store of its
// own: the FileStore of cycle k > 0 is FLOTILLA_STORE_FILE + '.k', and rank 0's server of cycle k
// holds the key 'cycle/k' from the start; a rank that reaches the previous cycle's server (rank 0
// has not closed it yet) sees no such key, disconnects and tries again. Otherwise the new cycle's
// rank claims would meet the old ones, or a rank would join a server that is about to close.
import { statSync } from 'node:fs';
import { dirname } from 'node:path';
import { MessageChannel, receiveMessageOnPort, Worker } from 'node:worker_threads';
import { native, type StoreHandle } from '../tensor/native.js';
import { isLoopback, LaunchEnvError, type LaunchEnv } from './env.js';
import { MAX_FRAME_BYTES, storeProof, type StoreWorkerData } from './store_server.js';

export interface RendezvousStore {
  handle: StoreHandle;
  /** 'file' (FileStore, one host) or 'socket' (flotilla's store served by rank 0). */
  kind: 'file' | 'socket';
  /** Where it is, for messages. */
  where: string;
  close(): void;
}

/** A failure to open the store that the user can fix (a message naming the fix). */
export class StoreError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'StoreError';
  }
}

/** Checks that the FileStore's directory is private to this user; returns the problem, if any. */
export function privateDirProblem(dir: string): string | undefined {
  let st;
  try {
    st = statSync(dir);
  } catch (e) {
    return `${dir} cannot be read (${(e as Error).message})`;
  }
  if (!st.isDirectory()) return `${dir} is not a directory`;
  if (process.getuid !== undefined && st.uid !== process.getuid()) return `${dir} belongs to another user (uid ${st.uid})`;
  if ((st.mode & 0o077) !== 0) return `${dir} can be entered by other users (mode ${(st.mode & 0o777).toString(8)}; it must be 700)`;
  return undefined;
}

/** The job secret from FLOTILLA_JOB_SECRET, or '' (allowed for a loopback MASTER_ADDR only). */
export function jobSecret(env: LaunchEnv, vars: Record<string, string | undefined> = process.env): string {
  const secret = vars.FLOTILLA_JOB_SECRET ?? '';
  if (secret === '' && !isLoopback(env.masterAddr)) {
    throw new LaunchEnvError(
      `MASTER_ADDR=${env.masterAddr} is reachable from other hosts, so the rendezvous store needs a job secret: ` +
        'set FLOTILLA_JOB_SECRET to the same random value for every rank (e.g. `openssl rand -hex 32`); ' +
        '`flotilla run --nnodes M` passes it on from its own environment',
    );
  }
  return secret;
}

/** Blocks this thread for ms milliseconds. */
function sleepSync(ms: number): void {
  Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);
}

/** A connection that broke while the previous cycle's server was closing: worth another try. */
const CLOSING_SERVER = /closed the connection|lost the connection|did not greet|did not answer/;

/** Opens the world's store (see the top of this file) for the given cycle of this process. */
export function openStore(env: LaunchEnv, timeoutMs: number, cycle = 0): RendezvousStore {
  const base = process.env.FLOTILLA_STORE_FILE?.trim();
  if (base) {
    const file = cycle === 0 ? base : `${base}.${cycle}`;
    const problem = privateDirProblem(dirname(file));
    if (problem !== undefined) {
      throw new LaunchEnvError(`FLOTILLA_STORE_FILE=${file}: ${problem}; unset it to rendezvous over MASTER_ADDR, or let \`flotilla run\` create it`);
    }
    const handle = native.createFileStore(file, env.worldSize, timeoutMs);
    return { handle, kind: 'file', where: file, close: () => handle.release() };
  }

  const secret = jobSecret(env);
  const where = `${env.masterAddr}:${env.masterPort}`;
  const cycleKey = `cycle/${cycle}`;
  const server = env.rank === 0 ? serveStore(env.masterAddr, env.masterPort, secret, timeoutMs, { [cycleKey]: '1' }) : undefined;
  let handle: StoreHandle;
  try {
    const deadline = Date.now() + timeoutMs;
    for (let attempt = 0; ; attempt++) {
      const left = Math.max(1, deadline - Date.now());
      let h: StoreHandle | undefined;
      let current: boolean;
      try {
        h = native.createSocketStore(env.masterAddr, env.masterPort, left, MAX_FRAME_BYTES, (nonce) => storeProof(secret, nonce));
        current = h.check([cycleKey]);
      } catch (e) {
        h?.release();
        if (!CLOSING_SERVER.test((e as Error).message) || Date.now() >= deadline) throw e;
        sleepSync(50);
        continue;
      }
      if (current) {
        handle = h;
        break;
      }
      h.release(); // the previous cycle's server, still open: see [Note: store cycles]
      if (Date.now() >= deadline) throw new Error(`only the server of an earlier cycle answered (this process is in cycle ${cycle})`);
      sleepSync(Math.min(50 * (attempt + 1), 250));
    }
  } catch (e) {
    server?.close();
    const msg = (e as Error).message;
    if (/cannot resolve host/.test(msg)) {
      throw new StoreError(`rank ${env.rank}: MASTER_ADDR=${env.masterAddr} cannot be resolved (${msg.replace(/^.*?: /, '')}); set it to rank 0's host name or address`);
    }
    if (/refused this process/.test(msg)) {
      throw new StoreError(`rank ${env.rank}: the rendezvous store at ${where} refused this rank: ${msg.replace(/^.*refused this process: /, '')}; give every rank the same FLOTILLA_JOB_SECRET`);
    }
    throw new StoreError(`rank ${env.rank}: could not reach the rendezvous store at ${where} (rank 0 serves it) within ${timeoutMs} ms: ${msg} (check MASTER_ADDR/MASTER_PORT and that rank 0 started)`);
  }
  return {
    handle, kind: 'socket', where,
    close: () => {
      handle.release();
      server?.close();
    },
  };
}

/** How the worker thread is started: through tsx when this module is TypeScript. */
function workerSource(): string {
  const url = new URL('./store_server' + (import.meta.url.endsWith('.ts') ? '.ts' : '.js'), import.meta.url).href;
  if (!url.endsWith('.ts')) return `import(${JSON.stringify(url)});`;
  const tsx = import.meta.resolve('tsx/esm/api');
  return `import(${JSON.stringify(tsx)}).then(({ register }) => { register(); return import(${JSON.stringify(url)}); });`;
}

/**
 * Starts the store server in a worker thread and waits (blocking this thread) until it listens.
 * close() stops it and waits until its listener is closed.
 */
function serveStore(host: string, port: number, secret: string, timeoutMs: number, initialKeys: Record<string, string>): { close(): void } {
  const state = new SharedArrayBuffer(4);
  const flag = new Int32Array(state);
  const { port1, port2 } = new MessageChannel();
  const data: StoreWorkerData = { flotillaStoreServer: { host, port, secret, initialKeys }, state, port: port2 };
  const worker = new Worker(workerSource(), { eval: true, workerData: data, transferList: [port2], stdout: false, stderr: false });
  worker.unref();
  Atomics.wait(flag, 0, 0, Math.min(timeoutMs, 60_000));
  const msg = receiveMessageOnPort(port1)?.message as { ok: boolean; code?: string; message?: string } | undefined;
  if (msg?.ok !== true) {
    void worker.terminate();
    port1.close();
    const where = `${host}:${port}`;
    if (msg === undefined) throw new StoreError(`rank 0: the rendezvous store on ${where} did not start within ${Math.min(timeoutMs, 60_000)} ms`);
    if (msg.code === 'ENOTFOUND' || msg.code === 'EAI_AGAIN') {
      throw new StoreError(`rank 0: MASTER_ADDR=${host} cannot be resolved (${msg.code}); set it to this host's name or address`);
    }
    if (msg.code === 'EADDRINUSE') throw new StoreError(`rank 0: could not serve the rendezvous store on ${where}: the port is in use; pick another MASTER_PORT`);
    if (msg.code === 'EADDRNOTAVAIL') throw new StoreError(`rank 0: could not serve the rendezvous store on ${where}: ${host} is not an address of this host (rank 0 must run on MASTER_ADDR)`);
    throw new StoreError(`rank 0: could not serve the rendezvous store on ${where}: ${msg.message}`);
  }
  let closed = false;
  return {
    close(): void {
      if (closed) return;
      closed = true;
      Atomics.store(flag, 0, 1);
      port1.postMessage('close');
      Atomics.wait(flag, 0, 1, 5_000); // until the listener and every connection are closed
      port1.close();
      void worker.terminate();
    },
  };
}

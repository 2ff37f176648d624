// flotilla's rendezvous store server: the key-value store every rank meets through when ranks span
// hosts (or were started by hand on one). Rank 0 runs it in a worker thread (store.ts), so it keeps
// answering while rank 0's own thread is blocked inside Gloo; the ranks' c10d::Store client is the
// native SocketStore (native/comm.cc), which speaks the frames described in [Note: store wire format].
//
// Why our own server and not libtorch 1.13's TCPStore: that one listens on every interface whatever
// MASTER_ADDR says, lets anyone who reaches the port read and write keys, allocates whatever size a
// request declares, and serves clients one message at a time, so a half-sent message stalls the
// rendezvous. This server:
//   - listens only on MASTER_ADDR's address (the one interface the job was told to use);
//   - sends each new connection a random nonce and reads or writes nothing for it until the client
//     answers with HMAC-SHA256(job secret, nonce): a peer must know FLOTILLA_JOB_SECRET to join;
//   - refuses any frame whose declared length is above the limit before reading it (a tiny limit
//     before authentication), and drops connections that do not authenticate within a few seconds;
//   - is event-driven, so a slow or half-sent message from one connection delays nobody else.
// Written in TypeScript (not a C++ server) so that these decisions stay out of the binding.
import { createServer, type Server, type Socket } from 'node:net';
import { createHmac, randomBytes, timingSafeEqual } from 'node:crypto';
import { isMainThread, workerData, type MessagePort } from 'node:worker_threads';

/** Op and status codes; they must match SocketStore in native/comm.cc. */
export const Op = { auth: 1, set: 2, get: 3, add: 4, check: 5, wait: 6, delete: 7, numKeys: 8, compareSet: 9 } as const;
export const Status = { ok: 0, missing: 1, timedOut: 2, refused: 3 } as const;

/** Largest frame a member may send or receive (keys and values are addresses and small specs). */
export const MAX_FRAME_BYTES = 16 * 1024 * 1024;
/** Largest frame before authentication: the AUTH request is 1 + 4 + 32 bytes. */
export const MAX_UNAUTHENTICATED_FRAME_BYTES = 256;
/** A connection that has not proved membership by then is dropped. */
export const AUTH_DEADLINE_MS = 10_000;

/** What a member sends in answer to the nonce: HMAC-SHA256 keyed by the job secret. */
export function storeProof(secret: string, nonce: Buffer): Buffer {
  return createHmac('sha256', secret).update('flotilla-store-v1:').update(nonce).digest();
}

export interface StoreServerOptions {
  host: string;
  port: number;
  /** The job secret ('' when the job has none, which store.ts allows on loopback only). */
  secret: string;
  maxFrameBytes?: number;
  /** Keys the store holds from the start (store.ts names the world's cycle with one). */
  initialKeys?: Record<string, string>;
}

/** One message, request or reply: u32 length, a code byte (op or status), then u32-length-prefixed fields. */
export function frame(status: number, fields: Buffer[] = []): Buffer {
  const n = 1 + fields.reduce((a, f) => a + 4 + f.length, 0);
  const out = Buffer.alloc(4 + n);
  out.writeUInt32LE(n, 0);
  out[4] = status;
  let at = 5;
  for (const f of fields) {
    out.writeUInt32LE(f.length, at);
    f.copy(out, at + 4);
    at += 4 + f.length;
  }
  return out;
}

function parseFields(body: Buffer): Buffer[] | undefined {
  const fields: Buffer[] = [];
  let at = 1;
  while (at < body.length) {
    if (body.length - at < 4) return undefined;
    const len = body.readUInt32LE(at);
    at += 4;
    if (len > body.length - at) return undefined;
    fields.push(body.subarray(at, at + len));
    at += len;
  }
  return fields;
}

interface Waiter {
  keys: string[];
  sock: Socket;
  done: (status: number, fields?: Buffer[]) => void;
  timer: NodeJS.Timeout | undefined;
}

/** Starts the server; resolves once it listens (rejects with the listen error). */
export function startStoreServer(o: StoreServerOptions): Promise<Server> {
  const maxFrame = o.maxFrameBytes ?? MAX_FRAME_BYTES;
  const data = new Map<string, Buffer>(Object.entries(o.initialKeys ?? {}).map(([k, v]) => [k, Buffer.from(v)]));
  let waiters: Waiter[] = [];
  const sockets = new Set<Socket>();

  const wake = (): void => {
    const still: Waiter[] = [];
    for (const w of waiters) {
      if (w.keys.every((k) => data.has(k))) {
        if (w.timer) clearTimeout(w.timer);
        w.done(Status.ok);
      } else still.push(w);
    }
    waiters = still;
  };

  const server = createServer({ noDelay: true }, (sock) => {
    sockets.add(sock);
    const nonce = randomBytes(32);
    let authed = false;
    let chunks: Buffer[] = [];
    let buffered = 0;
    let busy = false; // a request of this connection is waiting for keys: later frames queue
    const authTimer = setTimeout(() => sock.destroy(), AUTH_DEADLINE_MS);
    authTimer.unref();
    sock.on('close', () => {
      sockets.delete(sock);
      clearTimeout(authTimer);
      waiters = waiters.filter((w) => {
        if (w.sock !== sock) return true;
        if (w.timer) clearTimeout(w.timer);
        return false;
      });
    });
    sock.on('error', () => sock.destroy());
    const refuse = (why: string): void => {
      sock.end(frame(Status.refused, [Buffer.from(why)]));
      sock.destroy();
    };
    const reply = (status: number, fields: Buffer[] = []): void => void sock.write(frame(status, fields));

    // Parks a request until every key exists (or it times out); 0 ms means no limit.
    const park = (keys: string[], timeoutMs: number, then: () => void): void => {
      if (keys.every((k) => data.has(k))) return then();
      busy = true;
      const w: Waiter = {
        keys, sock, timer: undefined,
        done: (status) => {
          busy = false;
          if (status === Status.ok) then();
          else reply(status);
          pump();
        },
      };
      if (timeoutMs > 0) {
        w.timer = setTimeout(() => {
          waiters = waiters.filter((x) => x !== w);
          w.done(Status.timedOut);
        }, timeoutMs);
      }
      waiters.push(w);
    };

    const handle = (body: Buffer): void => {
      const op = body[0];
      const f = parseFields(body);
      if (f === undefined) return refuse('malformed request');
      if (!authed) {
        if (op !== Op.auth || f.length !== 1) return refuse('authenticate first');
        const want = storeProof(o.secret, nonce);
        if (f[0]!.length !== want.length || !timingSafeEqual(f[0]!, want)) {
          return refuse('not a member of this job (its FLOTILLA_JOB_SECRET differs from rank 0\'s)');
        }
        authed = true;
        clearTimeout(authTimer);
        return reply(Status.ok);
      }
      const str = (b: Buffer | undefined): string => (b ?? Buffer.alloc(0)).toString('utf8');
      switch (op) {
        case Op.set:
          data.set(str(f[0]), Buffer.from(f[1] ?? Buffer.alloc(0)));
          reply(Status.ok);
          return wake();
        case Op.get: {
          const key = str(f[0]);
          return park([key], Number(str(f[1])) || 0, () => reply(Status.ok, [data.get(key)!]));
        }
        case Op.add: {
          const key = str(f[0]);
          const delta = BigInt(str(f[1]) || '0');
          const now = (data.has(key) ? BigInt(str(data.get(key))) : 0n) + delta;
          data.set(key, Buffer.from(now.toString()));
          reply(Status.ok, [Buffer.from(now.toString())]);
          return wake();
        }
        case Op.check:
          return reply(f.every((k) => data.has(str(k))) ? Status.ok : Status.missing);
        case Op.wait:
          return park(f.slice(1).map(str), Number(str(f[0])) || 0, () => reply(Status.ok));
        case Op.delete:
          return reply(data.delete(str(f[0])) ? Status.ok : Status.missing);
        case Op.numKeys:
          return reply(Status.ok, [Buffer.from(String(data.size))]);
        case Op.compareSet: {
          const key = str(f[0]);
          const cur = data.get(key);
          if ((cur === undefined && f[1]!.length === 0) || (cur !== undefined && cur.equals(f[1]!))) {
            data.set(key, Buffer.from(f[2]!));
            reply(Status.ok, [data.get(key)!]);
            return wake();
          }
          return reply(Status.ok, [cur ?? Buffer.from(f[1]!)]);
        }
        default:
          return refuse(`unknown op ${op}`);
      }
    };

    // The declared length of the next frame (its first 4 bytes are buffered).
    const peekLength = (): number => {
      if (chunks[0]!.length >= 4) return chunks[0]!.readUInt32LE(0);
      const head = Buffer.concat(chunks);
      chunks = [head];
      return head.readUInt32LE(0);
    };

    // Takes whole frames off the buffer, one at a time, while no request is parked. A declared
    // length above the limit is refused as soon as its 4 bytes are here, before buffering the rest.
    const pump = (): void => {
      while (!busy && !sock.destroyed && buffered >= 4) {
        const n = peekLength();
        const limit = authed ? maxFrame : MAX_UNAUTHENTICATED_FRAME_BYTES;
        if (n < 1 || n > limit) return refuse(`a frame of ${n} bytes is above the limit of ${limit}`);
        if (buffered < 4 + n) return;
        const all = chunks.length === 1 ? chunks[0]! : Buffer.concat(chunks);
        const body = Buffer.from(all.subarray(4, 4 + n));
        const rest = all.subarray(4 + n);
        chunks = rest.length > 0 ? [rest] : [];
        buffered = rest.length;
        try {
          handle(body);
        } catch (e) {
          refuse(`bad request: ${(e as Error).message}`); // e.g. add() on a key that holds no integer
        }
      }
    };

    sock.write(frame(Status.ok, [nonce]));
    sock.on('data', (chunk: Buffer) => {
      chunks.push(chunk);
      buffered += chunk.length;
      pump();
    });
  });

  const origClose = server.close.bind(server);
  server.close = ((cb?: (err?: Error) => void) => {
    for (const s of sockets) s.destroy();
    for (const w of waiters) if (w.timer) clearTimeout(w.timer);
    waiters = [];
    return origClose(cb);
  }) as typeof server.close;

  return new Promise((resolve, reject) => {
    server.once('error', reject);
    server.listen({ host: o.host, port: o.port, exclusive: true }, () => {
      server.off('error', reject);
      resolve(server);
    });
  });
}

// ---------------------------------------------------------------------------------------------
// Worker-thread entry (store.ts starts it). The main thread waits on `state` (an Int32Array over a
// SharedArrayBuffer) and reads the details with receiveMessageOnPort, because it cannot run its event
// loop while it waits: state 1 = listening, 2 = failed, 3 = closed after a 'close' message.

export interface StoreWorkerData {
  flotillaStoreServer: StoreServerOptions;
  state: SharedArrayBuffer;
  port: MessagePort;
}

function signal(state: Int32Array, value: number): void {
  Atomics.store(state, 0, value);
  Atomics.notify(state, 0);
}

if (!isMainThread && (workerData as Partial<StoreWorkerData> | undefined)?.flotillaStoreServer !== undefined) {
  const wd = workerData as StoreWorkerData;
  const state = new Int32Array(wd.state);
  startStoreServer(wd.flotillaStoreServer).then(
    (server) => {
      wd.port.on('message', (m) => {
        if (m !== 'close') return;
        server.close(() => {
          wd.port.close();
          signal(state, 3);
        });
      });
      wd.port.postMessage({ ok: true });
      signal(state, 1);
    },
    (e: NodeJS.ErrnoException) => {
      wd.port.postMessage({ ok: false, code: e.code ?? '', message: e.message });
      wd.port.close();
      signal(state, 2);
    },
  );
}

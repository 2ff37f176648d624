// Liveness: a lost node or a hung rank is found in seconds, not when a collective times out.
//
// Between nodes (`flotilla run --nnodes M`): the launchers, which never block, keep a heartbeat.
// Node 0's launcher listens on MASTER_ADDR (only) at the heartbeat port (FLOTILLA_HEARTBEAT_PORT,
// default MASTER_PORT + max restarts + 1, next to the store ports of the attempts), and every other
// node's launcher connects and proves it knows FLOTILLA_JOB_SECRET (HMAC-SHA256 of a nonce, as the
// store does). Both sides send a beat every FLOTILLA_HEARTBEAT_MS (default 5 s). A side that hears
// nothing from a peer for FLOTILLA_HEARTBEAT_TIMEOUT_MS (default 25 s, checked every second, so a
// lost node is reported within 30 s of its last beat), or whose connection breaks,
// declares that node lost: node 0 names the node and its ranks to the others, and every launcher
// stops its ranks and exits non-zero. When a node's ranks fail (a rank throws or dies), its launcher
// says so on the heartbeat before it stops, so the ranks on the other nodes stop within a beat
// instead of waiting for a collective to time out. A node whose ranks all finished says goodbye, and
// is no longer watched.
//
// Within a node: a rank that is stopped (SIGSTOP, a debugger) for the heartbeat timeout is hung; the
// launcher reads each rank's state from /proc (watchStopped) and treats it like a rank that failed.
//
// An elastic job (--nnodes MIN:MAX, launcher.ts): once every node has joined, node 0 sends all the
// address book of the meeting (`roster`), so the survivors of a lost node 0 know where to meet; a
// lost node is named by number; the proof names the meeting's generation; and node 0 of a later
// meeting admits a host proving itself as a first meeting's node as one asking to join (`grow`).
// [Note: grow told to every node] Node 0 tells the next meeting to every node of this one, including
// a node that joins this meeting after the host asked (under load a survivor can reach the meeting
// after the returning host does): it hears `grow` right after `welcome`. A node that never heard
// it would take its ranks' stop at the checkpoint for the end of the run, and node 0 would wait for
// it at the next meeting for ever. A node whose ranks stopped for the next meeting says `bye`, so
// its connection closing is not a lost host; one lost before then is found as always. Once a node
// is lost, node 0 admits no one to this meeting (a restarted host must ask the next one).
//
// [Note: master address list] With --master-addr A,B,C a launcher of the first generation looks for
// node 0 at each address in turn (a connection that is not answered within 2 s is given up), so a
// host that starts late, or again after it was lost, finds node 0 wherever the job met last. Node 0
// with such a list first asks each other address once whether a job runs there (it may be the lost
// master coming back, and another host node 0 now); nobody answering, it listens, as at a start.
//
// Messages are JSON lines of at most 4 KiB; a connection that sends more, or does not prove
// membership within 10 s, is dropped. Policy (intervals, who is blamed) lives here, in TypeScript.
import { createServer, connect, type Server, type Socket } from 'node:net';
import { createHmac, randomBytes, timingSafeEqual } from 'node:crypto';
import { readdirSync, readFileSync } from 'node:fs';

export const DEFAULT_HEARTBEAT_MS = 5000;
/** Silence tolerated; checked every second, so a lost node is reported within 26 s of its last beat (under 30 s). */
export const DEFAULT_HEARTBEAT_TIMEOUT_MS = 25_000;
const MAX_LINE = 4096;
const AUTH_DEADLINE_MS = 10_000;
/** An address whose heartbeat has not answered this long is tried again later ([Note: master address list]). */
const CONNECT_DEADLINE_MS = 2000;

export interface HeartbeatConfig {
  intervalMs: number;
  timeoutMs: number;
}

function positive(env: Record<string, string | undefined>, name: string, fallback: number): number {
  const raw = env[name]?.trim();
  if (!raw) return fallback;
  const v = Number(raw);
  if (!/^\d+$/.test(raw) || !Number.isSafeInteger(v) || v < 1) throw new Error(`${name}=${JSON.stringify(env[name])} is not a positive integer (milliseconds)`);
  return v;
}

/** FLOTILLA_HEARTBEAT_MS and FLOTILLA_HEARTBEAT_TIMEOUT_MS (the timeout must exceed the interval). */
export function heartbeatConfig(env: Record<string, string | undefined> = process.env): HeartbeatConfig {
  const intervalMs = positive(env, 'FLOTILLA_HEARTBEAT_MS', DEFAULT_HEARTBEAT_MS);
  const timeoutMs = positive(env, 'FLOTILLA_HEARTBEAT_TIMEOUT_MS', Math.max(DEFAULT_HEARTBEAT_TIMEOUT_MS, 3 * intervalMs));
  if (timeoutMs <= intervalMs) {
    throw new Error(`FLOTILLA_HEARTBEAT_TIMEOUT_MS=${timeoutMs} must be larger than FLOTILLA_HEARTBEAT_MS=${intervalMs} (a few beats, e.g. 6x)`);
  }
  return { intervalMs, timeoutMs };
}

/** A node's answer to a nonce; the membership's generation is in it, so a launcher never joins a meeting it has left. */
function proof(secret: string, nonce: string, node: number, generation: number): string {
  return createHmac('sha256', secret).update(`flotilla-heartbeat-v1:${nonce}:${node}${generation > 0 ? `:${generation}` : ''}`).digest('hex');
}

type Message =
  | { t: 'hello'; nonce: string }
  | { t: 'join'; node: number; proof: string }
  | { t: 'welcome' }
  | { t: 'beat' }
  | { t: 'bye'; node: number }
  | { t: 'fail'; node: number; why: string }
  | { t: 'lost'; node: number; why: string }
  | { t: 'roster'; addrs: string[] }
  | { t: 'grow' } & Grow;

/** The next meeting of an elastic job with a host that joins ([Note: elastic grow] in launcher.ts). */
export interface Grow {
  /** Every host's address, node 0 first, the joining host last. */
  addrs: string[];
  /** Their node ranks at the first meeting (the joining host's --node-rank last). */
  ids: number[];
  /** The meeting's generation (its first attempt number). */
  generation: number;
}

/** JSON lines from a socket; undefined for a line that is too long or not JSON (the caller drops the peer). */
function onLines(sock: Socket, fn: (m: Message | undefined) => void): void {
  let buf = '';
  sock.setEncoding('utf8');
  sock.on('data', (d: string) => {
    buf += d;
    for (let nl = buf.indexOf('\n'); nl >= 0; nl = buf.indexOf('\n')) {
      const line = buf.slice(0, nl);
      buf = buf.slice(nl + 1);
      let m: Message | undefined;
      try {
        const v: unknown = JSON.parse(line);
        m = typeof v === 'object' && v !== null && typeof (v as { t?: unknown }).t === 'string' ? v as Message : undefined;
      } catch {
        m = undefined;
      }
      fn(m);
    }
    if (buf.length > MAX_LINE) fn(undefined);
  });
}

function send(sock: Socket | undefined, m: Message): void {
  if (sock && !sock.destroyed) sock.write(`${JSON.stringify(m)}\n`);
}

export interface NodeLinkOptions {
  nodeRank: number;
  nnodes: number;
  /** Ranks per node: names a node's ranks in messages. */
  nproc: number;
  host: string;
  port: number;
  secret: string;
  config: HeartbeatConfig;
  /** How long a node may take to connect at start (the process-group timeout). */
  joinTimeoutMs: number;
  /** Which meeting of an elastic job this is (0 the first; each shrink numbers the next one). */
  generation?: number;
  /** --master-addr A,B,C: every address node 0 may be at, `host` first ([Note: master address list]). */
  hosts?: string[];
  /**
   * A host joining a running job, bound for the meeting node 0 named: it waits as long as node 0
   * answers (the others are on their way to their next checkpoint), joinTimeoutMs after the last answer.
   */
  patient?: boolean;
  /**
   * Node 0 of a later meeting of an elastic job: a host that proves it knows the secret as a first
   * meeting's node asks to join. Returns the next meeting (told to every node and to it), or why not.
   */
  onAsk?: (node: number, addr: string) => Grow | string;
  /** Another node: node 0 announced the next meeting with a joining host. */
  onGrow?: (g: Grow) => void;
  /**
   * Another node's ranks failed (fatal = false: a restart may follow) or a node was lost (fatal,
   * `lost` its node rank): stop this node's ranks. Called once for a lost node.
   */
  onPeerDown: (why: string, fatal: boolean, lost?: number) => void;
}

function ranksOf(node: number, nproc: number): string {
  return nproc === 1 ? `rank ${node}` : `ranks ${node * nproc}-${node * nproc + nproc - 1}`;
}

/** One launcher's end of the heartbeat between nodes. */
export class NodeLink {
  private server: Server | undefined;
  private upstream: Socket | undefined;
  private readonly peers = new Map<number, { sock: Socket; last: number; addr: string }>();
  private readonly finished = new Set<number>();
  private timer: NodeJS.Timeout | undefined;
  private lastFromZero = Date.now();
  private down = false;
  private closed = false;
  /**
   * Every node's address, by node rank, once all have joined (node 0 learns them from the
   * connections and tells the others): where an elastic job meets again when node 0 is lost.
   */
  roster: string[] | undefined;
  /** Set when this host joined a running elastic job: the meeting it comes in at. */
  grow: Grow | undefined;

  private constructor(private readonly o: NodeLinkOptions) {}

  /** Node 0 listens; the others connect (retrying until joinTimeoutMs). Rejects naming the problem. */
  static async start(o: NodeLinkOptions): Promise<NodeLink> {
    const link = new NodeLink(o);
    const others = (o.hosts ?? []).filter((h) => h !== o.host);
    if (o.nodeRank === 0) {
      // A master coming back to a job that met elsewhere since ([Note: master address list]).
      if (others.length === 0 || !(await link.join(others, true))) await link.listen();
    } else await link.join(o.hosts ?? [o.host], false);
    let beat = 0;
    const every = Math.min(o.config.intervalMs, 1000);
    link.timer = setInterval(() => {
      beat += every;
      const send = beat >= o.config.intervalMs;
      if (send) beat = 0;
      link.tick(send);
    }, every);
    link.timer.unref();
    return link;
  }

  /** Node 0: the next meeting, once a host has asked to join ([Note: grow told to every node]). */
  private growing: Grow | undefined;

  private peerDown(why: string, fatal = true, lost?: number): void {
    if (this.down || this.closed) return;
    if (fatal) this.down = true;
    this.o.onPeerDown(why, fatal, lost);
  }

  private listen(): Promise<void> {
    const o = this.o;
    const srv = createServer({ noDelay: true }, (sock) => {
      const nonce = randomBytes(32).toString('hex');
      let node: number | undefined;
      const authTimer = setTimeout(() => sock.destroy(), AUTH_DEADLINE_MS);
      authTimer.unref();
      sock.on('error', () => sock.destroy());
      sock.on('close', () => {
        clearTimeout(authTimer);
        if (node === undefined || this.peers.get(node)?.sock !== sock) return;
        this.peers.delete(node);
        if (!this.finished.has(node)) this.lose(node, `node ${node} (${ranksOf(node, o.nproc)}) lost: its launcher's heartbeat connection closed`);
      });
      onLines(sock, (m) => {
        if (m === undefined) return void sock.destroy();
        if (node === undefined) {
          if (this.down) return void sock.destroy(); // after a loss this meeting is over: the host retries, and meets the next
          const gen = o.generation ?? 0;
          const proves = (g: number): boolean => m.t === 'join' && Number.isInteger(m.node) && typeof m.proof === 'string' &&
            /^[0-9a-f]{64}$/.test(m.proof) && timingSafeEqual(Buffer.from(m.proof, 'hex'), Buffer.from(proof(o.secret, nonce, m.node, g), 'hex'));
          if (gen > 0 && o.onAsk && proves(0)) {
            // A host started as the first meeting's node (a new one, or a lost one restarted): it joins at the next checkpoint.
            const grow = o.onAsk((m as { node: number }).node, (sock.remoteAddress ?? '').replace(/^::ffff:/, ''));
            if (typeof grow === 'string') send(sock, { t: 'lost', node: -1, why: grow });
            else {
              this.growing = grow;
              send(sock, { t: 'grow', ...grow });
              this.relay({ t: 'grow', ...grow }, 0);
            }
            sock.end();
            return;
          }
          const ok = m.t === 'join' && m.node > 0 && m.node < o.nnodes && proves(gen);
          if (!ok) return void sock.destroy();
          node = (m as { node: number }).node;
          clearTimeout(authTimer);
          this.peers.get(node)?.sock.destroy(); // a restarted launcher replaces its old connection
          this.finished.delete(node); // and is watched again, whatever the old one said
          this.peers.set(node, { sock, last: Date.now(), addr: (sock.remoteAddress ?? '').replace(/^::ffff:/, '') });
          send(sock, { t: 'welcome' });
          if (this.growing) send(sock, { t: 'grow', ...this.growing }); // asked before this node came
          if (this.peers.size === o.nnodes - 1 && this.roster === undefined) {
            this.roster = [o.host, ...Array.from({ length: o.nnodes - 1 }, (_, k) => this.peers.get(k + 1)!.addr)];
            this.relay({ t: 'roster', addrs: this.roster }, 0);
          }
          return;
        }
        const p = this.peers.get(node);
        if (p) p.last = Date.now();
        if (m.t === 'bye') this.finished.add(node);
        else if (m.t === 'fail') {
          const why = String(m.why).slice(0, 1000);
          this.relay({ t: 'fail', node, why }, node);
          this.peerDown(`node ${node} (${ranksOf(node, o.nproc)}) failed: ${why}`, false);
        }
      });
      send(sock, { t: 'hello', nonce });
    });
    this.server = srv;
    return new Promise((resolve, reject) => {
      srv.once('error', (e: NodeJS.ErrnoException) => reject(new Error(
        `could not serve the node heartbeat on ${o.host}:${o.port}: ${e.code === 'EADDRINUSE' ? 'the port is in use; set FLOTILLA_HEARTBEAT_PORT to a free port (the same on every node)' : e.message}`)));
      srv.listen(o.port, o.host, () => {
        srv.unref();
        resolve();
      });
    });
  }

  /**
   * Connects to node 0 at one of `hosts`, in turn, until welcomed or told of the meeting this host
   * joins (resolves true), or, with `once`, until each has been tried once (resolves false).
   */
  private join(hosts: string[], once: boolean): Promise<boolean> {
    const o = this.o;
    let deadline = Date.now() + o.joinTimeoutMs;
    let tried = 0;
    return new Promise((resolve, reject) => {
      const attempt = (): void => {
        const host = hosts[tried++ % hosts.length]!;
        const sock = connect({ host, port: o.port, noDelay: true });
        sock.setTimeout(CONNECT_DEADLINE_MS, () => sock.destroy()); // nobody there (a host gone): the next address
        let welcomed = false;
        sock.on('error', () => undefined);
        sock.on('close', () => {
          if (!welcomed) {
            const at = hosts.map((h) => `${h}:${o.port}`).join(', ');
            if (once && tried >= hosts.length) resolve(false);
            else if (Date.now() > deadline) reject(new Error(`no node heartbeat answered at ${at} within ${o.joinTimeoutMs} ms (is node 0's launcher running, with the same FLOTILLA_JOB_SECRET?)`));
            else setTimeout(attempt, tried % hosts.length === 0 ? 250 : 0); // keeps the launcher alive: nothing else does yet
            return;
          }
          if (!this.finished.has(0) && this.grow === undefined) this.peerDown(`node 0 (${ranksOf(0, o.nproc)}) lost: its launcher's heartbeat connection closed`, true, 0);
        });
        onLines(sock, (m) => {
          if (m === undefined) return void sock.destroy();
          this.lastFromZero = Date.now();
          sock.setTimeout(0); // node 0 answered: from here the heartbeat watches the connection
          if (o.patient) deadline = Date.now() + o.joinTimeoutMs;
          if (m.t === 'hello') send(sock, { t: 'join', node: o.nodeRank, proof: proof(o.secret, String(m.nonce), o.nodeRank, o.generation ?? 0) });
          else if (m.t === 'welcome') {
            welcomed = true;
            this.upstream = sock;
            sock.unref();
            resolve(true);
          } else if (m.t === 'bye') this.finished.add(0);
          else if (m.t === 'fail') this.peerDown(`node ${Number(m.node)} (${ranksOf(Number(m.node), o.nproc)}) failed: ${String(m.why)}`, false);
          else if (m.t === 'lost' && !welcomed) {
            welcomed = true; // refused by a running job: no retry
            reject(new Error(`node 0 refused this host: ${String(m.why)}`));
          } else if (m.t === 'lost') this.peerDown(String(m.why), true, Number(m.node));
          else if (m.t === 'roster' && Array.isArray(m.addrs) && m.addrs.length === o.nnodes) this.roster = m.addrs.map(String);
          else if (m.t === 'grow' && Array.isArray(m.addrs) && Array.isArray(m.ids) && Number.isInteger(m.generation)) {
            const g: Grow = { addrs: m.addrs.map(String), ids: m.ids.map(Number), generation: m.generation };
            if (!welcomed) {
              // This host asked to join a running job: it comes in at the next meeting.
              this.grow = g;
              welcomed = true;
              resolve(true);
            } else this.o.onGrow?.(g);
          }
        });
      };
      attempt();
    });
  }

  /** Node 0: tells every other node that `node` is lost, then stops here too. */
  private lose(node: number, why: string): void {
    if (this.down || this.closed) return;
    this.relay({ t: 'lost', node, why }, node);
    this.peerDown(why, true, node);
  }

  private relay(m: Message, except: number): void {
    for (const [k, p] of this.peers) if (k !== except) send(p.sock, m);
  }

  private tick(beat: boolean): void {
    const now = Date.now();
    const { timeoutMs } = this.o.config;
    if (this.o.nodeRank === 0) {
      for (const [k, p] of this.peers) {
        if (beat) send(p.sock, { t: 'beat' });
        if (!this.finished.has(k) && now - p.last > timeoutMs) {
          p.sock.destroy();
          this.lose(k, `node ${k} (${ranksOf(k, this.o.nproc)}) lost: no heartbeat for ${now - p.last} ms (FLOTILLA_HEARTBEAT_TIMEOUT_MS=${timeoutMs})`);
        }
      }
    } else {
      if (beat) send(this.upstream, { t: 'beat' });
      if (!this.finished.has(0) && now - this.lastFromZero > timeoutMs) {
        this.upstream?.destroy();
        this.peerDown(`node 0 (${ranksOf(0, this.o.nproc)}) lost: no heartbeat for ${now - this.lastFromZero} ms (FLOTILLA_HEARTBEAT_TIMEOUT_MS=${timeoutMs})`, true, 0);
      }
    }
  }

  /** This node's ranks failed: tell the others (node 0 relays) so they stop now. */
  announceFailure(why: string): void {
    if (this.o.nodeRank === 0) this.relay({ t: 'fail', node: 0, why }, 0);
    else send(this.upstream, { t: 'fail', node: this.o.nodeRank, why });
  }

  /** This node's ranks all finished: the others stop watching it. */
  announceDone(): void {
    if (this.o.nodeRank === 0) this.relay({ t: 'bye', node: 0 }, 0);
    else send(this.upstream, { t: 'bye', node: this.o.nodeRank });
  }

  /** Stops beating; flushes what was said last. */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    if (this.timer) clearInterval(this.timer);
    const socks = [...[...this.peers.values()].map((p) => p.sock), ...(this.upstream ? [this.upstream] : [])];
    await Promise.all(socks.map((s) => new Promise<void>((res) => {
      if (s.destroyed) return res();
      const t = setTimeout(() => {
        s.destroy();
        res();
      }, 1000);
      t.unref();
      s.end(() => {
        clearTimeout(t);
        res();
      });
    })));
    await new Promise<void>((res) => (this.server ? this.server.close(() => res()) : res()));
  }
}

// ---------------------------------------------------------------------------------------------
// Ranks that are stopped

/** The state letter of a process (R, S, D, T, t, Z, ...), or undefined when it is gone. */
function procState(pid: number): string | undefined {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return stat.slice(stat.lastIndexOf(')') + 2, stat.lastIndexOf(')') + 3);
  } catch {
    return undefined;
  }
}

/** pid and every process below it (from /proc: parent links). */
export function processTree(root: number): number[] {
  const children = new Map<number, number[]>();
  let entries: string[] = [];
  try {
    entries = readdirSync('/proc').filter((e) => /^\d+$/.test(e));
  } catch {
    return [root];
  }
  for (const e of entries) {
    try {
      const stat = readFileSync(`/proc/${e}/stat`, 'utf8');
      const ppid = Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]);
      const list = children.get(ppid) ?? [];
      list.push(Number(e));
      children.set(ppid, list);
    } catch {
      // gone meanwhile
    }
  }
  const out: number[] = [];
  const todo = [root];
  while (todo.length > 0 && out.length < 10_000) {
    const p = todo.pop()!;
    out.push(p);
    todo.push(...(children.get(p) ?? []));
  }
  return out;
}

/**
 * Watches processes for being stopped: every intervalMs, `pids()` lists (label, pid) pairs; one
 * whose state has been T (stopped) or t (traced) for timeoutMs is reported once through onHung.
 * Returns a function that stops the watch.
 */
export function watchStopped(
  pids: () => { label: string; pid: number }[], config: HeartbeatConfig, onHung: (label: string, pid: number, ms: number) => void,
): () => void {
  const since = new Map<number, number>();
  let reported = false;
  const timer = setInterval(() => {
    if (reported) return;
    const now = Date.now();
    const seen = new Set<number>();
    for (const { label, pid } of pids()) {
      seen.add(pid);
      const s = procState(pid);
      if (s !== 'T' && s !== 't') {
        since.delete(pid);
        continue;
      }
      const t0 = since.get(pid) ?? now;
      since.set(pid, t0);
      if (now - t0 >= config.timeoutMs) {
        reported = true;
        onHung(label, pid, now - t0);
        return;
      }
    }
    for (const p of since.keys()) if (!seen.has(p)) since.delete(p);
  }, Math.min(config.intervalMs, 1000));
  timer.unref();
  return () => clearInterval(timer);
}

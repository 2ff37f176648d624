// Checkpoint bytes between hosts that share no storage ([Note: checkpoint replicas] in
// checkpoint.ts): the copy of each rank's file sent to the next host when saving, the ranks'
// indexes gathered for meta.json, and, when a run resumes on hosts that each hold part of a
// checkpoint (after a lost host), the newest checkpoint they hold together, completed on every host.
// Every function here is collective over the world.
import { existsSync, mkdirSync, readFileSync, readdirSync, statSync } from 'node:fs';
import { createHash } from 'node:crypto';
import { join } from 'node:path';
import { Tensor, tidy, tensor, zeros } from '../tensor/index.js';
import { native } from '../tensor/native.js';
import { dtypeCode } from '../tensor/dtype.js';
import type { ProcessGroup } from '../distributed/process_group.js';
import { fsyncDir, writeDurable } from '../io/durable.js';
import { LATEST_FILE, META_FILE, stepDirName, type CheckpointMeta } from './format.js';

const REPLICA_TAG = 0x7e91;
const FETCH_TAG = 0x7e93;

/** Bytes as a uint8 tensor (a copy: the addon takes no shared memory). */
function bytesTensor(b: Uint8Array): Tensor {
  return new Tensor(native.fromBuffer(b.slice(), [b.byteLength], dtypeCode('uint8')));
}

function tensorBytes(t: Tensor, into: Uint8Array): Uint8Array {
  native.copyToBuffer(t.handle, into);
  return into;
}

/** Sends `b` to dst, its length first. */
function sendBytes(world: ProcessGroup, b: Uint8Array, dst: number, tag: number): void {
  tidy(() => {
    world.send(tensor([b.byteLength], { dtype: 'float64' }), dst, tag).wait();
    world.send(bytesTensor(b), dst, tag + 1).wait();
  });
}

/** Receives what sendBytes sent from src. */
function recvBytes(world: ProcessGroup, src: number, tag: number): Uint8Array {
  return tidy(() => {
    const n = zeros([1], { dtype: 'float64' });
    world.recv(n, src, tag).wait();
    const t = zeros([n.item()], { dtype: 'uint8' });
    world.recv(t, src, tag + 1).wait();
    return tensorBytes(t, new Uint8Array(t.numel()));
  });
}

/**
 * Sends this rank's staged file to the same local rank on the next host and receives the previous
 * host's into a buffer from `into` (send and receive in flight together, around the ring).
 */
export function exchangeReplica(
  world: ProcessGroup, staged: SharedArrayBuffer, length: number, ranksPerHost: number, into: { get(n: number): SharedArrayBuffer },
): { from: number; staged: SharedArrayBuffer; length: number } {
  const to = (world.rank + ranksPerHost) % world.size;
  const from = (world.rank - ranksPerHost + world.size) % world.size;
  return tidy(() => {
    const outLen = tensor([length], { dtype: 'float64' });
    const inLen = zeros([1], { dtype: 'float64' });
    for (const w of [world.send(outLen, to, REPLICA_TAG), world.recv(inLen, from, REPLICA_TAG)]) w.wait();
    const n = inLen.item();
    const got = zeros([n], { dtype: 'uint8' });
    for (const w of [world.send(bytesTensor(new Uint8Array(staged, 0, length)), to, REPLICA_TAG + 1), world.recv(got, from, REPLICA_TAG + 1)]) w.wait();
    const buf = into.get(n);
    tensorBytes(got, new Uint8Array(buf, 0, n));
    return { from, staged: buf, length: n };
  });
}

/** Every rank's value, in rank order (a JSON document per rank, gathered as padded bytes). */
export function gatherJson<T>(world: ProcessGroup, value: T): T[] {
  if (world.size === 1) return [value];
  const bytes = Buffer.from(JSON.stringify(value));
  return tidy(() => {
    const len = tensor([bytes.length], { dtype: 'float64' });
    world.allReduce(len, 'max').wait();
    const n = len.item();
    const padded = new Uint8Array(n).fill(0x20); // spaces: JSON.parse ignores them
    padded.set(bytes);
    const all = Array.from({ length: world.size }, () => zeros([n], { dtype: 'uint8' }));
    world.allGather(all, bytesTensor(padded)).wait();
    return all.map((t) => JSON.parse(Buffer.from(tensorBytes(t, new Uint8Array(n))).toString('utf8')) as T);
  });
}

/** Rank `src`'s value on every rank (a JSON document, broadcast as bytes). */
export function broadcastJson<T>(world: ProcessGroup, value: T | undefined, src = 0): T {
  if (world.size === 1) return value as T;
  const bytes = Buffer.from(world.rank === src ? JSON.stringify(value) : '');
  return tidy(() => {
    const len = tensor([bytes.length], { dtype: 'float64' });
    world.allReduce(len, 'max').wait();
    const n = len.item();
    const buf = bytesTensor(world.rank === src ? new Uint8Array(bytes) : new Uint8Array(n));
    world.broadcast(buf, src).wait();
    return JSON.parse(Buffer.from(tensorBytes(buf, new Uint8Array(n))).toString('utf8')) as T;
  });
}

/** What one host holds of each checkpoint in its directory: the files of meta.json present at their size. */
interface Holding {
  host: number;
  checkpoints: { step: number; files: string[]; have: string[] }[];
}

function holdingOf(dir: string, host: number): Holding {
  const checkpoints: Holding['checkpoints'] = [];
  if (existsSync(dir)) {
    for (const name of readdirSync(dir)) {
      const m = /^step-(\d+)$/.exec(name);
      const metaPath = join(dir, name, META_FILE);
      if (!m || !existsSync(metaPath)) continue;
      try {
        const meta = JSON.parse(readFileSync(metaPath, 'utf8')) as CheckpointMeta;
        const files = Object.keys(meta.files);
        const have = files.filter((f) => existsSync(join(dir, name, f)) && statSync(join(dir, name, f)).size === meta.files[f]!.bytes);
        checkpoints.push({ step: Number(m[1]), files: [...files, META_FILE], have: [...have, META_FILE] });
      } catch {
        // an unreadable index: this host does not hold that checkpoint
      }
    }
  }
  return { host, checkpoints };
}

export interface Gathered {
  /** This host's directory of the checkpoint, now complete (undefined: no checkpoint the hosts hold together). */
  path: string | undefined;
  step: number | undefined;
  /** Files and bytes sent between hosts to complete it. */
  files: number;
  bytes: number;
}

/**
 * The newest checkpoint whose files the hosts hold together (each file on at least one), copied
 * over the world so that every host's directory holds all of it; each host's first rank receives
 * and writes (fsynced, meta.json last, then `latest`). Collective over the world: every rank calls
 * it with its own host's directory.
 */
export function gatherNewest(world: ProcessGroup, dir: string, ranksPerHost: number): Gathered {
  const host = Math.floor(world.rank / ranksPerHost);
  const leader = world.rank % ranksPerHost === 0;
  const all = gatherJson<Holding | null>(world, leader ? holdingOf(dir, host) : null).filter((h): h is Holding => h !== null);
  // Steps, newest first, that some host has an index of and whose files the hosts hold together.
  const steps = [...new Set(all.flatMap((h) => h.checkpoints.map((c) => c.step)))].sort((a, b) => b - a);
  for (const step of steps) {
    const of = all.map((h) => h.checkpoints.find((c) => c.step === step));
    const files = of.find((c) => c !== undefined)!.files;
    const holder = (f: string): number | undefined => all.find((h, i) => of[i]?.have.includes(f))?.host;
    if (!files.every((f) => holder(f) !== undefined)) continue;
    // The plan, the same on every rank: for each host, each file it lacks, from the first host
    // holding it; meta.json first, so each copy is checked against its checksum as it arrives.
    const plan = all.flatMap((h, i) => files.filter((f) => !of[i]?.have.includes(f)).map((f) => ({ to: h.host, from: holder(f)!, file: f })));
    plan.sort((a, b) => a.to - b.to || Number(b.file === META_FILE) - Number(a.file === META_FILE) || a.file.localeCompare(b.file));
    const name = stepDirName(step);
    const target = join(dir, name);
    let meta: Uint8Array | undefined;
    const index = (): CheckpointMeta => JSON.parse(Buffer.from(meta ?? readFileSync(join(target, META_FILE))).toString('utf8')) as CheckpointMeta;
    for (const t of plan) {
      const src = t.from * ranksPerHost;
      const dst = t.to * ranksPerHost;
      if (world.rank === src) sendBytes(world, readFileSync(join(target, t.file)), dst, FETCH_TAG);
      else if (world.rank === dst) {
        const b = recvBytes(world, src, FETCH_TAG);
        if (t.file === META_FILE) {
          meta = b; // written last: until then the directory is not a checkpoint
          continue;
        }
        const want = index().files[t.file]?.sha256;
        const have = createHash('sha256').update(b).digest('hex');
        if (want !== have) throw new Error(`the copy of ${t.file} of ${name} received from host ${t.from} does not match its checksum`);
        mkdirSync(target, { recursive: true });
        writeDurable(join(target, t.file), b);
      }
    }
    const mine = plan.filter((t) => t.to === host);
    if (leader && mine.length > 0) {
      mkdirSync(target, { recursive: true });
      if (meta) writeDurable(join(target, META_FILE), meta);
      fsyncDir(target);
      writeDurable(join(dir, LATEST_FILE), `${name}\n`);
      fsyncDir(dir);
    }
    // Every host's copies are durable before any rank reads them; the bytes moved, for the log.
    const received = gatherJson(world, leader ? mine.reduce((a, t) => a + statSync(join(target, t.file)).size, 0) : 0);
    return { path: target, step, files: plan.length, bytes: received.reduce((a, b) => a + b, 0) };
  }
  return { path: undefined, step: undefined, files: 0, bytes: 0 };
}


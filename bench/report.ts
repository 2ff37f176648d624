// Shared benchmark helpers: statistics and the docs/BENCHMARKS.md section writer.
import { spawn, type ChildProcessWithoutNullStreams } from 'node:child_process';
import { createInterface } from 'node:readline';
import { existsSync, readFileSync, writeFileSync, mkdirSync } from 'node:fs';
import { freePort } from '../test/helpers/world.js';
import { cpus } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';

export function median(xs: number[]): number {
  if (xs.length === 0) return NaN;
  const s = [...xs].sort((a, b) => a - b);
  const m = Math.floor(s.length / 2);
  return s.length % 2 ? s[m]! : (s[m - 1]! + s[m]!) / 2;
}

const FILE = join(import.meta.dirname, '..', 'docs', 'BENCHMARKS.md');

/** Replaces (or appends) the section between <!-- name:begin --> and <!-- name:end -->. */
export function writeSection(name: string, body: string): void {
  mkdirSync(join(import.meta.dirname, '..', 'docs'), { recursive: true });
  let doc = existsSync(FILE) ? readFileSync(FILE, 'utf8') : '# Benchmarks\n\nEvery number here was measured by the command shown with it, flotilla and its PyTorch peer in the same run.\n';
  const begin = `<!-- ${name}:begin -->`, end = `<!-- ${name}:end -->`;
  const machine = `_Measured ${new Date().toISOString().slice(0, 10)} on ${cpus().length} x ${cpus()[0]?.model ?? 'cpu'}, Node ${process.version}._`;
  const block = `${begin}\n${body}\n\n${machine}\n${end}`;
  const i = doc.indexOf(begin), j = doc.indexOf(end);
  doc = i >= 0 && j > i ? doc.slice(0, i) + block + doc.slice(j + end.length) : `${doc.trimEnd()}\n\n${block}\n`;
  writeFileSync(FILE, doc);
}

/**
 * Runs a PyTorch peer script on `nproc` ranks (torchrun's variables, Gloo on loopback, one OpenMP
 * thread each) and resolves to every rank's output; a failing rank rejects with its output.
 */
export async function runTorchPeers(script: string, args: string[], nproc = 2): Promise<string[]> {
  const port = await freePort();
  const runs = Array.from({ length: nproc }, (_, rank) => new Promise<string>((res, rej) => {
    const child = spawn('/usr/bin/python3', [script, ...args], {
      env: { ...process.env, RANK: String(rank), WORLD_SIZE: String(nproc), LOCAL_RANK: String(rank), MASTER_ADDR: '127.0.0.1', MASTER_PORT: String(port), OMP_NUM_THREADS: '1' },
    });
    let out = '';
    child.stdout.on('data', (d) => (out += d));
    child.stderr.on('data', (d) => (out += d));
    child.on('exit', (code) => (code === 0 ? res(out) : rej(new Error(`PyTorch rank ${rank} exited ${code}:\n${out}`))));
  }));
  return Promise.all(runs);
}

/** The JSON a benchmark rank printed after 'BENCH '. */
export function parseBench<T>(out: string): T {
  const line = out.split('\n').find((l) => l.includes('BENCH '));
  if (!line) throw new Error(`a benchmark rank printed no result:\n${out}`);
  return JSON.parse(line.slice(line.indexOf('BENCH ') + 6)) as T;
}

/**
 * A PyTorch peer script alive for a whole benchmark run, one OpenMP thread: the benchmark writes a
 * JSON line to its stdin and reads its JSON line answers (next()); close() ends it.
 */
export class PythonPeer {
  protected readonly child: ChildProcessWithoutNullStreams;
  private readonly lines: AsyncIterator<string>;
  private stderr = '';
  constructor(script: string, args: string[]) {
    this.child = spawn(process.env.FLOTILLA_PYTHON ?? '/usr/bin/python3', [script, ...args], {
      env: { ...process.env, OMP_NUM_THREADS: '1', MKL_NUM_THREADS: '1' }, stdio: ['pipe', 'pipe', 'pipe'],
    });
    this.child.stderr.on('data', (d: Buffer) => (this.stderr += d.toString()));
    this.lines = createInterface({ input: this.child.stdout })[Symbol.asyncIterator]();
  }
  /** The peer's next JSON line. */
  async next(): Promise<any> {
    const r = await this.lines.next();
    if (r.done) throw new Error(`PyTorch peer exited early:\n${this.stderr}`);
    return JSON.parse(r.value);
  }
  /** Sends one request line and returns the answer. */
  async ask(request: object): Promise<any> {
    this.child.stdin.write(`${JSON.stringify(request)}\n`);
    return this.next();
  }
  /** The peer's process id (its /proc/<pid>/status holds its memory). */
  get pid(): number {
    return this.child.pid!;
  }
  close(): void {
    this.child.stdin.end('\n');
  }
}

/**
 * Runs a benchmark's main when its file is the process's script (`url`: its import.meta.url); a file
 * imported by another benchmark for its shapes and helpers runs nothing. A failure prints its message
 * and exits 1.
 */
export function runIfMain(url: string, main: () => Promise<void>): void {
  if (!process.argv[1] || fileURLToPath(url) !== process.argv[1]) return;
  main().catch((e) => {
    console.error(e instanceof Error ? e.message : e);
    process.exit(1);
  });
}

// Runs a PyTorch oracle script (test/oracle/<script>.py) on tensors from a test: inputs go out as a
// safetensors file, the script computes the same thing in PyTorch, and its results come back the same
// way. The oracle is /usr/bin/python3 with torch (override with FLOTILLA_PYTHON). The calls of one
// test process share one Python process (test/oracle/serve.py), which pays `import torch` once.
import { spawn, spawnSync } from 'node:child_process';
import { closeSync, constants, existsSync, mkdtempSync, openSync, readFileSync, rmSync, writeSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Tensor } from '../../src/tensor/index.js';
import { saveSafetensors, loadSafetensorsWithMetadata } from '../../src/checkpoint/safetensors.js';

export const ORACLE_PYTHON = process.env.FLOTILLA_PYTHON ?? '/usr/bin/python3';
const HERE = dirname(fileURLToPath(import.meta.url));
const PY_ENV = { ...process.env, OMP_NUM_THREADS: '1', MKL_NUM_THREADS: '1', PYTHONDONTWRITEBYTECODE: '1' };

let available: string | undefined | null = null;

/**
 * Why oracle tests are skipped: only when FLOTILLA_SKIP_ORACLE=1 says so. scripts/setup.sh installs
 * python3-torch, so a missing or broken oracle is a failure (runOracle names it), never a silent pass.
 */
export function oracleMissing(): string | undefined {
  return process.env.FLOTILLA_SKIP_ORACLE === '1' ? 'FLOTILLA_SKIP_ORACLE=1' : undefined;
}

function oracleProblem(): string | undefined {
  if (available === null) {
    const r = spawnSync(ORACLE_PYTHON, ['-c', 'import torch'], { encoding: 'utf8', env: PY_ENV });
    available = r.status === 0 ? undefined : `PyTorch oracle unavailable (${ORACLE_PYTHON} -c "import torch" failed: ${(r.stderr || String(r.error)).trim().split('\n').pop()}); run scripts/setup.sh as root (installs python3-torch)`;
  }
  return available;
}

export interface OracleResult {
  tensors: Record<string, Tensor>;
  metadata: Record<string, string>;
}

/** The Python process serving this test process's oracle calls, started on the first. */
let server: { pid: number; dir: string; req: number; next: number } | undefined;

const sleep = (ms: number): void => void Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);

/** Whether the server runs (a zombie, ended but not yet reaped while this thread blocks, does not). */
function serverAlive(pid: number): boolean {
  try {
    return !/^\d+ \(.*\) Z/.test(readFileSync(`/proc/${pid}/stat`, 'utf8'));
  } catch {
    return false;
  }
}

function serverLog(dir: string): string {
  try {
    return readFileSync(join(dir, 'log'), 'utf8').trim();
  } catch {
    return '';
  }
}

function startServer(): NonNullable<typeof server> {
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-oracle-server-'));
  const fifo = spawnSync('mkfifo', [join(dir, 'req')], { encoding: 'utf8' });
  if (fifo.status !== 0) throw new Error(`mkfifo failed: ${fifo.stderr || String(fifo.error)}`);
  const log = openSync(join(dir, 'log'), 'w');
  const child = spawn(ORACLE_PYTHON, [join(HERE, 'serve.py'), dir], { env: PY_ENV, cwd: HERE, stdio: ['ignore', log, log] });
  closeSync(log);
  child.unref();
  child.on('error', () => undefined); // a python that cannot start is seen below, by its pid
  // The FIFO opens once the server has opened its end (before it imports torch); this process's
  // exit closes it, which ends the server.
  for (const end = Date.now() + 60_000; ;) {
    try {
      const req = openSync(join(dir, 'req'), constants.O_WRONLY | constants.O_NONBLOCK);
      process.once('exit', () => rmSync(dir, { recursive: true, force: true }));
      return { pid: child.pid!, dir, req, next: 0 };
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code !== 'ENXIO') throw e;
    }
    if (child.pid === undefined || !serverAlive(child.pid) || Date.now() > end) {
      const said = serverLog(dir);
      rmSync(dir, { recursive: true, force: true });
      throw new Error(oracleProblem() ?? `the PyTorch oracle server did not start (${ORACLE_PYTHON} test/oracle/serve.py)${said ? `:\n${said}` : ''}`);
    }
    sleep(5);
  }
}

/** Runs `python3 <argv>` in the server; its exit status and stderr. */
function serve(argv: string[]): { status: number; stderr: string } {
  const s = (server ??= startServer());
  const id = s.next++;
  // The FIFO is non-blocking: a request longer than the pipe holds is written as the server drains it.
  const line = Buffer.from(`${JSON.stringify({ id, argv })}\n`);
  for (let at = 0; at < line.length;) {
    try {
      at += writeSync(s.req, line, at);
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code !== 'EAGAIN') throw e;
      sleep(1);
    }
  }
  const done = join(s.dir, `done-${id}.json`);
  for (let wait = 1; !existsSync(done); wait = Math.min(10, wait * 2)) {
    if (!serverAlive(s.pid)) {
      closeSync(s.req);
      server = undefined;
      throw new Error(`the PyTorch oracle server (${ORACLE_PYTHON} test/oracle/serve.py) ended while running ${argv[0]}:\n${serverLog(s.dir)}`);
    }
    sleep(wait);
  }
  const r = JSON.parse(readFileSync(done, 'utf8')) as { status: number; stderr: string };
  rmSync(done);
  return r;
}

/**
 * Runs `python3 test/oracle/<script>.py in.safetensors out.safetensors '<json args>'` (in the server) and
 * returns what it wrote. Throws with the script's stderr when it fails.
 */
export function runOracle(script: string, inputs: Record<string, Tensor>, args: unknown = {}): OracleResult {
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-oracle-'));
  try {
    const inPath = join(dir, 'in.safetensors');
    const outPath = join(dir, 'out.safetensors');
    saveSafetensors(inPath, inputs);
    const r = serve([join(HERE, `${script}.py`), inPath, outPath, JSON.stringify(args)]);
    if (r.status !== 0) throw new Error(`oracle ${script}.py failed (exit ${r.status}):\n${r.stderr}`);
    return loadSafetensorsWithMetadata(outPath);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

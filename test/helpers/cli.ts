// `flotilla ARGS` as a child process for tests: the installed entry point (bin/flotilla.js) with a
// timeout, its output collected. No side effects at import.
import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { writeSeries } from '../../src/cli/train_run.js';

export const ROOT = resolve(import.meta.dirname, '..', '..');
export const BIN = join(ROOT, 'bin', 'flotilla.js');

/**
 * For the environment of a `flotilla train` that does not test the run report: rank 0 then draws no
 * RUN/report.html (about half a second of CPU per run).
 */
export const NO_REPORT = { FLOTILLA_REPORT: '0' } as const;

export interface Flotilla {
  code: number | null;
  out: string;
  err: string;
}

export interface FlotillaOptions {
  /** Killed (and the promise rejected) after this long; default 180 s. */
  timeoutMs?: number;
  /** Working directory (default: the repository root). */
  cwd?: string;
  /** Extra environment (FLOTILLA_REPORT defaults to 0: pass FLOTILLA_REPORT: '1' for a report). */
  env?: Record<string, string>;
  /** Gets the child as soon as it starts (for signals). */
  onStart?: (c: ChildProcess) => void;
  /** Runs the command through another (e.g. inside a network namespace: test/helpers/hosts.ts). */
  via?: (cmd: string, args: string[]) => [string, string[]];
}

/** Runs `flotilla ARGS`; resolves with the exit code and output, rejects on timeout. */
export function flotilla(args: string[], o: FlotillaOptions = {}): Promise<Flotilla> {
  return new Promise((res, rej) => {
    const [cmd, argv] = o.via ? o.via(process.execPath, [BIN, ...args]) : [process.execPath, [BIN, ...args]];
    const child = spawn(cmd, argv, { cwd: o.cwd ?? ROOT, env: { ...process.env, FLOTILLA_TEST_CHILD: '1', ...NO_REPORT, ...o.env } });
    let out = '';
    let err = '';
    child.stdout.on('data', (d) => (out += d));
    child.stderr.on('data', (d) => (err += d));
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      rej(new Error(`flotilla ${args.join(' ')} timed out\n${out}\n${err}`));
    }, o.timeoutMs ?? 180_000);
    o.onStart?.(child);
    child.on('close', (code) => {
      clearTimeout(timer);
      res({ code, out, err });
    });
  });
}

/**
 * Several `flotilla train` runs (each given by its arguments) one after another in one world:
 * `flotilla train-series` (the world's process starts and rendezvous paid once) under `flotilla run`
 * with nproc ranks on Gloo, or in this process's child alone when nproc is 1. The series file is
 * written to `file`, or to a temporary directory of its own.
 */
export function flotillaSeries(nproc: number, runs: string[][], o: FlotillaOptions & { file?: string } = {}): Promise<Flotilla> {
  const file = o.file ?? join(mkdtempSync(join(tmpdir(), 'flotilla-series-')), 'series.json');
  writeSeries(file, runs);
  const args = nproc === 1 ? ['train-series', file] : ['run', '--nproc', String(nproc), '--backend', 'gloo', BIN, 'train-series', file];
  return flotilla(args, { timeoutMs: 600_000, ...o });
}

/** Layout i's block of a `flotilla verify ... --and ...` output: from its `verify: K step(s)` line to the next one. */
export function verifyBlock(out: string, i: number): string {
  return out.split(/^(?=verify: \d+ step)/m).filter((b) => b.startsWith('verify: '))[i] ?? '';
}

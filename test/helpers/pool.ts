// Independent launches of one test file, a few at a time: most of a small launch is process
// start-up (tsx, the addon), which overlaps well with another launch's training and rendezvous.
// Jobs start in the order they are queued. No side effects at import.
import { spawn } from 'node:child_process';

/**
 * Default: two launches at once. On the 2-core test machine four 2-rank `flotilla train` runs of the
 * checkpoint tests' config took 89 s one after another and 56 s two at a time. FLOTILLA_TEST_LAUNCHES=1
 * runs every launch of a file in turn.
 */
export const CONCURRENT_LAUNCHES = Math.max(1, Number(process.env.FLOTILLA_TEST_LAUNCHES || 2));

/** A queue that runs at most `n` of its jobs at once. */
export function pool(n = CONCURRENT_LAUNCHES): <T>(job: () => Promise<T>) => Promise<T> {
  let active = 0;
  const waiting: (() => void)[] = [];
  const next = (): void => {
    if (active >= n) return;
    const start = waiting.shift();
    if (start) {
      active++;
      start();
    }
  };
  return <T>(job: () => Promise<T>): Promise<T> =>
    new Promise<T>((res, rej) => {
      waiting.push(() => {
        job().then(res, rej).finally(() => {
          active--;
          next();
        });
      });
      next();
    });
}

/**
 * A promise started now whose failure is reported by the test that awaits it (not as an unhandled
 * rejection of the file when it fails before any test gets there).
 */
export function started<T>(p: Promise<T>): Promise<T> {
  p.catch(() => {});
  return p;
}

export interface Spawned {
  status: number | null;
  signal: NodeJS.Signals | null;
  stdout: string;
  stderr: string;
}

/**
 * spawnSync's result without blocking the test process, so that several launches can run at once:
 * resolves when the child has exited; a child past `timeout` ms is killed (SIGTERM, as spawnSync).
 */
export function spawnAsync(cmd: string, args: string[], o: { cwd?: string; env?: NodeJS.ProcessEnv; timeout?: number } = {}): Promise<Spawned> {
  return new Promise((res) => {
    const child = spawn(cmd, args, { cwd: o.cwd, env: o.env ?? process.env, stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d) => (stdout += d));
    child.stderr.on('data', (d) => (stderr += d));
    const timer = o.timeout ? setTimeout(() => child.kill('SIGTERM'), o.timeout) : undefined;
    child.on('error', (e) => (stderr += `\n${e.message}`));
    child.on('close', (status, signal) => {
      clearTimeout(timer);
      res({ status, signal, stdout, stderr });
    });
  });
}

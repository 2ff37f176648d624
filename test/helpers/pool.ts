// Independent launches of one test file, a few at a time: most of a small launch is process
// start-up (tsx, the addon), which overlaps well with another launch's training and rendezvous.
// Jobs start in the order they are queued. No side effects at import.
//
// The suite runs three test files at once (scripts/test.ts) so that one-process
// files fill the second core; the launches of all files together are held to the same limit
// through slots in a directory every file of one `node --test` run shares (suiteSlots below), so
// two launch-heavy files side by side take turns instead of running four launches at once.
import { spawn } from 'node:child_process';
import { test, type TestContext } from 'node:test';
import { mkdirSync, readlinkSync, symlinkSync, unlinkSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

/**
 * Default: two launches at once. On the 2-core test machine four 2-rank `flotilla train` runs of the
 * checkpoint tests' config took 89 s one after another and 56 s two at a time. FLOTILLA_TEST_LAUNCHES=1
 * runs every launch of a file in turn.
 */
export const CONCURRENT_LAUNCHES = Math.max(1, Number(process.env.FLOTILLA_TEST_LAUNCHES || 2));

/**
 * A queue that runs at most `n` of its jobs at once, each also holding one of the suite's launch
 * slots while it runs (suiteSlots).
 */
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
        suiteSlots.acquire()
          .then((slot) => job().finally(() => suiteSlots.release(slot)))
          .then(res, rej)
          .finally(() => {
            active--;
            next();
          });
      });
      next();
    });
}

/**
 * Launch slots shared by the test files of one `node --test` run (its files are children of one
 * runner process, so the directory is named after the parent's pid): a slot is a symbolic link
 * slot-<i> whose target is the holder's pid, made atomically; a slot whose holder has exited (a
 * file that crashed or was killed) is taken over. Best effort: it only spreads load (a lost race
 * means one launch more at a time, never a wrong result). FLOTILLA_TEST_LAUNCHES sets the number.
 */
export const suiteSlots = {
  dir: join(tmpdir(), `flotilla-test-launches-${process.ppid}`),
  held: new Set<string>(),

  async acquire(): Promise<string> {
    for (;;) {
      for (let i = 0; i < CONCURRENT_LAUNCHES; i++) {
        const slot = this.take(i);
        if (slot) return slot;
      }
      await new Promise((r) => setTimeout(r, 100));
    }
  },

  /** Slot i if it is free (or its holder has exited), else undefined. */
  take(i: number): string | undefined {
    if (!exitHook) {
      exitHook = true;
      process.on('exit', releaseAll);
    }
    // Made on every attempt: nothing removes it during a run, but a cleaner of the temporary
    // directory might, and a missing directory must not look like a slot held forever.
    mkdirSync(this.dir, { recursive: true });
    const slot = join(this.dir, `slot-${i}`);
    try {
      symlinkSync(String(process.pid), slot);
      this.held.add(slot);
      return slot;
    } catch {
      if (!holderAlive(slot)) {
        try {
          unlinkSync(slot);
        } catch {
          // another waiter took it over first
        }
      }
      return undefined;
    }
  },

  /**
   * Every slot, taken in index order (two files asking for all cannot each hold half), for as long
   * as this file runs: for files whose worlds time out in seconds (heartbeats, rendezvous and
   * collective timeouts), so that no launch of another file shares the cores with them.
   */
  async holdAll(): Promise<void> {
    for (let i = 0; i < CONCURRENT_LAUNCHES; i++) {
      while (!this.take(i)) await new Promise((r) => setTimeout(r, 100));
    }
  },

  release(slot: string): void {
    this.held.delete(slot);
    try {
      unlinkSync(slot);
    } catch {
      // already taken over
    }
  },
};

function holderAlive(slot: string): boolean {
  let pid: number;
  try {
    pid = Number(readlinkSync(slot));
  } catch {
    return true; // released meanwhile: try it again on the next round
  }
  if (pid === process.pid) return true; // a slot of this file (another job of it)
  try {
    process.kill(pid, 0);
    return true;
  } catch (e) {
    return (e as NodeJS.ErrnoException).code === 'EPERM';
  }
}

let exitHook = false;
/** At exit: this file's slots are freed (the directory stays: another file may be about to use it). */
function releaseAll(): void {
  for (const slot of suiteSlots.held) {
    try {
      unlinkSync(slot);
    } catch {
      // already gone
    }
  }
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

/**
 * One test whose cases run side by side, as its subtests: for cases that mostly wait, idle (a
 * timeout, a dead peer's socket), while their file holds every launch slot (suiteSlots.holdAll).
 */
export function sideBySide(name: string, cases: [string, (t: TestContext) => Promise<void>][]): void {
  test(name, { concurrency: cases.length }, async (t) => {
    await Promise.all(cases.map(([what, fn]) => t.test(what, fn)));
  });
}

// Rank-side test helpers: report a JSON result to the test process, record checks without stopping
// at the first failure, and assert a tensor is identical on every member of a group.
import type { ProcessGroup } from '../../src/distributed/process_group.js';
import { Tensor, zeros } from '../../src/tensor/index.js';
import { RESULT_PREFIX } from './world.js';

/** Prints one result line that parseResults() (world.ts) reads back in the test. */
export function emitResult(obj: unknown): void {
  process.stdout.write(`${RESULT_PREFIX}${JSON.stringify(obj)}\n`);
}

/** Named checks: a failing one is recorded (with detail) and the rest still run. */
export class Checks {
  readonly passed: string[] = [];
  readonly failed: { name: string; detail: string }[] = [];

  ok(name: string, cond: boolean, detail = ''): void {
    if (cond) this.passed.push(name);
    else this.failed.push({ name, detail });
  }

  /** Elementwise |a - b| <= atol + rtol * |b|. */
  close(name: string, actual: ArrayLike<number>, expected: ArrayLike<number>, rtol = 1e-6, atol = 0): void {
    if (actual.length !== expected.length) {
      this.failed.push({ name, detail: `length ${actual.length}, expected ${expected.length}` });
      return;
    }
    for (let i = 0; i < actual.length; i++) {
      const a = actual[i]!, e = expected[i]!;
      if (!(Math.abs(a - e) <= atol + rtol * Math.abs(e))) {
        this.failed.push({ name, detail: `element ${i}: ${a}, expected ${e} (all: [${Array.from(actual).slice(0, 12).join(', ')}${actual.length > 12 ? ', ...' : ''}])` });
        return;
      }
    }
    this.passed.push(name);
  }

  /** Runs fn and expects it to throw an Error whose message matches every pattern. */
  throws(name: string, fn: () => unknown, ...patterns: RegExp[]): void {
    try {
      fn();
    } catch (e) {
      const msg = e instanceof Error ? e.message : String(e);
      const miss = patterns.filter((p) => !p.test(msg));
      if (miss.length === 0) this.passed.push(name);
      else this.failed.push({ name, detail: `message ${JSON.stringify(msg)} does not match ${miss.join(', ')}` });
      return;
    }
    this.failed.push({ name, detail: 'did not throw' });
  }

  /** Runs a block; an exception fails the check `name` instead of the whole script. */
  run(name: string, fn: () => void): void {
    try {
      fn();
    } catch (e) {
      this.failed.push({ name, detail: `threw: ${e instanceof Error ? e.stack ?? e.message : String(e)}` });
    }
  }

  summary(): { passed: number; failed: { name: string; detail: string }[]; names: string[] } {
    return { passed: this.passed.length, failed: this.failed, names: this.passed };
  }
}

/**
 * Throws unless t holds the same elements (bitwise, as float64) on every member of group. Every
 * member must call it (it all-gathers).
 */
export function assertSyncedAcross(group: ProcessGroup, t: Tensor, what = 'tensor'): void {
  const mine = t.to('float64');
  const outs = Array.from({ length: group.size }, () => zeros(t.shape, { dtype: 'float64' }));
  group.allGather(outs, mine).wait();
  const ref = mine.toNumbers();
  outs.forEach((o, r) => {
    const v = o.toNumbers();
    const i = v.findIndex((x, k) => !Object.is(x, ref[k]));
    if (i >= 0) {
      throw new Error(`${what} differs between group rank ${group.rank} and ${r} (global ${group.ranks[r]}) at element ${i}: ${ref[i]} vs ${v[i]}`);
    }
    o.dispose();
  });
  mine.dispose();
}

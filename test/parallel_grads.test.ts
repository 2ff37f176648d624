// The gradient API under every data-parallel mode, per-rank memory against theory, and parameters
// that some steps (or some ranks) do not use, on real ranks. The parts of one world size run one
// after another in one world (test/fixtures/grad_api_rank.ts): the API, memory and unused-parameter
// parts on 2 ranks, memory on 4, the unused-parameter reference in one process. The worlds are
// queued when the file loads, two at a time (test/helpers/pool.ts); each test awaits its parts.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { join } from 'node:path';
import { runWorld, parseAllResults } from './helpers/world.js';
import { pool, started } from './helpers/pool.js';

const script = join(import.meta.dirname, 'fixtures', 'grad_api_rank.ts');

type Part = 'api' | 'memory' | 'unused';
const queue = pool();
/** One world of nproc ranks running `parts` in turn; per part, the result of every rank. */
function world(nproc: number, parts: Part[]): Map<Part, Promise<unknown[]>> {
  const outputs = started(queue(async () => {
    const w = await runWorld({ nproc, script, args: [JSON.stringify({ parts })], timeoutMs: 240_000 + 120_000 * (parts.length - 1) });
    assert.deepEqual(w.codes, new Array(nproc).fill(0), w.outputs.join('\n'));
    return parseAllResults<{ part: Part }>(w.outputs);
  }));
  return new Map(parts.map((part) => [part, started(outputs.then((ranks) => ranks.map((rs, r) => {
    const res = rs.find((x) => x.part === part);
    assert.ok(res, `rank ${r} of ${nproc} printed no result for ${part}`);
    return res;
  })))]));
}
const worlds = new Map([[2, world(2, ['api', 'memory', 'unused'])], [4, world(4, ['memory'])], [1, world(1, ['unused'])]]);

async function run<T>(nproc: number, part: Part): Promise<T[]> {
  return (await worlds.get(nproc)!.get(part)!) as T[];
}

interface Mode {
  full: Record<string, number[]>;
  shards: Record<string, { offset: number; numel: number; fullNumel: number; values: number[] }>;
  gradRead: string;
  before: string;
  after: string;
  norm: number;
}

test('fullGrad is the same for every parameter under DDP, ZeRO-1, ZeRO-2 and ZeRO-3; shards concatenate to it; sharded .grad and reads outside the window give named errors', async () => {
  const ranks = await run<Record<string, Mode>>(2, 'api');
  const ref = ranks[0]!.zero0!;
  for (const [r, res] of ranks.entries()) {
    for (const z of [0, 1, 2, 3]) {
      const m = res[`zero${z}`]!;
      for (const [name, g] of Object.entries(ref.full)) {
        const mine = m.full[name]!;
        assert.equal(mine.length, g.length, `${name} under ZeRO-${z} on rank ${r}`);
        for (let i = 0; i < g.length; i++) assert.ok(Math.abs(mine[i]! - g[i]!) <= 1e-12 * Math.max(1, Math.abs(g[i]!)), `${name}[${i}] under ZeRO-${z} on rank ${r}: ${mine[i]} vs ${g[i]}`);
      }
      assert.ok(Math.abs(m.norm - ref.norm) <= 1e-12 * ref.norm, `norm under ZeRO-${z} on rank ${r}`);
      assert.match(m.before, /between finishGradSync\(\) and the optimizer step/);
      assert.match(m.after, /the optimizer has stepped/);
      if (z >= 2) assert.match(m.gradRead, new RegExp(`sharded under ZeRO-${z}.*fullGrad\\(param\\).*localGradShard\\(param\\)`));
      else assert.equal(m.gradRead, '', `.grad is readable under ZeRO-${z}`);
    }
  }
  // The two ranks' shards of each parameter tile it exactly, and hold its values.
  for (const z of [2, 3]) {
    for (const [name, g] of Object.entries(ref.full)) {
      const pieces = ranks.map((res) => res[`zero${z}`]!.shards[name]!).filter((s) => s.numel > 0).sort((a, b) => a.offset - b.offset);
      let at = 0;
      for (const s of pieces) {
        assert.equal(s.offset, at, `${name} ZeRO-${z}: shards tile the parameter`);
        assert.equal(s.fullNumel, g.length);
        s.values.forEach((v, i) => assert.ok(Math.abs(v - g[s.offset + i]!) <= 1e-12 * Math.max(1, Math.abs(v)), `${name} ZeRO-${z} shard value`));
        at += s.numel;
      }
      assert.equal(at, g.length, `${name} ZeRO-${z}: shards cover the parameter`);
    }
  }
});

interface Mem { paramBytes: number; gradBytes: number; optimizerBytes: number; peakBytes: number; numParams: number }

test('memory per rank matches theory for AdamW in float32 (DDP 16, ZeRO-1 8 + 8/N, ZeRO-2 4 + 12/N, ZeRO-3 16/N bytes/param) within 5%', async () => {
  for (const n of [2, 4]) {
    const ranks = await run<Record<string, Mem>>(n, 'memory');
    const theory: Record<string, [number, number, number]> = {
      zero0: [4, 4, 8], zero1: [4, 4, 8 / n], zero2: [4, 4 / n, 8 / n], zero3: [4 / n, 4 / n, 8 / n],
    };
    for (const [r, res] of ranks.entries()) {
      for (const [z, [p, g, o]] of Object.entries(theory)) {
        const m = res[z]!;
        const per = (b: number) => b / m.numParams;
        const close = (got: number, want: number, what: string) =>
          assert.ok(Math.abs(got - want) <= 0.05 * want, `${z} on ${n} ranks, rank ${r}: ${what} ${got.toFixed(3)} B/param, theory ${want.toFixed(3)}`);
        close(per(m.paramBytes), p, 'parameters');
        close(per(m.gradBytes), g, 'gradients');
        close(per(m.optimizerBytes), o, 'optimizer state');
        assert.ok(m.peakBytes >= m.paramBytes + m.gradBytes + m.optimizerBytes, `${z}: the step peak is at least what is held after it`);
      }
      // ZeRO-3's peak holds gathered units and full gradient buckets briefly, but stays well under DDP's.
      assert.ok(res.zero3!.peakBytes < res.zero0!.peakBytes, `ZeRO-3 peak ${res.zero3!.peakBytes} < DDP peak ${res.zero0!.peakBytes}`);
    }
  }
});

test('a parameter no rank used is skipped by the optimizer (no decay, no step); one used by any rank is stepped: equal to one process', async () => {
  type R = { params: number[]; norms: number[]; auxAfter: number[][] };
  const [single] = await run<R>(1, 'unused');
  const ranks = await run<R>(2, 'unused');
  for (const [r, res] of [single!, ...ranks].entries()) {
    // Step 2 (index 2): no rank uses the layer, so not even weight decay touches it; step 1: rank 1 does.
    assert.deepEqual(res.auxAfter[2], res.auxAfter[1], `run ${r}: an unused layer is not decayed or stepped`);
    assert.notDeepEqual(res.auxAfter[1], res.auxAfter[0], `run ${r}: a layer one rank used is stepped`);
  }
  for (const [r, res] of ranks.entries()) {
    res.norms.forEach((v, i) => assert.ok(Math.abs(v - single!.norms[i]!) <= 1e-9 * single!.norms[i]!, `rank ${r} norm at step ${i}: ${v} vs ${single!.norms[i]}`));
    let worst = 0;
    res.params.forEach((v, i) => (worst = Math.max(worst, Math.abs(v - single!.params[i]!))));
    assert.ok(worst <= 1e-9, `rank ${r}: parameters differ from one process by ${worst}`);
  }
});

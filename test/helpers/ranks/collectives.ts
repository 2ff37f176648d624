// One rank of the collectives test: runs every collective on the world with rank-dependent data,
// checks the numbers against what the ranks' data must reduce to, and reports the checks.
import { initProcessGroup } from '../../../src/distributed/process_group.js';
import * as T from '../../../src/tensor/index.js';
import type { DType, Tensor } from '../../../src/tensor/index.js';
import { Checks, emitResult, assertSyncedAcross } from '../rank.js';

const world = initProcessGroup({ timeoutMs: 30_000 });
const { rank: r, size: n } = world;
const c = new Checks();

function mk(values: number[], dtype: DType, shape?: number[]): Tensor {
  const t = T.tensor(Float64Array.from(values), { dtype });
  if (!shape) return t;
  const v = t.view(...shape);
  t.dispose();
  return v;
}
const range = (k: number): number[] => Array.from({ length: k }, (_, i) => i);
const sumOver = (f: (j: number) => number): number => range(n).reduce((a, j) => a + f(j), 0);
const tol = (d: DType): number => (d === 'bfloat16' ? 1e-2 : d === 'float32' ? 1e-6 : 0);

const before = T.liveTensors();
const DTYPES: DType[] = ['float32', 'float64', 'int64', 'bfloat16'];
const LENGTHS = [7, 4099]; // neither divides by 2 or 4

// ---- allReduce, every op, every dtype
for (const d of DTYPES) {
  for (const L of LENGTHS) {
    T.tidy(() => {
      const gens: Record<string, (j: number, i: number) => number> = {
        sum: (j, i) => j + 1 + (i % 5),
        avg: (j, i) => j + 1 + (i % 5),
        max: (j, i) => ((j + i) % n) + 1,
        min: (j, i) => ((j + i) % n) + 1,
        product: (j, i) => 1 + ((j + i) % 2),
      };
      for (const [op, g] of Object.entries(gens)) {
        const name = `allReduce ${op} ${d} L=${L}`;
        if (op === 'avg' && d === 'int64') {
          const t = mk(range(L).map((i) => g(r, i)), d);
          c.throws(`${name} rejected`, () => world.allReduce(t, 'avg'), /allReduce/, /'avg' needs a floating-point tensor, got int64/);
          continue;
        }
        c.run(name, () => {
          const t = mk(range(L).map((i) => g(r, i)), d);
          world.allReduce(t, op as 'sum').wait();
          const exp = range(L).map((i) => {
            const vals = range(n).map((j) => g(j, i));
            if (op === 'sum') return vals.reduce((a, b) => a + b, 0);
            if (op === 'avg') return vals.reduce((a, b) => a + b, 0) / n;
            if (op === 'max') return Math.max(...vals);
            if (op === 'min') return Math.min(...vals);
            return vals.reduce((a, b) => a * b, 1);
          });
          c.close(name, t.toNumbers(), exp, tol(d));
          c.ok(`${name} keeps dtype`, t.dtype === d, t.dtype);
        });
      }
    });
  }
}

// ---- broadcast, allGather, allGatherInto, reduceScatter, allToAll, send/recv per dtype
for (const d of DTYPES) {
  T.tidy(() => {
    const gen = (j: number, i: number): number => 10 * (j + 1) + (i % 7);
    for (const L of LENGTHS) {
      c.run(`broadcast ${d} L=${L}`, () => {
        for (const src of range(n)) {
          const t = mk(range(L).map((i) => gen(r, i)), d);
          world.broadcast(t, src).wait();
          c.close(`broadcast ${d} L=${L} src=${src}`, t.toNumbers(), range(L).map((i) => gen(src, i)));
        }
      });
      c.run(`allGather ${d} L=${L}`, () => {
        const outs = range(n).map(() => T.zeros([L], { dtype: d }));
        world.allGather(outs, mk(range(L).map((i) => gen(r, i)), d)).wait();
        outs.forEach((o, j) => c.close(`allGather ${d} L=${L} from ${j}`, o.toNumbers(), range(L).map((i) => gen(j, i))));
      });
      c.run(`allGatherInto ${d} L=${L}`, () => {
        const out = T.zeros([n, L], { dtype: d });
        world.allGatherInto(out, mk(range(L).map((i) => gen(r, i)), d)).wait();
        c.close(`allGatherInto ${d} L=${L}`, out.toNumbers(), range(n).flatMap((j) => range(L).map((i) => gen(j, i))));
      });
    }
    // reduceScatter: per-rank shard lengths that are odd (so the input is not a power of two).
    for (const m of [1, 3, 1025]) {
      const ops: ('sum' | 'avg')[] = d === 'int64' ? ['sum'] : ['sum', 'avg'];
      for (const op of ops) {
        c.run(`reduceScatter ${op} ${d} m=${m}`, () => {
          const input = mk(range(n * m).map((k) => gen(r, k)), d);
          const out = T.zeros([m], { dtype: d });
          world.reduceScatter(out, input, op).wait();
          const exp = range(m).map((i) => sumOver((j) => gen(j, r * m + i)) / (op === 'avg' ? n : 1));
          c.close(`reduceScatter ${op} ${d} m=${m}`, out.toNumbers(), exp, tol(d));
          c.close(`reduceScatter ${op} ${d} m=${m} leaves input`, input.toNumbers(), range(n * m).map((k) => gen(r, k)));
        });
      }
    }
    c.run(`allToAll equal ${d}`, () => {
      // Values stay below 256 so bfloat16 holds them exactly.
      const input = mk(range(2 * n).map((k) => 20 * r + k), d);
      const out = T.zeros([2 * n], { dtype: d });
      world.allToAll(out, input).wait();
      c.close(`allToAll equal ${d}`, out.toNumbers(), range(n).flatMap((j) => [20 * j + 2 * r, 20 * j + 2 * r + 1]));
    });
    c.run(`allToAll uneven ${d}`, () => {
      const cnt = (from: number, to: number): number => from + to + 1;
      const inSplits = range(n).map((j) => cnt(r, j));
      const outSplits = range(n).map((j) => cnt(j, r));
      const sum = (a: number[]): number => a.reduce((x, y) => x + y, 0);
      const input = mk(range(sum(inSplits)).map((k) => 50 * (r + 1) + k), d, [sum(inSplits), 1]);
      const out = T.zeros([sum(outSplits), 1], { dtype: d });
      world.allToAll(out, input, outSplits, inSplits).wait();
      const exp = range(n).flatMap((j) => {
        const off = sum(range(r).map((q) => cnt(j, q)));
        return range(cnt(j, r)).map((k) => 50 * (j + 1) + off + k);
      });
      c.close(`allToAll uneven ${d}`, out.toNumbers(), exp);
    });
    if (n > 1) c.run(`send/recv ring ${d}`, () => {
      const next = (r + 1) % n, prev = (r + n - 1) % n;
      const mine = mk(range(5).map((i) => gen(r, i)), d);
      const got = T.zeros([5], { dtype: d });
      const s = world.send(mine, next, 7);
      const q = world.recv(got, prev, 7);
      s.wait();
      q.wait();
      c.close(`send/recv ring ${d}`, got.toNumbers(), range(5).map((i) => gen(prev, i)));
    });
  });
}

// ---- argument errors (raised before anything is sent, and not counted as issued)
const issuedBefore = world.stats.total;
T.tidy(() => {
  const x = T.zeros([6]);
  if (n > 1) c.throws('reduceScatter uneven input', () => world.reduceScatter(T.zeros([2]), T.zeros([2 * n + 1])), /reduceScatter on group 'world'/, /pad the input/);
  c.throws('reduceScatter wrong output', () => world.reduceScatter(T.zeros([1]), T.zeros([2 * n])), /output must have input.numel\(\) \/ size = 2/);
  c.throws('allGatherInto wrong output', () => world.allGatherInto(T.zeros([n * 6 + 1]), x), /needs size × input.numel\(\)/);
  if (n > 1) c.throws('allGather wrong count', () => world.allGather([x], x), /one output tensor per group rank/);
  c.throws('broadcast bad src', () => world.broadcast(x, n), /src \d+ is not a group rank/);
  c.throws('allToAll bad splits', () => world.allToAll(T.zeros([n]), T.zeros([n]), range(n).map(() => 2), undefined), /splits sum to/);
  c.throws('send to self', () => world.send(x, r), /cannot send to itself/);
  c.throws('unknown op', () => world.allReduce(x, 'mean' as 'sum'), /unknown reduce op 'mean'/);
  c.throws('dtype mismatch', () => world.allGatherInto(T.zeros([6 * n], { dtype: 'float64' }), x), /dtype float64 differs/);
});
c.ok('rejected calls are not counted', world.stats.total === issuedBefore, `${world.stats.total} vs ${issuedBefore}`);

// ---- non-contiguous tensors are staged and copied back
T.tidy(() => {
  c.run('allReduce non-contiguous', () => {
    const base = mk(range(12).map((i) => i + r), 'float32', [3, 4]);
    const view = base.t(); // (4, 3), non-contiguous
    world.allReduce(view, 'sum').wait();
    c.close('allReduce non-contiguous', base.toNumbers(), range(12).map((i) => n * i + sumOver((j) => j)));
  });
  c.run('broadcast non-contiguous bf16', () => {
    const base = mk(range(12).map((i) => i + 10 * r), 'bfloat16', [3, 4]);
    world.broadcast(base.t(), 0).wait();
    c.close('broadcast non-contiguous bf16', base.toNumbers(), range(12));
  });
  c.run('reduceScatter non-contiguous output', () => {
    const base = T.zeros([2, 3]);
    const out = base.t(); // (3, 2) view: 6 elements in the view's row-major order
    const input = mk(range(6 * n).map((k) => k), 'float32');
    world.reduceScatter(out, input).wait();
    const exp = range(6).map((i) => n * (6 * r + i));
    c.close('reduceScatter non-contiguous output', out.contiguous().toNumbers(), exp);
  });
});

// ---- bool reduces as or / and
T.tidy(() => {
  const any = mk([r === 0 ? 1 : 0, 0, 1], 'bool');
  world.allReduce(any, 'sum').wait();
  c.close('bool allReduce sum = or', any.toNumbers(), [1, 0, 1]);
  const all = mk([r === 0 ? 1 : 0, 0, 1], 'bool');
  world.allReduce(all, 'min').wait();
  c.close('bool allReduce min = and', all.toNumbers(), [n === 1 ? 1 : 0, 0, 1]);
});

// ---- several collectives in flight, then waited in order
T.tidy(() => {
  const ts = range(6).map((k) => T.full([1000], r + k));
  const works = ts.map((t) => world.allReduce(t));
  works.forEach((w) => w.wait());
  ts.forEach((t, k) => c.close(`in flight #${k}`, t.toNumbers().slice(0, 3), [1, 1, 1].map(() => sumOver((j) => j + k))));
});

// ---- issued inside tidy(), awaited after it: temporaries must survive the scope
const outside = T.tidy(() => {
  const input = T.keep(mk(range(4 * n).map((k) => k), 'bfloat16'));
  const out = T.keep(T.zeros([4], { dtype: 'bfloat16' }));
  return { work: world.reduceScatter(out, input, 'sum'), out, input };
});
outside.work.wait();
c.close('reduceScatter bf16 across tidy()', outside.out.toNumbers(), range(4).map((i) => n * (4 * r + i)));
outside.out.dispose();
outside.input.dispose();

// ---- isCompleted() polling and waitAsync()
{
  const t = T.full([1 << 18], r + 1);
  const w = world.allReduce(t, 'sum');
  const t0 = Date.now();
  while (!w.isCompleted() && Date.now() - t0 < 20_000) { /* spin */ }
  c.ok('isCompleted becomes true', w.isCompleted());
  c.close('isCompleted result ready without wait()', t.toNumbers().slice(0, 2), [1, 1].map(() => (n * (n + 1)) / 2));
  w.wait(); // a second completion path is a no-op
  t.dispose();

  const u = T.full([1 << 20], r + 1);
  const rsIn = mk(range(3 * n).map((k) => k + r), 'float32');
  const rsOut = T.zeros([3]);
  const wu = world.allReduce(u, 'avg');
  const wr = world.reduceScatter(rsOut, rsIn, 'sum');
  await Promise.all([wu.waitAsync(), wr.waitAsync()]);
  c.close('waitAsync allReduce avg', u.toNumbers().slice(0, 2), [1, 1].map(() => (n + 1) / 2));
  c.close('waitAsync reduceScatter (local sum ran)', rsOut.toNumbers(), range(3).map((i) => sumOver((j) => 3 * r + i + j)));
  c.ok('completed after waitAsync', wu.isCompleted() && wr.isCompleted());
  u.dispose(); rsIn.dispose(); rsOut.dispose();
}

world.barrier().wait();
T.tidy(() => c.run('synced across', () => assertSyncedAcross(world, T.arange(0, 10, 1, { dtype: 'float32' }))));

c.ok('no tensors leaked', T.liveTensors() === before, `${T.liveTensors()} live, ${before} before`);
const st = world.stats;
c.ok('stats count every collective', st.total === Object.values(st.issued).reduce((a, b) => a + b, 0) && (st.issued.allReduce ?? 0) > 40, JSON.stringify(st));
emitResult({ rank: r, size: n, backend: world.backend, threads: T.getNumThreads(), ...c.summary(), stats: st });

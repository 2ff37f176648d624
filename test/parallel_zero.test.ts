// Every data-parallel layout (plain, ZeRO-1/2/3, HSDP) and accumulation flavour against
// single-process training: each rank's own loss, every rank's gradient norm and every rank's final
// parameters, in float64 over 5 GPT steps on real ranks. HSDP runs both square (2 x 2) and with
// unequal sizes (2 x 3, 3 x 2 on 6 ranks), where a data-parallel rank computed as
// replicateRank * dpReplicate + shardRank instead of replicateRank * dpShard + shardRank would read
// the wrong rows (on a square mesh the two agree).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { assertClose } from './helpers/close.js';
import { runWorld, parseAllResults } from './helpers/world.js';
import { pool, started } from './helpers/pool.js';

const script = join(import.meta.dirname, 'fixtures', 'dp_rank.ts');
const dir = mkdtempSync(join(tmpdir(), 'flotilla-zero-'));
const STEPS = 5;
const common = { steps: STEPS, globalBatch: 8, seqLen: 16 };

interface Case { tag: string; zero: number; dpReplicate?: number; accum: number; accumulate?: string; tie?: boolean; reshardAfterForward?: boolean; prefetch?: boolean; reduceAtEnd?: boolean }
interface Result { tag: string; rank: number; dpRank?: number; losses: number[] | number[][]; norms: number[] }

type World = { res: Result[]; params: (tag: string, rank: number) => Float64Array };
// Layouts of one world size and global batch share a world, which trains their cases one after
// another (each a fresh model on the same seeds): on 2 ranks plain data parallel and ZeRO, the
// reduce-at-end cases and the ZeRO-3 options; on 4 ranks plain and ZeRO, and HSDP 2 x 2; HSDP on 6
// ranks; and every one-process reference of one global batch in one world of one. The worlds are
// queued when the file loads, two at a time (test/helpers/pool.ts); each test awaits its layout's.
const queue = pool();
function run(nproc: number, cases: Case[], name: string, globalBatch = common.globalBatch): Promise<World> {
  return started(queue(() => runNow(nproc, cases, name, globalBatch)));
}
async function runNow(nproc: number, cases: Case[], name: string, globalBatch: number): Promise<World> {
  const out = join(dir, name);
  const { codes, outputs } = await runWorld({ nproc, script, args: [JSON.stringify({ ...common, globalBatch, cases, out })], timeoutMs: Math.max(300_000, 30_000 * cases.length) });
  assert.deepEqual(codes, new Array(nproc).fill(0), outputs.join('\n'));
  return {
    res: parseAllResults<Result>(outputs).flat(),
    params: (tag, rank) => new Float64Array(new Uint8Array(readFileSync(`${out}.${tag}.rank${rank}.bin`)).buffer),
  };
}


// The single-process reference for N data-parallel slices and a micro-batch count: the losses of
// each slice, the norms and the parameters.
const refKey = (slices: number, accum: number, tie = false, globalBatch = common.globalBatch): string => `s${slices}a${accum}${tie ? 't' : ''}b${globalBatch}`;
const refWorlds = new Map<number, Promise<World>>();
function reference(slices: number, accum: number, tie = false, globalBatch = common.globalBatch): Promise<{ res: Result; params: Float64Array }> {
  const key = refKey(slices, accum, tie, globalBatch);
  return refWorlds.get(globalBatch)!.then(({ res, params }) => {
    const r = res.find((x) => x.tag === key);
    assert.ok(r, `no reference ${key}`);
    return { res: r, params: params(key, 0) };
  });
}

const worlds = new Map<string, Promise<World>>();
/** Queues the shared worlds of `layouts` ([name, nproc, cases, globalBatch?]), the references first. */
function queueLayouts(layouts: [string, number, Case[], number?][]): void {
  const refCases = new Map<number, Map<string, Case>>();
  const shared = new Map<string, { nproc: number; globalBatch: number; names: string[]; cases: Case[] }>();
  for (const [name, nproc, cases, globalBatch = common.globalBatch] of layouts) {
    const w = shared.get(`${nproc}b${globalBatch}`) ?? { nproc, globalBatch, names: [], cases: [] };
    shared.set(`${nproc}b${globalBatch}`, w);
    w.names.push(name);
    w.cases.push(...cases);
    const refs = refCases.get(globalBatch) ?? new Map<string, Case>();
    refCases.set(globalBatch, refs);
    for (const c of cases) {
      const tag = refKey(nproc, c.accum, c.tie, globalBatch);
      refs.set(tag, { tag, zero: 0, accum: c.accum, tie: c.tie, slices: nproc } as Case & { slices: number });
    }
  }
  for (const [globalBatch, refs] of refCases) refWorlds.set(globalBatch, run(1, [...refs.values()], `ref-b${globalBatch}`, globalBatch));
  for (const [key, w] of shared) {
    const world = run(w.nproc, w.cases, `w${key}`, w.globalBatch);
    for (const name of w.names) worlds.set(name, world);
  }
}

async function checkLayout(nproc: number, cases: Case[], name: string, globalBatch = common.globalBatch): Promise<void> {
  const runResult = await worlds.get(name)!;
  for (const c of cases) {
    const ref = await reference(nproc, c.accum, c.tie, globalBatch);
    const refLosses = ref.res.losses as number[][];
    const ranks = runResult.res.filter((r) => r.tag === c.tag);
    assert.equal(ranks.length, nproc, `${c.tag}: every rank reports`);
    for (const r of ranks) {
      const own = refLosses.map((perSlice) => perSlice[r.dpRank!]!);
      assertClose(r.losses as number[], own, 1e-5, `${c.tag}: rank ${r.rank}'s own losses`);
      assertClose(r.norms, ref.res.norms, 1e-5, `${c.tag}: rank ${r.rank}'s gradient norms`);
      assertClose(runResult.params(c.tag, r.rank), ref.params, 1e-5, `${c.tag}: rank ${r.rank}'s final parameters`);
    }
  }
}

function casesFor(opts: { hsdp?: boolean } = {}): Case[] {
  const R = opts.hsdp ? 2 : undefined;
  const cases: Case[] = [];
  // HSDP's tags name its replicas (its cases share a world with the plain layouts').
  const add = (zero: number, accum: number, accumulate?: string) =>
    cases.push({ tag: `${R ? `r${R}-` : ''}z${zero}-a${accum}${accumulate ? `-${accumulate}` : ''}`, zero, accum, ...(R ? { dpReplicate: R } : {}), ...(accumulate ? { accumulate } : {}) });
  if (!opts.hsdp) {
    add(0, 1);
    add(0, 2, 'reduceLast');
  }
  for (const zero of [1, 2, 3]) {
    add(zero, 1);
    add(zero, 2, 'reduceLast');
    if (zero >= 2) add(zero, 2, 'reduceEach');
    if (zero >= 2 && opts.hsdp) add(zero, 2, 'reduceScatterEachAllReduceLast');
  }
  return cases;
}

const END: Case[] = [0, 1, 2, 3].map((zero) => ({ tag: `z${zero}-end`, zero, accum: 2, accumulate: 'reduceLast', reduceAtEnd: true }));
const Z3_OPTS: Case[] = [
  { tag: 'z3-tied', zero: 3, accum: 2, accumulate: 'reduceEach', tie: true },
  { tag: 'z3-keep', zero: 3, accum: 2, accumulate: 'reduceEach', reshardAfterForward: false },
  { tag: 'z3-noprefetch', zero: 3, accum: 1, prefetch: false },
];
const HSDP6: Case[] = [];
for (const R of [3, 2]) {
  for (const zero of [1, 2, 3]) HSDP6.push({ tag: `r${R}-z${zero}-a1`, zero, dpReplicate: R, accum: 1 });
  HSDP6.push({ tag: `r${R}-z3-a2-rsar`, zero: 3, dpReplicate: R, accum: 2, accumulate: 'reduceScatterEachAllReduceLast' });
  HSDP6.push({ tag: `r${R}-z2-a2-each`, zero: 2, dpReplicate: R, accum: 2, accumulate: 'reduceEach' });
}
queueLayouts([
  ['w2', 2, casesFor()],
  ['end', 2, END],
  ['w4', 4, casesFor()],
  ['hsdp', 4, casesFor({ hsdp: true })],
  ['z3opts', 2, Z3_OPTS],
  ['hsdp6', 6, HSDP6, 12],
]);

test('plain data parallel, ZeRO-1, ZeRO-2, ZeRO-3 on 2 ranks, every accumulation flavour: 5 steps equal single-process training on every rank', async () => {
  await checkLayout(2, casesFor(), 'w2');
});

test('backward passes run with sync off, then one reduceAccumulated() (how a pipeline reduces), in every stage: equal to one process', async () => {
  await checkLayout(2, END, 'end');
});

test('plain data parallel, ZeRO-1, ZeRO-2, ZeRO-3 on 4 ranks, every accumulation flavour: 5 steps equal single-process training on every rank', async () => {
  await checkLayout(4, casesFor(), 'w4');
});

test('HSDP 2 x 2 (ZeRO-1/2/3 sharded over 2, replicated over 2), every accumulation flavour: equal to single-process training', async () => {
  await checkLayout(4, casesFor({ hsdp: true }), 'hsdp');
});

test('ZeRO-3 with tied input and output embeddings (the shared weight lives in the root unit), without resharding after forward, without prefetch', async () => {
  await checkLayout(2, Z3_OPTS, 'z3opts');
});

test('HSDP with unequal sizes on 6 ranks: dpShard 2 x dpReplicate 3 and dpShard 3 x dpReplicate 2, ZeRO-1/2/3 and accumulation: equal to single-process training on every rank', async () => {
  await checkLayout(6, HSDP6, 'hsdp6', 12);
});

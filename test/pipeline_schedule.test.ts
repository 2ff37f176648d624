// Pipeline schedule tables, checked without processes: for p in 1..8 and m in 1..16 every schedule is
// complete, causal, has matched sends and receives and runs without deadlock. The checks here are written
// independently of validateSchedule (which must also accept every table, and reject hand-broken ones
// with a message naming the problem). Bubbles from the unit-cost simulation are compared with theory.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { join, resolve } from 'node:path';
import {
  type Action,
  type PipelineSchedule,
  type ScheduleName,
  buildSchedule,
  formatSchedule,
  insertComm,
  peakActivations,
  simulate,
  theoreticalBubble,
  validateSchedule,
} from '../src/parallel/pipeline/schedule.js';

const P = [1, 2, 3, 4, 5, 6, 7, 8];
const M = Array.from({ length: 16 }, (_, i) => i + 1);

/** Every table the property tests cover: GPipe, 1F1B and ZB-H1 for all (p, m); interleaved with v = 1
 *  to 4 where m is a multiple of p. */
function* allTables(): Generator<PipelineSchedule> {
  for (const p of P) {
    for (const m of M) {
      for (const name of ['gpipe', '1f1b', 'zb'] as const) yield buildSchedule(name, { pp: p, micro: m });
      if (m % p === 0) for (const v of [1, 2, 3, 4]) yield buildSchedule('interleaved', { pp: p, micro: m, virtualStages: v });
    }
  }
}

const tag = (s: PipelineSchedule) => `${s.name} p=${s.pp} m=${s.micro} v=${s.virtualStages}`;
const key = (a: Pick<Action, 'stage' | 'kind' | 'micro'>) => `${a.stage}${a.kind}${a.micro}`;

/** Complete: each stage lives on rank s % p and runs F once and B once (or I once and W once) per micro-batch. */
function checkComplete(s: PipelineSchedule): void {
  const count = new Map<string, number>();
  s.compute.forEach((list, r) => {
    for (const a of list) {
      assert.equal(a.stage % s.pp, r, `${tag(s)}: ${key(a)} on rank ${r}`);
      count.set(key(a), (count.get(key(a)) ?? 0) + 1);
    }
  });
  const split = s.name === 'zb';
  for (let st = 0; st < s.numStages; st++) {
    for (let i = 0; i < s.micro; i++) {
      for (const k of split ? ['F', 'I', 'W'] : ['F', 'B']) {
        assert.equal(count.get(`${st}${k}${i}`), 1, `${tag(s)}: ${st}${k}${i} runs once`);
      }
    }
  }
  const expected = s.numStages * s.micro * (split ? 3 : 2);
  assert.equal([...count.values()].reduce((x, y) => x + y, 0), expected, `${tag(s)}: no extra actions`);
}

/** Causal, on the simulated timeline: F of s ends before F of s+1 starts, the backward of s+1 before
 *  that of s, F before the backward on each stage, I before W. */
function checkCausal(s: PipelineSchedule): void {
  const { grid } = simulate(s);
  const start = new Map<string, number>();
  const end = new Map<string, number>();
  grid.forEach((row) =>
    row.forEach((a, t) => {
      if (a === null) return;
      if (!start.has(key(a))) start.set(key(a), t);
      end.set(key(a), t + 1);
    }),
  );
  const back = s.name === 'zb' ? 'I' : 'B';
  const before = (x: string, y: string) => assert.ok(end.get(x)! <= start.get(y)!, `${tag(s)}: ${x} ends before ${y} starts`);
  for (let st = 0; st < s.numStages; st++) {
    for (let i = 0; i < s.micro; i++) {
      before(`${st}F${i}`, `${st}${back}${i}`);
      if (back === 'I') before(`${st}I${i}`, `${st}W${i}`);
      if (st + 1 < s.numStages) {
        before(`${st}F${i}`, `${st + 1}F${i}`);
        before(`${st + 1}${back}${i}`, `${st}${back}${i}`);
      }
    }
  }
}

/** Matched: per (sender, receiver) the sends and receives list the same messages in the same order;
 *  every send follows its producer and every consumer is preceded by its receive. */
function checkMatched(s: PipelineSchedule): void {
  const sends = new Map<string, string[]>();
  const recvs = new Map<string, string[]>();
  const push = (m: Map<string, string[]>, k: string, v: string) => m.set(k, [...(m.get(k) ?? []), v]);
  s.actions.forEach((list, r) => {
    const seen = new Set<string>();
    for (const a of list) {
      if (a.kind === 'SEND_F' || a.kind === 'SEND_B') {
        const fwd = a.kind === 'SEND_F';
        assert.ok(seen.has(fwd ? `${a.stage}F${a.micro}` : `${a.stage}${s.name === 'zb' ? 'I' : 'B'}${a.micro}`), `${tag(s)}: send after producer`);
        const to = fwd ? a.stage + 1 : a.stage - 1;
        assert.equal(a.peer, to % s.pp);
        push(sends, `${r}>${a.peer}`, `${fwd ? 'F' : 'B'}${to}.${a.micro}`);
      } else if (a.kind === 'RECV_F' || a.kind === 'RECV_B') {
        const fwd = a.kind === 'RECV_F';
        assert.equal(a.peer, (fwd ? a.stage - 1 : a.stage + 1) % s.pp);
        push(recvs, `${a.peer}>${r}`, `${fwd ? 'F' : 'B'}${a.stage}.${a.micro}`);
        seen.add(`recv ${a.kind} ${a.stage} ${a.micro}`);
      } else {
        const needF = a.kind === 'F' && a.stage > 0 && (a.stage - 1) % s.pp !== r;
        const needB = (a.kind === 'B' || a.kind === 'I') && a.stage < s.numStages - 1 && (a.stage + 1) % s.pp !== r;
        if (needF) assert.ok(seen.has(`recv RECV_F ${a.stage} ${a.micro}`), `${tag(s)}: ${key(a)} has its receive first`);
        if (needB) assert.ok(seen.has(`recv RECV_B ${a.stage} ${a.micro}`), `${tag(s)}: ${key(a)} has its receive first`);
        seen.add(key(a));
      }
    }
  });
  assert.deepEqual([...sends.keys()].sort(), [...recvs.keys()].sort(), `${tag(s)}: channels`);
  for (const [k, v] of sends) assert.deepEqual(recvs.get(k), v, `${tag(s)}: channel ${k} in order`);
  if (s.pp === 1) assert.equal(sends.size, 0, 'one rank: no traffic');
}

/** Deadlock-free: run the lists with non-blocking sends/receives and a blocking wait at the consumer. */
function checkRuns(s: PipelineSchedule): void {
  const sent = new Set<string>();
  const ptr = s.actions.map(() => 0);
  for (let moved = true; moved; ) {
    moved = false;
    s.actions.forEach((list, r) => {
      for (; ptr[r]! < list.length; ptr[r]!++, moved = true) {
        const a = list[ptr[r]!]!;
        if (a.kind === 'SEND_F') sent.add(`F${a.stage + 1}.${a.micro}`);
        if (a.kind === 'SEND_B') sent.add(`B${a.stage - 1}.${a.micro}`);
        const remoteF = a.kind === 'F' && a.stage > 0 && (a.stage - 1) % s.pp !== r;
        const remoteB = (a.kind === 'B' || a.kind === 'I') && a.stage < s.numStages - 1 && (a.stage + 1) % s.pp !== r;
        if (remoteF && !sent.has(`F${a.stage}.${a.micro}`)) break;
        if (remoteB && !sent.has(`B${a.stage}.${a.micro}`)) break;
      }
    });
  }
  assert.deepEqual(ptr, s.actions.map((l) => l.length), `${tag(s)}: every rank reaches the end of its list`);
}

test('every table (p 1..8, m 1..16) is complete, causal, matched and deadlock-free, and validates', () => {
  let n = 0;
  for (const s of allTables()) {
    checkComplete(s);
    checkCausal(s);
    checkMatched(s);
    checkRuns(s);
    validateSchedule(s);
    n++;
  }
  assert.ok(n > 8 * 16 * 3, `covered ${n} tables`);
});

test('simulated bubbles equal theory: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(vm+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1 (m >= p)', () => {
  for (const s of allTables()) {
    const sim = simulate(s);
    const idle = sim.idle.reduce((x, y) => x + y, 0);
    const busy = sim.grid.flat().filter((a) => a !== null).length;
    assert.equal(idle + busy, s.pp * sim.makespan, tag(s));
    assert.equal(busy, s.numStages * s.micro * 3, `${tag(s)}: F + B = 3 slots per stage micro-batch`);
    if (s.name === 'zb' && s.micro < s.pp) continue; // pipeline never fills; covered by the comparison below
    const theory = theoreticalBubble(s.name, s.pp, s.micro, s.virtualStages);
    assert.ok(Math.abs(sim.bubbleFraction - theory) < 1e-12, `${tag(s)}: simulated ${sim.bubbleFraction} vs theory ${theory}`);
  }
});

test("zero-bubble's idle slots are fewer than 1F1B's, at no more peak activation memory", () => {
  for (const p of P) {
    for (const m of M) {
      const zb = buildSchedule('zb', { pp: p, micro: m });
      const ofob = buildSchedule('1f1b', { pp: p, micro: m });
      const zi = simulate(zb).idle.reduce((x, y) => x + y, 0);
      const oi = simulate(ofob).idle.reduce((x, y) => x + y, 0);
      if (p === 1) assert.equal(zi + oi, 0, 'one rank never idles');
      else assert.ok(zi < oi, `p=${p} m=${m}: zb idle ${zi} < 1f1b idle ${oi}`);
      if (m >= p) assert.equal(zi * 3, oi, `p=${p} m=${m}: a third of 1F1B's bubble`);
      // 1F1B holds min(p - r, m) micro-batches on rank r, GPipe m; ZB-H1 never more than 1F1B's peak.
      assert.deepEqual(peakActivations(ofob), Array.from({ length: p }, (_, r) => Math.min(p - r, m)));
      assert.deepEqual(peakActivations(buildSchedule('gpipe', { pp: p, micro: m })), new Array(p).fill(m));
      assert.ok(Math.max(...peakActivations(zb)) <= Math.max(...peakActivations(ofob)), `p=${p} m=${m}: zb peak`);
    }
  }
});

test('simulate takes other integer costs', () => {
  const g = buildSchedule('gpipe', { pp: 3, micro: 4 });
  assert.equal(simulate(g).makespan, 18);
  assert.equal(simulate(g, { F: 2, B: 4, I: 2, W: 2 }).makespan, 36);
  assert.equal(simulate(g, { F: 1, B: 1, I: 1, W: 1 }).bubbleFraction, 2 / 6); // (p-1)/(m+p-1) holds for any F:B ratio
  assert.throws(() => simulate(g, { F: 1.5, B: 3, I: 1, W: 1 }), /cost F must be a positive integer/);
});

test('grid text: ranks x time, idle slots as dots', () => {
  assert.equal(
    formatSchedule(buildSchedule('gpipe', { pp: 2, micro: 2 })),
    ['0: 0F0 0F1 .   .   .   0B0 0B0 0B1 0B1', '1: .   1F0 1F1 1B0 1B0 1B1 1B1 .   .'].join('\n'),
  );
  const zb = formatSchedule(buildSchedule('zb', { pp: 2, micro: 2 }));
  assert.equal(zb, ['0: 0F0 0F1 .   0I0 0W0 0I1 0W1', '1: .   1F0 1I0 1F1 1I1 1W0 1W1'].join('\n'));
});

test('interleaved places stage s on rank s % pp and needs m to be a multiple of pp', () => {
  const s = buildSchedule('interleaved', { pp: 4, micro: 8, virtualStages: 2 });
  assert.equal(s.numStages, 8);
  assert.deepEqual(s.stagesOf(1), [1, 5]);
  assert.equal(s.stageRank(6), 2);
  assert.throws(() => buildSchedule('interleaved', { pp: 4, micro: 6, virtualStages: 2 }), /multiple of pp.*m = 6, pp = 4; use --micro 8/);
  assert.throws(() => buildSchedule('1f1b', { pp: 2, micro: 4, virtualStages: 2 }), /need the 'interleaved' schedule/);
  assert.throws(() => buildSchedule('gpipe', { pp: 0, micro: 4 }), /pp \(pipeline ranks\) must be a positive integer/);
  assert.throws(() => buildSchedule('nope' as ScheduleName, { pp: 2, micro: 4 }), /unknown pipeline schedule "nope"; schedules are gpipe, 1f1b, interleaved, zb/);
});

/** A valid table with its compute replaced on some ranks and the comm re-inserted. */
function withCompute(base: PipelineSchedule, edit: (c: Action[][]) => void): PipelineSchedule {
  const compute = base.compute.map((l) => l.map((a) => ({ ...a })));
  edit(compute);
  const s = { ...base, compute };
  return { ...s, actions: insertComm(s) };
}

test("a rank that consumes out of the sender's order posts its receives early, in the sender's order", () => {
  // Rank 1 runs micro-batch 1 first; rank 0 still sends 0 then 1, so both receives precede 1F1.
  const s = withCompute(buildSchedule('gpipe', { pp: 2, micro: 2 }), (c) => c[1]!.splice(0, 2, c[1]![1]!, c[1]![0]!));
  validateSchedule(s);
  checkMatched(s);
  checkRuns(s);
  assert.deepEqual(s.actions[1]!.slice(0, 3).map((a) => `${a.stage}${a.kind}${a.micro}`), ['1RECV_F0', '1RECV_F1', '1F1']);
});

test('hand-broken tables are rejected with a message naming the problem', () => {
  const base = buildSchedule('1f1b', { pp: 2, micro: 2 });
  validateSchedule(base);
  // A backward missing.
  assert.throws(() => validateSchedule(withCompute(base, (c) => c[1]!.pop())), /\(incomplete\): rank 1 never runs the backward of stage 1 micro-batch 1/);
  // A stage on the wrong rank.
  assert.throws(() => validateSchedule(withCompute(base, (c) => (c[1]![0]!.stage = 0))), /\(incomplete\): rank 1 runs 0F0, but stage 0 lives on rank 0/);
  // The same forward twice.
  assert.throws(() => validateSchedule(withCompute(base, (c) => (c[0]![1]!.micro = 0))), /\(incomplete\): rank 0 runs 0F0 twice/);
  // Backward before its forward on one rank.
  assert.throws(
    () => validateSchedule(withCompute(base, (c) => c[1]!.splice(0, 2, c[1]![1]!, c[1]![0]!))),
    /\(non-causal\): rank 1 runs 1B0 before 1F0/,
  );
  // W before its I.
  const zb = buildSchedule('zb', { pp: 2, micro: 2 });
  assert.throws(
    () => validateSchedule(withCompute(zb, (c) => { const l = c[0]!; const i = l.findIndex((a) => a.kind === 'I'); [l[i], l[i + 1]] = [l[i + 1]!, l[i]!]; })),
    /\(non-causal\): rank 0 runs 0W0 before 0I0/,
  );
  // Locally causal, but rank 0 waits for 1B0 before sending 0F1 while rank 1 waits for 0F1 before 1B0.
  const gp = buildSchedule('gpipe', { pp: 2, micro: 2 });
  const cyc = withCompute(gp, (c) => {
    c[0] = [{ kind: 'F', stage: 0, micro: 0 }, { kind: 'B', stage: 0, micro: 0 }, { kind: 'F', stage: 0, micro: 1 }, { kind: 'B', stage: 0, micro: 1 }];
  });
  assert.throws(() => validateSchedule(cyc), /\(deadlock\): rank 0 waits at 0B0 for 1SEND_B0 from rank 1; rank 1 waits at 1F1 for 0SEND_F1 from rank 0/);
  assert.throws(() => simulate(cyc), /cannot run \(a cycle\)/);
  // Receives reordered by hand: the pairs no longer match.
  const swapped = { ...base, actions: base.actions.map((l) => [...l]) };
  const r1 = swapped.actions[1]!;
  const [a, b] = [r1.findIndex((x) => x.kind === 'RECV_F' && x.micro === 0), r1.findIndex((x) => x.kind === 'RECV_F' && x.micro === 1)];
  r1.splice(a, 1);
  r1.splice(a, 0, r1.splice(b - 1, 1)[0]!, { kind: 'RECV_F', stage: 1, micro: 0, peer: 0 });
  assert.throws(() => validateSchedule(swapped), /\(unmatched send\/recv\): message 0 from rank 0 to rank 1 is 0SEND_F0->1, but rank 1's receive 0 from rank 0 is 1RECV_F1<-0/);
  // A send dropped.
  const dropped = { ...base, actions: base.actions.map((l) => l.filter((x) => !(x.kind === 'SEND_B' && x.micro === 1))) };
  assert.throws(() => validateSchedule(dropped), /\(unmatched send\/recv\): rank 0 posts 0RECV_B1<-1 but rank 1 sends nothing more to it/);
  // A consumer without its receive.
  const noRecv = { ...base, actions: base.actions.map((l) => l.filter((x) => !(x.kind === 'RECV_F' && x.micro === 1))) };
  assert.throws(() => validateSchedule(noRecv), /\(unmatched send\/recv\): rank 1 runs 1F1 without first posting its receive 1RECV_F1<-0/);
});

test('flotilla schedule prints the grid, the simulated bubble and the theory; bad input exits 2 naming the fix', () => {
  const ROOT = resolve(import.meta.dirname, '..');
  const run = (...args: string[]) => spawnSync(process.execPath, [join(ROOT, 'bin', 'flotilla.js'), 'schedule', ...args], { cwd: ROOT, encoding: 'utf8' });
  const ok = run('--pp', '4', '--micro', '8', '--schedule', '1f1b');
  assert.equal(ok.status, 0, ok.stderr);
  assert.match(ok.stdout, /^0: 0F0 0F1 0F2 0F3 \. /m);
  assert.match(ok.stdout, /^3: \. +\. +\. +3F0 3B0 3B0 3F1/m);
  assert.match(ok.stdout, /simulated bubble: 0\.2727 \(36 idle of 4 x 33 rank-slots/);
  assert.match(ok.stdout, /theory \(p-1\)\/\(m\+p-1\): 0\.2727/);
  const il = run('--pp=2', '--micro=4', '--schedule=interleaved', '--virtual=2', '--actions');
  assert.equal(il.status, 0, il.stderr);
  assert.match(il.stdout, /4 stages \(2 per rank/);
  assert.match(il.stdout, /^1: 1RECV_F0<-0 1RECV_F1<-0 1F0 1SEND_F0->0 /m);
  const bad = run('--pp', '2', '--micro', '3', '--schedule', 'interleaved');
  assert.equal(bad.status, 2);
  assert.match(bad.stderr, /multiple of pp .*use --micro 4/);
  const unknown = run('--pp', '2', '--micro', '3', '--schedule', 'pipedream');
  assert.equal(unknown.status, 2);
  assert.match(unknown.stderr, /unknown schedule "pipedream"; schedules are gpipe, 1f1b, interleaved, zb/);
  assert.equal(run('--pp', '2').status, 2);
});

test('actions parse from their printed names: every action of every schedule round-trips, malformed names name the accepted forms', async () => {
  const { actionName, parseAction, parseActions } = await import('../src/parallel/pipeline/schedule.js');
  for (const name of ['gpipe', '1f1b', 'interleaved', 'zb'] as ScheduleName[]) {
    for (const [pp, micro] of [[1, 1], [2, 4], [4, 8], [3, 6]] as const) {
      const s = buildSchedule(name, { pp, micro, virtualStages: name === 'interleaved' ? 2 : 1 });
      s.actions.forEach((list, r) => {
        for (const a of list) assert.deepEqual(parseAction(actionName(a)), a, `${name} pp=${pp} m=${micro} rank ${r}: ${actionName(a)}`);
        assert.deepEqual(parseActions(list.map(actionName).join(' ')), list, `${name} pp=${pp} m=${micro} rank ${r}: the printed list`);
      });
    }
  }
  assert.deepEqual(parseAction('0SEND_F0->1'), { kind: 'SEND_F', stage: 0, micro: 0, peer: 1 });
  assert.deepEqual(parseAction('12RECV_B3<-2'), { kind: 'RECV_B', stage: 12, micro: 3, peer: 2 });
  assert.throws(() => parseAction('2X0'), /'2X0' is not an action; write <stage><F\|B\|I\|W><micro>/);
  assert.throws(() => parseAction('2F0->1'), /compute action, which has no peer/);
  assert.throws(() => parseAction('0SEND_F0<-1'), /needs its peer after '->'/);
  assert.throws(() => parseAction('1RECV_B0'), /needs its peer after '<-'/);
});

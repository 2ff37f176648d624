// Pipeline schedules as data: for each pipeline rank, the list of actions it runs in one step (forward,
// backward or its two halves, and the sends/receives between stages). Pure TypeScript: no tensors, no
// processes. A table can be built, printed, validated and simulated before anything runs; the pipeline
// runtime executes `actions[rank]` as written.
//
// [Note: schedule tables]
// - Stages are global (0..numStages-1) and placed in a loop: stage s lives on rank s % pp, so with
//   virtual stages rank r holds r, r + pp, r + 2pp, ... (Megatron-LM's interleaved placement).
// - `compute[rank]` is the order of F/B (or F/I/W) actions on that rank. `actions[rank]` adds the
//   point-to-point traffic: a SEND right after the compute that produced its tensor; a RECV posted one
//   compute ahead of the compute that consumes it (so the transfer overlaps the compute before), and
//   earlier where needed so that, per (sender, receiver) pair, receives are posted in the order the sender
//   sends: pairs match without tags even when the receiver consumes in another order. Consecutive stages
//   on the same rank (pp = 1) hand over locally, with no comm action.
// - Runtime semantics assumed by `validateSchedule`: sends and receives are non-blocking and issued in
//   list order; a compute action waits for the receives it consumes. A rank therefore blocks only at a
//   compute action whose input has not been sent yet; the validator runs every rank's list under exactly
//   that rule and reports a cycle of waiting ranks as a deadlock.
// - Costs are units: F = 1, B = 2 (I = 1 and W = 1 when the backward is split), comm = 0. With them the
//   simulated bubble of GPipe and 1F1B is exactly (p-1)/(m+p-1).
//
// The agreed interface is implemented unchanged. Additions: SCHEDULE_NAMES, UNIT_COSTS, actionName ('2F0',
// '0SEND_F1->1'), insertComm (re-inserts comm after a compute order is edited), peakActivations,
// theoreticalBubble, describeSchedule (the text `flotilla schedule` prints), and an optional precomputed
// simulation argument to formatSchedule. Schedules 'gpipe', '1f1b', 'interleaved' use F and B only; 'zb'
// uses F, I and W only. validateSchedule may also report a malformed table as '(shape)'.

export type ScheduleName = 'gpipe' | '1f1b' | 'interleaved' | 'zb';
/** F forward; B full backward (input and weight gradients); I input-gradient part only; W weight-gradient part. */
export type ComputeKind = 'F' | 'B' | 'I' | 'W';
/** Point-to-point: SEND_F/RECV_F carry activations (stage s -> s+1), SEND_B/RECV_B carry their gradients (s+1 -> s). */
export type CommKind = 'SEND_F' | 'RECV_F' | 'SEND_B' | 'RECV_B';
export interface Action {
  kind: ComputeKind | CommKind;
  stage: number; // global stage index 0..numStages-1 (for comm: the stage on THIS rank that sends/receives)
  micro: number; // micro-batch index 0..m-1
  peer?: number; // pipeline rank of the other side (comm actions only)
}
export interface PipelineSchedule {
  name: ScheduleName;
  pp: number; // pipeline ranks
  micro: number; // micro-batches per step (m)
  virtualStages: number; // stages per rank (1 except interleaved)
  numStages: number; // pp * virtualStages
  stageRank(stage: number): number; // loop placement: stage s lives on rank s % pp
  stagesOf(rank: number): number[];
  /** compute[rank] = that rank's compute actions in execution order (F/B or F/I/W). */
  compute: Action[][];
  /** actions[rank] = compute plus the inserted sends/receives, in the order the runtime executes them. */
  actions: Action[][];
}

export const SCHEDULE_NAMES: readonly ScheduleName[] = ['gpipe', '1f1b', 'interleaved', 'zb'];

export interface UnitCosts {
  F: number;
  B: number;
  I: number;
  W: number;
}
export const UNIT_COSTS: Readonly<UnitCosts> = { F: 1, B: 2, I: 1, W: 1 };

/** '2F0' for stage 2, forward, micro-batch 0; '1SEND_F3->2' for a send to rank 2. */
export function actionName(a: Action): string {
  const base = `${a.stage}${a.kind}${a.micro}`;
  if (a.peer === undefined) return base;
  return a.kind.startsWith('SEND') ? `${base}->${a.peer}` : `${base}<-${a.peer}`;
}

const ACTION_RE = /^(\d+)(F|B|I|W|SEND_F|SEND_B|RECV_F|RECV_B)(\d+)(?:(->|<-)(\d+))?$/;

/**
 * The action a printed name stands for (actionName's inverse): '2F0', '1W3', '0SEND_F0->1',
 * '1RECV_B2<-0'. A malformed name is an error that shows the accepted forms.
 */
export function parseAction(text: string): Action {
  const m = ACTION_RE.exec(text.trim());
  const bad = (why: string): never => {
    throw new Error(`pipeline action '${text}' ${why}; write <stage><F|B|I|W><micro> (e.g. 2F0) or <stage><SEND_F|SEND_B><micro>-><rank> / <stage><RECV_F|RECV_B><micro><-<rank> (e.g. 0SEND_F0->1)`);
  };
  if (!m) return bad('is not an action');
  const kind = m[2] as Action['kind'];
  const a: Action = { kind, stage: Number(m[1]), micro: Number(m[3]) };
  if (isCompute(kind)) {
    if (m[4] !== undefined) bad('is a compute action, which has no peer');
    return a;
  }
  const arrow = kind.startsWith('SEND') ? '->' : '<-';
  if (m[4] !== arrow) bad(`needs its peer after '${arrow}'`);
  return { ...a, peer: Number(m[5]) };
}

/** A rank's action list from its printed form: names separated by spaces (as `flotilla schedule --actions` lists them). */
export function parseActions(text: string): Action[] {
  return text.split(/\s+/).filter((t) => t !== '').map(parseAction);
}

const isCompute = (k: Action['kind']): k is ComputeKind => k === 'F' || k === 'B' || k === 'I' || k === 'W';

function checkCount(what: string, v: unknown, flag: string): number {
  if (typeof v !== 'number' || !Number.isInteger(v) || v < 1) {
    throw new Error(`${what} must be a positive integer, got ${String(v)} (${flag})`);
  }
  return v;
}

function skeleton(name: ScheduleName, pp: number, micro: number, virtualStages: number): Omit<PipelineSchedule, 'compute' | 'actions'> {
  const numStages = pp * virtualStages;
  return {
    name,
    pp,
    micro,
    virtualStages,
    numStages,
    stageRank(stage: number): number {
      if (!Number.isInteger(stage) || stage < 0 || stage >= numStages) {
        throw new Error(`stage ${stage} out of range: this schedule has stages 0..${numStages - 1}`);
      }
      return stage % pp;
    },
    stagesOf(rank: number): number[] {
      if (!Number.isInteger(rank) || rank < 0 || rank >= pp) throw new Error(`rank ${rank} out of range: pp = ${pp}`);
      return Array.from({ length: virtualStages }, (_, c) => c * pp + rank);
    },
  };
}

// ---------------------------------------------------------------------------------------------------
// Compute orders

/** GPipe: all forwards, then all backwards (micro-batch order). Peak activations: m per stage. */
function gpipeCompute(pp: number, m: number): Action[][] {
  return Array.from({ length: pp }, (_, r) => [
    ...Array.from({ length: m }, (_, i): Action => ({ kind: 'F', stage: r, micro: i })),
    ...Array.from({ length: m }, (_, i): Action => ({ kind: 'B', stage: r, micro: i })),
  ]);
}

/** 1F1B: rank r runs p-r-1 warm-up forwards, then alternates one forward and one backward, then drains.
 *  Peak activations on rank r: min(p - r, m). */
function oneFOneBCompute(pp: number, m: number): Action[][] {
  return Array.from({ length: pp }, (_, r) => {
    const out: Action[] = [];
    const warmup = Math.min(pp - r - 1, m);
    for (let i = 0; i < warmup; i++) out.push({ kind: 'F', stage: r, micro: i });
    for (let j = 0; j < m - warmup; j++) {
      out.push({ kind: 'F', stage: r, micro: warmup + j });
      out.push({ kind: 'B', stage: r, micro: j });
    }
    for (let j = m - warmup; j < m; j++) out.push({ kind: 'B', stage: r, micro: j });
    return out;
  });
}

/** Interleaved 1F1B (Megatron-LM): rank r holds v stages (chunks) r, r+pp, ...; forwards run in groups of
 *  pp micro-batches per chunk, chunk 0 first; backwards mirror that from the last chunk. Warm-up:
 *  2(p-r-1) + (v-1)p forward steps, then one forward and one backward alternate. Needs m % pp == 0. */
function interleavedCompute(pp: number, m: number, v: number): Action[][] {
  if (m % pp !== 0) {
    throw new Error(`interleaved 1F1B needs the number of micro-batches to be a multiple of pp (as in Megatron-LM): m = ${m}, pp = ${pp}; use --micro ${Math.ceil(m / pp) * pp} or the '1f1b' schedule`);
  }
  const total = m * v;
  const at = (k: number, forward: boolean, r: number): { stage: number; micro: number } => {
    const chunk = Math.floor((k % (pp * v)) / pp);
    const micro = Math.floor(k / (pp * v)) * pp + (k % pp);
    return { stage: (forward ? chunk : v - 1 - chunk) * pp + r, micro };
  };
  return Array.from({ length: pp }, (_, r) => {
    const out: Action[] = [];
    const warmup = Math.min((pp - r - 1) * 2 + (v - 1) * pp, total);
    for (let k = 0; k < warmup; k++) out.push({ kind: 'F', ...at(k, true, r) });
    for (let k = 0; k < total - warmup; k++) {
      out.push({ kind: 'F', ...at(warmup + k, true, r) });
      out.push({ kind: 'B', ...at(k, false, r) });
    }
    for (let k = total - warmup; k < total; k++) out.push({ kind: 'B', ...at(k, false, r) });
    return out;
  });
}

/** ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024): the backward is split into I (input
 *  gradient, on the critical path) and W (weight gradient, needed only by the optimizer step). Rank r runs
 *  1F1B's p-r-1 warm-up forwards, then pairs F, I with its W trailing r micro-batches behind, so every
 *  rank holds at most p micro-batches between F and W (rank 0's 1F1B peak; W needs less memory than a
 *  full backward); the I chain runs ahead and the delayed Ws fill the tail that 1F1B leaves idle.
 *  Bubble with F = I = W: p-1 slots per rank, a third of 1F1B's 3(p-1). */
function zeroBubbleCompute(pp: number, m: number): Action[][] {
  return Array.from({ length: pp }, (_, r) => {
    const out: Action[] = [];
    const warmup = Math.min(pp - r - 1, m);
    let w = 0; // next W
    for (let i = 0; i < warmup; i++) out.push({ kind: 'F', stage: r, micro: i });
    for (let j = 0; j < m - warmup; j++) {
      out.push({ kind: 'F', stage: r, micro: warmup + j });
      out.push({ kind: 'I', stage: r, micro: j });
      if (j >= r) out.push({ kind: 'W', stage: r, micro: w++ });
    }
    for (let j = m - warmup; j < m; j++) {
      out.push({ kind: 'I', stage: r, micro: j });
      if (w <= j) out.push({ kind: 'W', stage: r, micro: w++ });
    }
    while (w < m) out.push({ kind: 'W', stage: r, micro: w++ });
    return out;
  });
}

// ---------------------------------------------------------------------------------------------------
// Communication

/** The input a compute action consumes from another stage: [producer stage, message kind], or null. */
function inputOf(a: Action, numStages: number): { from: number; kind: 'F' | 'B' } | null {
  if (a.kind === 'F') return a.stage > 0 ? { from: a.stage - 1, kind: 'F' } : null;
  if (a.kind === 'B' || a.kind === 'I') return a.stage < numStages - 1 ? { from: a.stage + 1, kind: 'B' } : null;
  return null; // W consumes what I of the same stage left behind, on the same rank
}

/** The output a compute action sends to another stage, or null. */
function outputOf(a: Action, numStages: number): { to: number; kind: 'F' | 'B' } | null {
  if (a.kind === 'F') return a.stage < numStages - 1 ? { to: a.stage + 1, kind: 'F' } : null;
  if (a.kind === 'B' || a.kind === 'I') return a.stage > 0 ? { to: a.stage - 1, kind: 'B' } : null;
  return null;
}

const msgKey = (kind: 'F' | 'B', toStage: number, micro: number): string => `${kind}:${toStage}:${micro}`;

/** Inserts the sends and receives into each rank's compute order (see [Note: schedule tables]). */
export function insertComm(s: Omit<PipelineSchedule, 'actions'>): Action[][] {
  const { pp, numStages } = s;
  const rankOf = (st: number): number => st % pp;
  // Per channel (sender -> receiver): the messages in the order the sender sends them.
  const channel = new Map<string, { key: string; recv: Action }[]>();
  const chan = (from: number, to: number) => {
    const k = `${from}>${to}`;
    let c = channel.get(k);
    if (c === undefined) channel.set(k, (c = []));
    return c;
  };
  const actions: Action[][] = [];
  for (let r = 0; r < pp; r++) {
    const list: Action[] = [];
    for (const a of s.compute[r] ?? []) {
      list.push(a);
      const out = outputOf(a, numStages);
      if (out === null || rankOf(out.to) === r) continue;
      const peer = rankOf(out.to);
      list.push({ kind: out.kind === 'F' ? 'SEND_F' : 'SEND_B', stage: a.stage, micro: a.micro, peer });
      chan(r, peer).push({
        key: msgKey(out.kind, out.to, a.micro),
        recv: { kind: out.kind === 'F' ? 'RECV_F' : 'RECV_B', stage: out.to, micro: a.micro, peer: r },
      });
    }
    actions.push(list);
  }
  // Receives: before compute k, post every not-yet-posted receive from a sender up to and including the
  // one that compute k or compute k+1 needs (one compute of look-ahead, so the transfer for the next
  // action overlaps this one), always in the sender's order.
  for (let r = 0; r < pp; r++) {
    const posted = new Map<number, number>(); // sender -> how many of its messages are posted
    const list: Action[] = [];
    const compute = s.compute[r] ?? [];
    const postFor = (a: Action | undefined) => {
      const inp = a === undefined ? null : inputOf(a, numStages);
      if (a === undefined || inp === null || rankOf(inp.from) === r) return;
      const from = rankOf(inp.from);
      const msgs = chan(from, r);
      const want = msgKey(inp.kind, a.stage, a.micro);
      const idx = msgs.findIndex((x) => x.key === want);
      // A message nobody sends (idx -1): the consumer gets no receive; validateSchedule names it.
      for (let n = posted.get(from) ?? 0; n <= idx; n++) list.push(msgs[n]!.recv);
      if (idx >= (posted.get(from) ?? 0)) posted.set(from, idx + 1);
    };
    let k = 0;
    for (const a of actions[r]!) {
      if (isCompute(a.kind)) {
        postFor(a);
        postFor(compute[k + 1]);
        k++;
      }
      list.push(a);
    }
    // Messages sent to this rank that no compute consumes stay unreceived; validateSchedule names them.
    actions[r] = list;
  }
  return actions;
}

// ---------------------------------------------------------------------------------------------------
// Building

export function buildSchedule(name: ScheduleName, opts: { pp: number; micro: number; virtualStages?: number }): PipelineSchedule {
  if (!SCHEDULE_NAMES.includes(name)) {
    throw new Error(`unknown pipeline schedule ${JSON.stringify(name)}; schedules are ${SCHEDULE_NAMES.join(', ')}`);
  }
  const pp = checkCount('pp (pipeline ranks)', opts.pp, '--pp');
  const m = checkCount('the number of micro-batches', opts.micro, '--micro');
  let v = 1;
  if (name === 'interleaved') {
    v = checkCount('virtualStages', opts.virtualStages ?? 2, '--virtual');
  } else if (opts.virtualStages !== undefined && opts.virtualStages !== 1) {
    throw new Error(`virtual stages (${opts.virtualStages}) need the 'interleaved' schedule; '${name}' places one stage per rank`);
  }
  const base = skeleton(name, pp, m, v);
  let compute: Action[][];
  switch (name) {
    case 'gpipe':
      compute = gpipeCompute(pp, m);
      break;
    case '1f1b':
      compute = oneFOneBCompute(pp, m);
      break;
    case 'interleaved':
      compute = interleavedCompute(pp, m, v);
      break;
    case 'zb':
      compute = zeroBubbleCompute(pp, m);
      break;
  }
  const withCompute = { ...base, compute };
  return { ...withCompute, actions: insertComm(withCompute) };
}

// ---------------------------------------------------------------------------------------------------
// Validation

function fail(problem: string, detail: string): never {
  throw new Error(`invalid pipeline schedule (${problem}): ${detail}`);
}

/** Throws an Error naming the first problem: incomplete, non-causal, unmatched send/recv, or a deadlock (cycle). */
export function validateSchedule(s: PipelineSchedule): void {
  const { pp, micro: m, numStages } = s;
  if (s.numStages !== s.pp * s.virtualStages) fail('shape', `numStages ${s.numStages} != pp ${s.pp} x virtualStages ${s.virtualStages}`);
  if (s.compute.length !== pp || s.actions.length !== pp) {
    fail('shape', `compute has ${s.compute.length} and actions ${s.actions.length} rank lists; pp = ${pp}`);
  }
  const rankOf = (st: number): number => st % pp;

  // 1. Complete: every stage on its own rank runs F and either B or (I and W) once per micro-batch.
  for (let r = 0; r < pp; r++) {
    const seen = new Map<string, number>();
    for (const a of s.compute[r]!) {
      if (!isCompute(a.kind)) fail('shape', `rank ${r}: compute list holds ${actionName(a)}, which is not a compute action`);
      if (!Number.isInteger(a.stage) || a.stage < 0 || a.stage >= numStages || rankOf(a.stage) !== r) {
        fail('incomplete', `rank ${r} runs ${actionName(a)}, but stage ${a.stage} ${a.stage >= 0 && a.stage < numStages ? `lives on rank ${rankOf(a.stage)}` : 'does not exist'}`);
      }
      if (!Number.isInteger(a.micro) || a.micro < 0 || a.micro >= m) fail('incomplete', `rank ${r} runs ${actionName(a)}: micro-batch ${a.micro} is outside 0..${m - 1}`);
      const k = `${a.stage}${a.kind}${a.micro}`;
      if (seen.has(k)) fail('incomplete', `rank ${r} runs ${k} twice`);
      seen.set(k, 1);
    }
    for (const st of s.stagesOf(r)) {
      for (let i = 0; i < m; i++) {
        const has = (k: ComputeKind) => seen.has(`${st}${k}${i}`);
        if (!has('F')) fail('incomplete', `rank ${r} never runs ${st}F${i}`);
        if (has('B') && (has('I') || has('W'))) fail('incomplete', `rank ${r} runs both ${st}B${i} and its split halves I/W`);
        if (!has('B') && !(has('I') && has('W'))) {
          fail('incomplete', `rank ${r} never runs the backward of stage ${st} micro-batch ${i} (${st}B${i}, or ${st}I${i} and ${st}W${i})`);
        }
      }
    }
  }

  // 2. Causal on each rank: F before its backward, I before W, and stage-to-stage order where two
  //    consecutive stages share a rank.
  for (let r = 0; r < pp; r++) {
    const pos = new Map<string, number>();
    s.compute[r]!.forEach((a, idx) => pos.set(`${a.stage}${a.kind}${a.micro}`, idx));
    const at = (st: number, k: ComputeKind, i: number) => pos.get(`${st}${k}${i}`);
    const before = (x: string, xi: number | undefined, y: string, yi: number | undefined) => {
      if (xi !== undefined && yi !== undefined && xi > yi) fail('non-causal', `rank ${r} runs ${y} before ${x}`);
    };
    for (const st of s.stagesOf(r)) {
      for (let i = 0; i < m; i++) {
        const back = at(st, 'B', i) !== undefined ? 'B' : 'I';
        before(`${st}F${i}`, at(st, 'F', i), `${st}${back}${i}`, at(st, back, i));
        before(`${st}I${i}`, at(st, 'I', i), `${st}W${i}`, at(st, 'W', i));
        if (st + 1 < numStages && rankOf(st + 1) === r) {
          before(`${st}F${i}`, at(st, 'F', i), `${st + 1}F${i}`, at(st + 1, 'F', i));
          const nb = at(st + 1, 'B', i) !== undefined ? 'B' : 'I';
          const b = at(st, 'B', i) !== undefined ? 'B' : 'I';
          before(`${st + 1}${nb}${i}`, at(st + 1, nb, i), `${st}${b}${i}`, at(st, b, i));
        }
      }
    }
  }

  // 3. Compute and actions agree; every SEND follows its producer, every consumer has its RECV before it.
  for (let r = 0; r < pp; r++) {
    const comp = s.actions[r]!.filter((a) => isCompute(a.kind));
    const ref = s.compute[r]!;
    if (comp.length !== ref.length || comp.some((a, i) => a.kind !== ref[i]!.kind || a.stage !== ref[i]!.stage || a.micro !== ref[i]!.micro)) {
      fail('shape', `rank ${r}: the compute actions in actions[${r}] differ from compute[${r}]`);
    }
  }
  type Msg = { kind: 'F' | 'B'; toStage: number; micro: number; from: number; to: number };
  const sends: Msg[][][] = Array.from({ length: pp }, () => Array.from({ length: pp }, () => [])); // [from][to]
  const recvs: Msg[][][] = Array.from({ length: pp }, () => Array.from({ length: pp }, () => [])); // [from][to]
  for (let r = 0; r < pp; r++) {
    const done = new Set<string>();
    const received = new Set<string>();
    for (const a of s.actions[r]!) {
      if (isCompute(a.kind)) {
        const inp = inputOf(a, numStages);
        if (inp !== null && rankOf(inp.from) !== r && !received.has(msgKey(inp.kind, a.stage, a.micro))) {
          fail('unmatched send/recv', `rank ${r} runs ${actionName(a)} without first posting its receive ${a.stage}RECV_${inp.kind}${a.micro}<-${rankOf(inp.from)}`);
        }
        done.add(`${a.stage}${a.kind}${a.micro}`);
        continue;
      }
      const peer = a.peer;
      if (peer === undefined || !Number.isInteger(peer) || peer < 0 || peer >= pp || peer === r) {
        fail('unmatched send/recv', `rank ${r}: ${actionName(a)} has no valid peer rank`);
      }
      const dir: 'F' | 'B' = a.kind.endsWith('_F') ? 'F' : 'B';
      if (a.kind.startsWith('SEND')) {
        const to = dir === 'F' ? a.stage + 1 : a.stage - 1;
        if (to < 0 || to >= numStages || rankOf(to) !== peer) {
          fail('unmatched send/recv', `rank ${r}: ${actionName(a)} goes to rank ${peer}, but stage ${to} ${to >= 0 && to < numStages ? `lives on rank ${rankOf(to)}` : 'does not exist'}`);
        }
        const producer = dir === 'F' ? `${a.stage}F${a.micro}` : done.has(`${a.stage}B${a.micro}`) ? `${a.stage}B${a.micro}` : `${a.stage}I${a.micro}`;
        if (!done.has(producer)) fail('non-causal', `rank ${r} sends ${actionName(a)} before running the ${dir === 'F' ? 'forward' : 'backward'} that produces it`);
        sends[r]![peer]!.push({ kind: dir, toStage: to, micro: a.micro, from: r, to: peer });
      } else {
        const fromStage = dir === 'F' ? a.stage - 1 : a.stage + 1;
        if (fromStage < 0 || fromStage >= numStages || rankOf(fromStage) !== peer) {
          fail('unmatched send/recv', `rank ${r}: ${actionName(a)} expects rank ${peer}, but stage ${fromStage} ${fromStage >= 0 && fromStage < numStages ? `lives on rank ${rankOf(fromStage)}` : 'does not exist'}`);
        }
        received.add(msgKey(dir, a.stage, a.micro));
        recvs[peer]![r]!.push({ kind: dir, toStage: a.stage, micro: a.micro, from: peer, to: r });
      }
    }
  }
  const show = (x: Msg, side: 'send' | 'recv') =>
    side === 'send'
      ? `${x.kind === 'F' ? x.toStage - 1 : x.toStage + 1}SEND_${x.kind}${x.micro}->${x.to}`
      : `${x.toStage}RECV_${x.kind}${x.micro}<-${x.from}`;
  for (let a = 0; a < pp; a++) {
    for (let b = 0; b < pp; b++) {
      const ss = sends[a]![b]!;
      const rr = recvs[a]![b]!;
      for (let i = 0; i < Math.max(ss.length, rr.length); i++) {
        const x = ss[i];
        const y = rr[i];
        if (x === undefined) fail('unmatched send/recv', `rank ${b} posts ${show(y!, 'recv')} but rank ${a} sends nothing more to it`);
        if (y === undefined) fail('unmatched send/recv', `rank ${a} sends ${show(x, 'send')} but rank ${b} posts no receive for it`);
        if (x.kind !== y.kind || x.toStage !== y.toStage || x.micro !== y.micro) {
          fail('unmatched send/recv', `message ${i} from rank ${a} to rank ${b} is ${show(x, 'send')}, but rank ${b}'s receive ${i} from rank ${a} is ${show(y, 'recv')} (sends and receives must be in the same order)`);
        }
      }
    }
  }

  // 4. Deadlock-free: run every list with non-blocking comm and blocking waits at consumption.
  runActions(s);
}

/** Executes the action lists with the runtime's semantics; throws naming the cycle of waiting ranks. */
function runActions(s: PipelineSchedule): void {
  const { pp, numStages } = s;
  const rankOf = (st: number): number => st % pp;
  const sent = new Set<string>();
  const ptr = new Array<number>(pp).fill(0);
  let progress = true;
  while (progress) {
    progress = false;
    for (let r = 0; r < pp; r++) {
      const list = s.actions[r]!;
      while (ptr[r]! < list.length) {
        const a = list[ptr[r]!]!;
        if (a.kind === 'SEND_F' || a.kind === 'SEND_B') {
          sent.add(msgKey(a.kind === 'SEND_F' ? 'F' : 'B', a.kind === 'SEND_F' ? a.stage + 1 : a.stage - 1, a.micro));
        } else if (isCompute(a.kind)) {
          const inp = inputOf(a, numStages);
          if (inp !== null && rankOf(inp.from) !== r && !sent.has(msgKey(inp.kind, a.stage, a.micro))) break;
        }
        ptr[r]!++;
        progress = true;
      }
    }
  }
  if (ptr.every((p, r) => p === s.actions[r]!.length)) return;
  // Each blocked rank waits for exactly one peer: follow the chain to its cycle.
  const waitsOn = (r: number): { peer: number; text: string } => {
    const a = s.actions[r]![ptr[r]!]!;
    const inp = inputOf(a, numStages)!;
    const peer = rankOf(inp.from);
    return { peer, text: `rank ${r} waits at ${actionName(a)} for ${inp.from}SEND_${inp.kind}${a.micro} from rank ${peer}` };
  };
  let r = ptr.findIndex((p, k) => p < s.actions[k]!.length);
  const seen: number[] = [];
  while (!seen.includes(r) && ptr[r]! < s.actions[r]!.length) {
    seen.push(r);
    r = waitsOn(r).peer;
  }
  const cycle = seen.slice(Math.max(0, seen.indexOf(r)));
  fail('deadlock', `${cycle.map((k) => waitsOn(k).text).join('; ')}`);
}

// ---------------------------------------------------------------------------------------------------
// Simulation

export interface Simulation {
  /** grid[rank][t] = the compute action occupying that unit time slot, or null when the rank is idle. */
  grid: (Action | null)[][];
  makespan: number;
  /** Idle slots per rank within the makespan. */
  idle: number[];
  /** Sum of idle slots over pp x makespan. */
  bubbleFraction: number;
}

/** Simulated timeline with unit costs (F=1, B=2 or I=1 + W=1, comm=0): per rank the time slots, bubble count and fraction. */
export function simulate(s: PipelineSchedule, cost: UnitCosts = UNIT_COSTS): Simulation {
  for (const k of ['F', 'B', 'I', 'W'] as const) {
    if (!Number.isInteger(cost[k]) || cost[k] < 1) throw new Error(`simulate: cost ${k} must be a positive integer number of slots, got ${cost[k]}`);
  }
  const { pp, numStages } = s;
  const finish = new Map<string, number>();
  const key = (st: number, k: ComputeKind, i: number) => `${st}${k}${i}`;
  const deps = (a: Action): string[] => {
    const d: string[] = [];
    if (a.kind === 'F' && a.stage > 0) d.push(key(a.stage - 1, 'F', a.micro));
    if (a.kind === 'B' || a.kind === 'I') {
      d.push(key(a.stage, 'F', a.micro));
      if (a.stage < numStages - 1) {
        d.push(finish.has(key(a.stage + 1, 'B', a.micro)) ? key(a.stage + 1, 'B', a.micro) : key(a.stage + 1, 'I', a.micro));
      }
    }
    if (a.kind === 'W') d.push(key(a.stage, 'I', a.micro));
    return d;
  };
  const grid: (Action | null)[][] = Array.from({ length: pp }, () => []);
  const clock = new Array<number>(pp).fill(0);
  const ptr = new Array<number>(pp).fill(0);
  let progress = true;
  while (progress) {
    progress = false;
    for (let r = 0; r < pp; r++) {
      const list = s.compute[r]!;
      while (ptr[r]! < list.length) {
        const a = list[ptr[r]!]!;
        const d = deps(a);
        if (!d.every((k) => finish.has(k))) break;
        const start = Math.max(clock[r]!, ...d.map((k) => finish.get(k)!));
        const end = start + cost[a.kind as ComputeKind];
        for (let t = grid[r]!.length; t < start; t++) grid[r]!.push(null);
        for (let t = start; t < end; t++) grid[r]!.push(a);
        finish.set(key(a.stage, a.kind as ComputeKind, a.micro), end);
        clock[r] = end;
        ptr[r]!++;
        progress = true;
      }
    }
  }
  const stuck = ptr.findIndex((p, r) => p < s.compute[r]!.length);
  if (stuck >= 0) {
    throw new Error(`simulate: the compute order cannot run (a cycle); rank ${stuck} is stuck at ${actionName(s.compute[stuck]![ptr[stuck]!]!)}; run validateSchedule for details`);
  }
  const makespan = Math.max(0, ...clock);
  for (const row of grid) while (row.length < makespan) row.push(null);
  const idle = grid.map((row) => row.filter((x) => x === null).length);
  const total = idle.reduce((x, y) => x + y, 0);
  return { grid, makespan, idle, bubbleFraction: makespan === 0 ? 0 : total / (pp * makespan) };
}

/** Per rank, the most micro-batches at once between an action of kind `from` and one of `until`. */
function peakBetween(s: PipelineSchedule, from: ComputeKind, until: readonly ComputeKind[]): number[] {
  return s.compute.map((list) => {
    let live = 0;
    let peak = 0;
    for (const a of list) {
      if (a.kind === from) peak = Math.max(peak, ++live);
      else if ((until as readonly string[]).includes(a.kind)) live--;
    }
    return peak;
  });
}

/** Peak number of micro-batch activations each rank holds (forwards run whose backward, or W, has not). */
export function peakActivations(s: PipelineSchedule): number[] {
  return peakBetween(s, 'F', ['B', 'W']);
}

/**
 * Per rank, the most micro-batches whose weight gradients are deferred at once (input gradient done,
 * W not yet): a split schedule keeps each one's output gradients until its W runs.
 */
export function peakDeferredWeightGrads(s: PipelineSchedule): number[] {
  return peakBetween(s, 'I', ['W']);
}

/** The bubble fraction theory predicts with unit costs: (p-1)/(m+p-1) for GPipe and 1F1B,
 *  (p-1)/(v*m+p-1) for interleaved 1F1B, (p-1)/(3m+p-1) for ZB-H1 (bubble (p-1)(F+B-W) instead of (p-1)(F+B+W)). */
export function theoreticalBubble(name: ScheduleName, pp: number, micro: number, virtualStages = 1): number {
  const p = pp;
  const m = micro;
  switch (name) {
    case 'gpipe':
    case '1f1b':
      return (p - 1) / (m + p - 1);
    case 'interleaved':
      return (p - 1) / (virtualStages * m + p - 1);
    case 'zb':
      return (p - 1) / (3 * m + p - 1);
  }
}

/** Text grid (ranks x time) like '0: 0F0 0F1 ... ' with '.' for idle slots, for `flotilla schedule`. */
export function formatSchedule(s: PipelineSchedule, sim: Simulation = simulate(s)): string {
  const names = sim.grid.map((row) => row.map((a) => (a === null ? '.' : `${a.stage}${a.kind}${a.micro}`)));
  const width = Math.max(1, ...names.flat().map((x) => x.length));
  const label = String(s.pp - 1).length;
  return names.map((row, r) => `${String(r).padStart(label)}: ${row.map((x) => x.padEnd(width)).join(' ').trimEnd()}`).join('\n');
}

const THEORY_LABEL: Record<ScheduleName, string> = {
  gpipe: '(p-1)/(m+p-1)',
  '1f1b': '(p-1)/(m+p-1)',
  interleaved: '(p-1)/(v*m+p-1), Megatron-LM',
  zb: '(p-1)/(3m+p-1), ZB-H1 with F = I = W',
};

/** What `flotilla schedule` prints: a header, the grid, the simulated bubble against theory, the peak
 *  activations per rank and, with `actions`, every rank's action list including its sends and receives. */
export function describeSchedule(s: PipelineSchedule, opts: { actions?: boolean } = {}): string {
  const sim = simulate(s);
  const split = s.compute.some((l) => l.some((a) => a.kind === 'I'));
  const idle = sim.idle.reduce((x, y) => x + y, 0);
  const lines = [
    `${s.name} schedule: pp=${s.pp}, m=${s.micro}, ${s.numStages} stages (${s.virtualStages} per rank, stage s on rank s % ${s.pp})`,
    `unit costs: F=1, ${split ? 'I=1, W=1 (backward split)' : 'B=2'}, send/recv=0; checked: complete, causal, sends matched, deadlock-free`,
    '',
    formatSchedule(s, sim),
    '',
    `simulated bubble: ${sim.bubbleFraction.toFixed(4)} (${idle} idle of ${s.pp} x ${sim.makespan} rank-slots; idle per rank ${sim.idle.join(' ')})`,
    `theory ${THEORY_LABEL[s.name]}: ${theoreticalBubble(s.name, s.pp, s.micro, s.virtualStages).toFixed(4)}`,
    `peak activations per rank (stage micro-batches held from F until ${split ? 'W' : 'B'}): ${peakActivations(s).join(' ')}`,
  ];
  if (opts.actions) {
    lines.push('', "actions per rank (a SEND follows its producer; a RECV is posted one compute ahead of its consumer, in the sender's order):");
    s.actions.forEach((list, r) => lines.push(`${r}: ${list.map(actionName).join(' ')}`));
  }
  return `${lines.join('\n')}\n`;
}

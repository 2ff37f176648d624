// The launcher's restart decisions (src/launch/restarts.ts), one transition at a time: no process
// is started; each test gives a state and an event and checks the state, the action and the line.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { heardRoster, initialState, nextStep, type RestartLimits, type RestartState } from '../src/launch/restarts.js';

const plain: RestartLimits = { nproc: 2, maxNodes: 1, minNodes: 1, maxRestarts: 2 };
const elastic: RestartLimits = { nproc: 1, maxNodes: 3, minNodes: 2, maxRestarts: 0 };
/** Node 1 of a three-host elastic job after its first meeting's roster. */
const met: RestartState = heardRoster(initialState({ nnodes: 3, nodeRank: 1, masterAddr: '10.0.0.1' }), ['10.0.0.1', '10.0.0.2', '10.0.0.3']);
const start = initialState({ nnodes: 1, nodeRank: 0, masterAddr: '127.0.0.1' });
const failed = { kind: 'failed', rank: 1, code: 3, signal: null } as const;

test('initial state: attempt 0 of the first meeting, placed as the command line says; the roster is heard once', () => {
  assert.deepEqual(initialState({ nnodes: 3, nodeRank: 1, masterAddr: 'a' }), { attempt: 0, first: 0, me: 1, nnodes: 3, nodeRank: 1, masterAddr: 'a' });
  assert.deepEqual(met.members, { ids: [0, 1, 2], addrs: ['10.0.0.1', '10.0.0.2', '10.0.0.3'] });
  assert.equal(heardRoster(met, ['x', 'y', 'z']), met, 'a later roster changes nothing');
  assert.equal(heardRoster(start, undefined), start);
});

test('ended, every rank exited 0: exit 0', () => {
  assert.deepEqual(nextStep(start, { on: 'ended', outcome: { kind: 'ok' } }, plain), { state: start, act: { do: 'exit', code: 0 } });
});

test('ended, interrupted: exit 128 + the signal', () => {
  assert.deepEqual(nextStep(start, { on: 'ended', outcome: { kind: 'interrupted', signal: 'SIGINT' } }, plain).act, { do: 'exit', code: 130 });
});

test('ended, a local rank failed with restarts left: the next attempt in the same meeting', () => {
  const t = nextStep(start, { on: 'ended', outcome: failed }, plain);
  assert.deepEqual(t.act, { do: 'run' });
  assert.equal(t.state.attempt, 1);
  assert.equal(t.say, 'rank 1 exited with code 3; restarting all 2 local ranks (restart 1 of 2)');
});

test('ended, a local rank failed with no restart left: exit with its code (128 + signal when killed)', () => {
  const last = { ...start, attempt: 2 };
  assert.deepEqual(nextStep(last, { on: 'ended', outcome: failed }, plain), { state: last, act: { do: 'exit', code: 3 }, say: 'failed: rank 1 exited with code 3 (after 2 restarts)' });
  assert.deepEqual(nextStep(last, { on: 'ended', outcome: { ...failed, code: null, signal: 'SIGKILL' } }, plain).act, { do: 'exit', code: 137 });
  assert.equal(nextStep(start, { on: 'ended', outcome: failed }, { ...plain, maxRestarts: 0 }).say, 'failed: rank 1 exited with code 3');
});

test('ended, another node failed: restart while restarts are left, then exit 1', () => {
  const peer = { kind: 'peer', why: 'node 0: rank 0 exited with code 1', fatal: false } as const;
  const limits = { ...elastic, minNodes: 3, maxRestarts: 1 };
  const t = nextStep(met, { on: 'ended', outcome: peer }, limits);
  assert.deepEqual([t.act, t.state.attempt, t.say], [{ do: 'run' }, 1, 'node 0: rank 0 exited with code 1; restarting all 1 local rank (restart 1 of 1)']);
  assert.deepEqual(nextStep(t.state, { on: 'ended', outcome: peer }, limits), { state: t.state, act: { do: 'exit', code: 1 }, say: 'failed: node 0: rank 0 exited with code 1' });
});

test('ended, another node lost in a job that cannot shrink: exit 1 at once', () => {
  const t = nextStep(met, { on: 'ended', outcome: { kind: 'peer', why: 'node 2 (rank 2) lost', fatal: true } }, { ...elastic, minNodes: 3, maxRestarts: 5 });
  assert.deepEqual(t, { state: met, act: { do: 'exit', code: 1 }, say: 'failed: node 2 (rank 2) lost' });
});

test('ended, the first attempt of a meeting after a shrink failed: retried once, not counted against --max-restarts', () => {
  const shrunk: RestartState = { ...met, attempt: 4, first: 4, nnodes: 2, nodeRank: 0 };
  const t = nextStep(shrunk, { on: 'ended', outcome: { ...failed, rank: 0, code: 2 } }, elastic);
  assert.deepEqual([t.act, t.state.attempt, t.state.first], [{ do: 'run' }, 5, 4]);
  assert.equal(t.say, 'rank 0 exited with code 2; restarting all 1 local rank (the first attempt after the hosts met again)');
  // The same failure on the node whose ranks were stopped for it: the same decision.
  assert.deepEqual(nextStep({ ...shrunk, nodeRank: 1 }, { on: 'ended', outcome: { kind: 'peer', why: 'node 0: rank 0 exited with code 2', fatal: false } }, elastic).act, { do: 'run' });
  // Its second failure is final (no --max-restarts); the first meeting's first attempt gets no such retry.
  assert.deepEqual(nextStep(t.state, { on: 'ended', outcome: failed }, elastic).act, { do: 'exit', code: 3 });
  assert.deepEqual(nextStep(met, { on: 'ended', outcome: failed }, elastic).act, { do: 'exit', code: 3 });
});

test('lost, the job cannot shrink: exit 1', () => {
  const t = nextStep(met, { on: 'lost', why: 'node 2 (rank 2) lost', node: 2, started: false }, { ...elastic, minNodes: 3 });
  assert.deepEqual(t, { state: met, act: { do: 'exit', code: 1 }, say: 'failed: node 2 (rank 2) lost' });
});

test('lost before the roster was heard: exit 1, the others cannot meet again', () => {
  const t = nextStep(initialState({ nnodes: 3, nodeRank: 1, masterAddr: 'a' }), { on: 'lost', why: 'node 2 lost', node: 2, started: true }, elastic);
  assert.deepEqual(t.act, { do: 'exit', code: 1 });
  assert.equal(t.say, 'failed: node 2 lost (the hosts\' addresses were not all known yet, so the others cannot meet again)');
});

test('lost, fewer hosts left than MIN: exit 1', () => {
  // The meeting counts three hosts, but only two are known to be in the job.
  const known: RestartState = { ...met, members: { ids: [0, 1], addrs: ['10.0.0.1', '10.0.0.2'] } };
  const t = nextStep(known, { on: 'lost', why: 'node 0 lost', node: 0, started: true }, elastic);
  assert.deepEqual(t, { state: known, act: { do: 'exit', code: 1 }, say: 'failed: node 0 lost; 1 host(s) left, fewer than --nnodes 2:3 allows' });
});

test('lost, the job can shrink: meet again without the host, renumbered, from the next attempt (this one, when it never started)', () => {
  const t = nextStep({ ...met, attempt: 2 }, { on: 'lost', why: 'node 0 (rank 0) lost', node: 0, started: true }, elastic);
  assert.deepEqual(t.act, { do: 'meet', patient: false });
  assert.deepEqual(t.state, {
    attempt: 3, first: 3, me: 1, nnodes: 2, nodeRank: 0, masterAddr: '10.0.0.2', members: { ids: [1, 2], addrs: ['10.0.0.2', '10.0.0.3'] },
    elastic: 'lost node 0 (node 0 (rank 0) lost); continuing on 2 host(s), 2 rank(s) (first-meeting nodes 1, 2; node 0 at 10.0.0.2)',
  });
  assert.equal(t.say, '[elastic] lost node 0 (node 0 (rank 0) lost); continuing on 2 host(s), 2 rank(s) (first-meeting nodes 1, 2; node 0 at 10.0.0.2); this host is node 0 now; restarting its 1 rank(s) from the latest checkpoint');
  assert.equal(nextStep({ ...met, attempt: 2 }, { on: 'lost', why: 'x', node: 2, started: false }, elastic).state.first, 2);
  // Down to one host: its ranks meet on loopback.
  const alone = nextStep({ ...t.state, nnodes: 2 }, { on: 'lost', why: 'node 1 lost', node: 1, started: true }, { ...elastic, minNodes: 1 });
  assert.deepEqual([alone.state.nnodes, alone.state.nodeRank, alone.state.masterAddr], [1, 0, '127.0.0.1']);
});

test('regrouped: meet again with the host that joins, from the checkpoint just saved', () => {
  const grow = { addrs: ['10.0.0.2', '10.0.0.3', '10.0.0.1'], ids: [1, 2, 0], generation: 6 };
  const t = nextStep({ ...met, attempt: 5, first: 3 }, { on: 'regrouped', grow }, elastic);
  assert.deepEqual(t.act, { do: 'meet', patient: false });
  assert.deepEqual([t.state.attempt, t.state.first, t.state.nnodes, t.state.nodeRank, t.state.masterAddr], [6, 6, 3, 0, '10.0.0.2']);
  assert.deepEqual(t.state.members, { ids: [1, 2, 0], addrs: grow.addrs });
  assert.equal(t.say, '[elastic] first-meeting node 0 joined at 10.0.0.1; continuing on 3 host(s), 3 rank(s) (first-meeting nodes 1, 2, 0; node 0 at 10.0.0.2); this host is node 0 now; restarting its 1 rank(s) from the checkpoint just saved');
});

test('regroupUnheard: the ranks stopped for a meeting node 0 never named: exit 1', () => {
  const t = nextStep(met, { on: 'regroupUnheard', lost: 'node 0 lost' }, elastic);
  assert.deepEqual(t, { state: met, act: { do: 'exit', code: 1 }, say: 'failed: the ranks stopped at a checkpoint for a host that joins, but node 0 never named the next meeting (node 0 lost)' });
});

test('joined: a host that asked a running job comes in last at the meeting node 0 named, patiently', () => {
  const grow = { addrs: ['10.0.0.2', '10.0.0.3', '10.0.0.1'], ids: [1, 2, 0], generation: 6 };
  const t = nextStep(initialState({ nnodes: 3, nodeRank: 0, masterAddr: '10.0.0.1' }), { on: 'joined', grow }, elastic);
  assert.deepEqual(t.act, { do: 'meet', patient: true });
  assert.deepEqual([t.state.attempt, t.state.first, t.state.me, t.state.nnodes, t.state.nodeRank, t.state.masterAddr], [6, 6, 0, 3, 2, '10.0.0.2']);
  assert.equal(t.say, '[elastic] joined a running job: this host is node 2 of 3; its ranks start once the others have saved');
});

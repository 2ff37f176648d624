// `flotilla train` across hosts: network namespaces on one bridge (test/helpers/hosts.ts), one rank
// on each. Three hosts train the run a single host trains with --nproc 3, step for step and bit for
// bit, each saving into a directory of its own with a copy of the previous host's files
// ([Note: checkpoint replicas]); a launcher with the wrong job secret is refused before it starts a
// rank; two hosts sharing one checkpoint directory with replicas on are refused at the first save.
// Under --nnodes 2:3 a killed host (a non-master, then the master), its checkpoint directory
// deleted, leaves two that carry on by themselves, bit for bit as a plain two-rank resume of the
// checkpoint they resumed ([Note: elastic shrink]); the killed host, started again, is taken back at
// the next checkpoint and the run finishes on three ([Note: elastic grow]); the master finds the new
// node 0 through --master-addr A,B,C ([Note: master address list]), and with per-host run
// directories every host's holds the whole metrics.jsonl ([Note: run record on every host]).
import { test } from 'node:test';
import { spawnSync, type ChildProcess } from 'node:child_process';
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { tinyGptToml } from './fixtures/tiny_gpt.js';
import { join } from 'node:path';
import { checkCheckpoint } from '../src/checkpoint/checkpoint.js';
import { readMetrics } from '../src/train/metrics.js';
import { flotilla } from './helpers/cli.js';
import { makeHosts, type Hosts } from './helpers/hosts.js';
import { NodeLink, processTree, type Grow } from '../src/launch/heartbeat.js';
import { freePort } from '../src/launch/launcher.js';
import { loadConfig } from '../src/config/index.js';
import { elasticMicroBatches } from '../src/train/elastic.js';
import { suiteSlots } from './helpers/pool.js';

// Heartbeats here time out in seconds: no other file's launch runs beside this file (test/helpers/pool.ts).
await suiteSlots.holdAll();

const dir = mkdtempSync(join(tmpdir(), 'flotilla-hosts-'));
const config = join(dir, 'tiny.toml');
writeFileSync(config, tinyGptToml({
  model: { blockSize: 16 }, data: { seqLen: 16, globalBatch: 12 }, train: { steps: 6, evalEvery: 0 },
  parallel: { backend: 'gloo' }, checkpoint: { every: 3 }, log: { progress: 'plain', every: 1 },
}, 'a tiny GPT across hosts'));

const SECRET = 'hosts-test-secret-0123456789abcdef';
/**
 * Short beats; the hosts here are killed, which their connections closing tell at once, so the
 * silence tolerated only guards against false losses: 10 s, as a load of 15 on the 2-core machine
 * once held two launchers 4.5 s without a beat (3 s was too short). The collective timeout stays long.
 */
const FAST = { FLOTILLA_HEARTBEAT_MS: '500', FLOTILLA_HEARTBEAT_TIMEOUT_MS: '10000', FLOTILLA_KILL_GRACE_MS: '2000', FLOTILLA_JOB_SECRET: SECRET };

test('three hosts, each with its own checkpoint directory: flotilla train --nnodes 3 trains bit for bit as one host with --nproc 3; every file is on two hosts; a wrong secret is refused before any rank starts; two hosts sharing one directory with replicas on are refused at the first save', async (t) => {
  const hosts = makeHosts(3);
  if (typeof hosts === 'string') {
    t.skip(`cannot make network namespaces here: ${hosts}`);
    return;
  }
  try {
    const run = join(dir, 'three-hosts');
    const ckpt = (k: number): string => join(dir, `host${k}-checkpoints`);
    const node = (k: number, env: Record<string, string> = {}) => flotilla(
      ['train', config, '--nnodes', '3', '--node-rank', String(k), '--nproc', '1', '--master-addr', hosts.addr[0]!, '--master-port', '29400',
        `--train.runDir=${run}`, `--checkpoint.dir=${ckpt(k)}`],
      { via: (c, a) => hosts.exec(k, c, a), env: { ...FAST, ...env }, timeoutMs: 120_000 },
    );
    const n0 = node(0);
    // Node 1 with another secret: node 0's heartbeat never admits it, and it gives up (here after 4 s).
    const wrong = await node(1, { FLOTILLA_JOB_SECRET: 'not-the-job-secret-0123456789', FLOTILLA_TIMEOUT_MS: '4000' });
    assert.notEqual(wrong.code, 0, wrong.out + wrong.err);
    assert.match(wrong.err, /no node heartbeat answered at 10\.77\.0\.1:\d+ within 4000 ms \(is node 0's launcher running, with the same FLOTILLA_JOB_SECRET\?\)/, wrong.err);
    assert.doesNotMatch(wrong.out + wrong.err, /\[rank \d\]/, 'a refused launcher started a rank');
    const rs = await Promise.all([n0, node(1), node(2)]);
    for (const r of rs) assert.equal(r.code, 0, r.out + r.err);
    // Rank 0 bound Gloo on its host's bridge interface (the header is rank 0's).
    assert.match(rs[0]!.out, new RegExp(`c10d Gloo over TCP on ${hosts.ns[0]}v 10\\.77\\.0\\.1 .*, 3 ranks`), rs[0]!.out);

    // No shared storage: host k holds its own rank's file and host k-1's, and publishes the same
    // meta.json; `latest` moved on every host.
    for (const k of [0, 1, 2]) {
      assert.equal(readFileSync(join(ckpt(k), 'latest'), 'utf8').trim(), 'step-000006');
      const files = readdirSync(join(ckpt(k), 'step-000006')).filter((f) => f.endsWith('.safetensors')).sort();
      assert.deepEqual(files, [k, (k + 2) % 3].sort().map((r) => `rank-0000${r}.safetensors`), `host ${k}`);
    }
    const all = await flotilla(['checkpoint', 'check', ckpt(0), ckpt(1), ckpt(2)]);
    assert.equal(all.code, 0, all.out + all.err);
    assert.match(all.out, /^OK .*: step 6, 3 file\(s\), .*every tensor complete; every file on two hosts/);
    // Host 1 lost with its disk: the other two still hold every file.
    rmSync(ckpt(1), { recursive: true });
    const left = checkCheckpoint([ckpt(0), ckpt(2)]);
    assert.equal(left.step, 6);
    assert.deepEqual(left.single.sort(), ['rank-00000.safetensors', 'rank-00001.safetensors']);
    assert.throws(() => checkCheckpoint([ckpt(0)]), /rank-00001\.safetensors is in none of these directories; the checkpoint is incomplete \(saved without shared storage on 3 hosts: name every host's directory\)/);

    // Two hosts saving into one directory with replicas on (a shared filesystem taken for local
    // disks): the first save fails on both hosts, the message names the fix, and nothing is published.
    const shared = join(dir, 'shared-checkpoints');
    const pair = await Promise.all([0, 1].map((k) => flotilla(
      ['train', config, '--nnodes', '2', '--node-rank', String(k), '--nproc', '1', '--master-addr', hosts.addr[0]!, '--master-port', '29400',
        `--train.runDir=${join(dir, 'shared-run')}`, `--checkpoint.dir=${shared}`, '--train.steps=3'],
      { via: (c, a) => hosts.exec(k, c, a), env: FAST, timeoutMs: 120_000 },
    )));
    for (const r of pair) assert.notEqual(r.code, 0, r.out + r.err);
    {
      // The rank whose write met the other host's file says why (the other may only know that a rank failed).
      const said = pair.map((r) => r.out + r.err).join('\n');
      assert.match(said, /saving checkpoint step-000003 failed: two hosts write into the same directory .*shared-checkpoints; with \[checkpoint\] replicas = 1 each host needs a directory of its own \(its local disk\): set \[checkpoint\] dir to a local path, or --checkpoint\.replicas=0 on a shared filesystem/, said);
    }
    assert.ok(!existsSync(join(shared, 'latest')), 'a refused save moved latest');

    const ref = await flotilla(['train', config, '--nproc', '3', `--train.runDir=${join(dir, 'one-host')}`], { timeoutMs: 120_000 });
    assert.equal(ref.code, 0, ref.out + ref.err);
    const want = readMetrics(join(dir, 'one-host', 'metrics.jsonl'));
    const got = readMetrics(join(run, 'metrics.jsonl'));
    assert.equal(got.length, 6);
    assert.deepEqual(got.map((m) => [m.step, m.loss, m.gradNorm]), want.map((m) => [m.step, m.loss, m.gradNorm]));
  } finally {
    hosts.drop();
  }
});

test('elastic micro-batches: on fewer ranks than the job started with, the fewest micro-batches that keep each as small as at the start', () => {
  const cfg = loadConfig(config, []); // global batch 12, one micro-batch
  const on = (world: number, first?: number) => elasticMicroBatches(cfg, world, first === undefined ? {} : { FLOTILLA_ELASTIC_WORLD: String(first) });
  assert.deepEqual(on(2, 3), { microBatches: 2, why: 'micro-batches raised 1 -> 2 (3 sample(s) each, as on the 3 rank(s) the job started with)' });
  assert.equal(on(1, 3).microBatches, 3);
  assert.equal(on(1, 2).microBatches, 2);
  assert.equal(on(3, 3).microBatches, 1, 'the world it started with');
  assert.equal(on(2).microBatches, 1, 'not an elastic job');
  assert.equal(elasticMicroBatches(loadConfig(config, ['--data.microBatches=2']), 1, { FLOTILLA_ELASTIC_WORLD: '2' }).microBatches, 4);
});

/** Resolves once `ok()` holds (checked every 20 ms), or rejects naming `what` after 10 s. */
async function until(ok: () => boolean, what: string): Promise<void> {
  for (const end = Date.now() + 10_000; !ok(); await new Promise((r) => setTimeout(r, 20))) {
    if (Date.now() > end) throw new Error(`not seen within 10 s: ${what}`);
  }
}

test('heartbeat of a later meeting: node 0 tells the next meeting also to a node that arrives after the returning host asked; a node that leaves after its goodbye is not lost; after a loss node 0 admits no one', async () => {
  // Under load a survivor can reach the meeting after the host that returns. It once never heard of
  // the next meeting, took its ranks' stop at the checkpoint for the end of the run, and node 0 waited
  // for it at the next meeting for ever ([Note: grow told to every node]).
  const base = { nproc: 1, host: '127.0.0.1', port: await freePort(), secret: 's', config: { intervalMs: 100, timeoutMs: 2000 }, joinTimeoutMs: 1500 };
  const downs: string[] = [];
  const next: Grow = { addrs: ['127.0.0.1', '127.0.0.1', '127.0.0.1'], ids: [0, 2, 1], generation: 2 };
  const n0 = await NodeLink.start({ ...base, nodeRank: 0, nnodes: 2, generation: 1, onPeerDown: (why) => downs.push(why), onAsk: () => next });
  try {
    const asker = await NodeLink.start({ ...base, nodeRank: 1, nnodes: 3, onPeerDown: (why) => downs.push(`asker: ${why}`) });
    assert.deepEqual(asker.grow, next);
    await asker.close();
    const heard: Grow[] = [];
    const late = (onGrow: (g: Grow) => void) => NodeLink.start({ ...base, nodeRank: 1, nnodes: 2, generation: 1, onPeerDown: (why) => downs.push(`node 1: ${why}`), onGrow });
    const n1 = await late((g) => heard.push(g));
    await until(() => heard.length > 0, 'the next meeting at node 1');
    assert.deepEqual(heard, [next]);
    // Its ranks stopped for the next meeting: it says goodbye and leaves, which is no loss.
    n1.announceDone();
    await n1.close();
    await new Promise((r) => setTimeout(r, 300));
    assert.deepEqual(downs, []);
    // A node lost (its connection closed without a goodbye): this meeting is over, and node 0 admits no one to it.
    const again = await late(() => undefined);
    await again.close();
    await until(() => downs.length > 0, 'node 1 lost');
    assert.match(downs[0]!, /node 1 \(rank 1\) lost: its launcher's heartbeat connection closed/);
    await assert.rejects(late(() => undefined), /no node heartbeat answered at 127\.0\.0\.1:\d+ within 1500 ms/);
  } finally {
    await n0.close();
  }
});

/** Starts `flotilla train` on host k; `seen(re)` resolves once its output matches. */
function startNode(hosts: Pick<Hosts, 'exec'>, k: number, args: string[], env: Record<string, string> = {}) {
  let child: ChildProcess | undefined;
  let text = '';
  const waiters: { re: RegExp; resolve: () => void }[] = [];
  const done = flotilla(args, {
    via: (c, a) => hosts.exec(k, c, a), env: { ...FAST, ...env }, timeoutMs: 240_000,
    onStart: (c) => {
      child = c;
      const on = (d: Buffer): void => {
        text += d;
        if (process.env.FLOTILLA_TEST_VERBOSE === '1') process.stderr.write(`[host ${k}] ${d}`);
        for (const w of waiters.filter((x) => x.re.test(text))) {
          waiters.splice(waiters.indexOf(w), 1);
          w.resolve();
        }
      };
      c.stdout!.on('data', on);
      c.stderr!.on('data', on);
    },
  });
  return {
    done,
    seen: (re: RegExp): Promise<void> => Promise.race([
      new Promise<void>((resolve) => (re.test(text) ? resolve() : waiters.push({ re, resolve }))),
      done.then((r) => {
        if (!re.test(text)) throw new Error(`host ${k} exited (${r.code}) before ${re} was seen:\n${text}`);
      }),
    ]),
    /** Every process of this host's job, killed at once (the host is gone). */
    kill: (): void => {
      for (const pid of processTree(child!.pid!)) {
        try {
          process.kill(pid, 'SIGKILL');
        } catch {
          // gone already
        }
      }
    },
  };
}

for (const victim of [1, 0]) {
  // The killed host comes back after the shrink and is taken back at the next checkpoint. The lost
  // master finds the job's new node 0 through the list of master addresses every host was given.
  const steps = 21;
  test(`three hosts, --nnodes 2:3: host ${victim}${victim === 0 ? ' (the master)' : ''} is killed; the other two carry on by themselves and their steps after the resume equal a plain two-rank resume of that checkpoint; restarted${victim === 0 ? ' with --master-addr A,B,C' : ''}, it is taken back at the next checkpoint and the run finishes on three`, async (t) => {
    const hosts = makeHosts(3, `${process.pid % 100000}${victim}`);
    if (typeof hosts === 'string') {
      t.skip(`cannot make network namespaces here: ${hosts}`);
      return;
    }
    try {
      const run = join(dir, `shrink-${victim}`);
      const ckpt = (k: number): string => join(dir, `shrink-${victim}-host${k}`);
      // With the master's host lost, each host keeps the run directory on its own disk too
      // ([Note: run record on every host]); with host 1 lost, the hosts share one.
      const runOf = (k: number): string => (victim === 0 ? `${run}-host${k}` : run);
      // Each host saves into a directory of its own (replicas: every file also on the next host).
      const masterAddr = victim === 0 ? hosts.addr.join(',') : hosts.addr[0]!;
      const args = (k: number): string[] => ['train', config, '--nnodes', '2:3', '--node-rank', String(k), '--nproc', '1', '--master-addr', masterAddr,
        '--master-port', '29400', `--train.runDir=${runOf(k)}`, `--train.steps=${steps}`, '--checkpoint.keep=20', `--checkpoint.dir=${ckpt(k)}`];
      const nodes = [0, 1, 2].map((k) => startNode(hosts, k, args(k)));
      await nodes[0]!.seen(new RegExp(`step +4/${steps}`));
      const t0 = Date.now();
      nodes[victim]!.kill();
      rmSync(ckpt(victim), { recursive: true, force: true }); // its disk is gone too
      const survivors = [0, 1, 2].filter((k) => k !== victim);
      const newMaster = nodes[survivors[0]!]!;
      await nodes[victim]!.done;
      await newMaster.seen(/flotilla run: \[elastic\] lost node/);
      // The lost host is started again, its checkpoint directory empty, once node 0 has left the
      // first meeting (it asks the next one, which the other survivor may not have reached yet).
      const back = startNode(hosts, victim, args(victim));
      const tBack = Date.now();
      const backMs = newMaster.seen(/\[elastic\] first-meeting node \d joined at .*resumed from step \d+\n[^]*step +\d+\//).then(() => Date.now() - tBack);
      await newMaster.seen(new RegExp(`\\[elastic\\] .*resumed from step \\d+\\n[^]*step +\\d+/${steps}`));
      const firstStepMs = Date.now() - t0;
      const rs = await Promise.all(survivors.map((k) => nodes[k]!.done));
      for (const r of rs) assert.equal(r.code, 0, r.out + r.err);
      const out = rs[0]!.out + rs[0]!.err;
      assert.match(rs[0]!.err, new RegExp(`\\[elastic\\] lost node ${victim} \\(node ${victim} \\(rank ${victim}\\) lost: .*\\); continuing on 2 host\\(s\\), 2 rank\\(s\\) \\(first-meeting nodes ${survivors.join(', ')}; node 0 at ${hosts.addr[survivors[0]!]!.replace(/\./g, '\\.')}\\)`), out);
      // Each rank's share of the global batch grew from 4 samples to 6: two micro-batches of 3.
      const m = /\[elastic\] lost node .*data parallel 2, accumulate reduceLast; micro-batches raised 1 -> 2 \(3 sample\(s\) each, as on the 3 rank\(s\) the job started with\); resumed from step (\d+)/.exec(out);
      assert.ok(m, `no [elastic] line of rank 0 naming the new layout and the step:\n${out}`);
      const step = Number(m[1]);
      assert.ok(step >= 3 && step % 3 === 0, `resumed from step ${step}`);
      // The survivors completed the checkpoint on both hosts: each lacked one file, which the other sent.
      const fetched = /\[checkpoint\] \S+ completed on every host: (\d+) file\(s\), ([\d,]+) bytes sent between hosts/.exec(out);
      assert.ok(fetched, out);
      assert.equal(Number(fetched[1]), 2);
      t.diagnostic(`loss to first new step on the survivors: ${firstStepMs} ms; resumed from step ${step}; ${fetched[2]} bytes of checkpoint sent between the survivors`);
      const all = checkCheckpoint(survivors.map((k) => join(ckpt(k), `step-${String(step).padStart(6, '0')}`)));
      assert.deepEqual(all.single, []);

      // A plain two-rank resume of the same checkpoint, with two micro-batches (one host: two hosts train bit for bit as one, above).
      const ref = await flotilla(['train', config, '--nproc', '2', '--resume', join(ckpt(survivors[0]!), `step-${String(step).padStart(6, '0')}`),
        `--train.runDir=${join(dir, `shrink-ref-${victim}`)}`, `--train.steps=${steps}`, '--data.microBatches=2'], { timeoutMs: 120_000 });
      assert.equal(ref.code, 0, ref.out + ref.err);
      const want = readMetrics(join(dir, `shrink-ref-${victim}`, 'metrics.jsonl')).filter((r) => r.step > step);
      const got = readMetrics(join(runOf(survivors[0]!), 'metrics.jsonl'));
      // metrics.jsonl continues after each resumed step: each step once, in order. Per-host run
      // directories: the new node 0 kept the record on its own disk (config, metrics, lock released
      // at the end), and the other survivor holds the same rows.
      assert.deepEqual(got.map((r) => r.step), Array.from({ length: steps }, (_, i) => i + 1));
      const b = await back.done;
      assert.equal(b.code, 0, b.out + b.err);
      // The host taken back: every host heard of the meeting, and rank 0 says where it resumed.
      const at = (k: number): string => hosts.addr[k]!.replace(/\./g, '\\.');
      assert.match(b.err, /\[elastic\] joined a running job: this host is node 2 of 3/, b.err);
      for (const r of rs) assert.match(r.err, new RegExp(`\\[elastic\\] first-meeting node ${victim} \\(${at(victim)}\\) joins: the ranks stop at their next checkpoint and the job meets again on 3 hosts`), r.err);
      const g = new RegExp(`\\[elastic\\] first-meeting node ${victim} joined at ${at(victim)}; continuing on 3 host\\(s\\), 3 rank\\(s\\) \\(first-meeting nodes ${[...survivors, victim].join(', ')}; node 0 at ${at(survivors[0]!)}\\); data parallel 3, .*; resumed from step (\\d+)`).exec(out);
      assert.ok(g, `no [elastic] line of rank 0 for the host taken back:\n${out}`);
      const grownAt = Number(g[1]);
      assert.ok(grownAt > step && grownAt < steps && grownAt % 3 === 0, `grown at step ${grownAt}`);
      t.diagnostic(`host ${victim} taken back at step ${grownAt}, the first step on three ${await backMs} ms after it was started; the run finished on three`);
      for (const k of victim === 0 ? [0, 1, 2] : []) {
        for (const s of k === victim ? [grownAt] : [step, grownAt]) assert.ok(existsSync(join(runOf(k), `config.resumed-${s}.toml`)), `host ${k}: ${readdirSync(runOf(k)).join(', ')}`);
        assert.ok(!existsSync(join(runOf(k), '.lock')), `host ${k}'s run directory is still locked`);
        const rows = readMetrics(join(runOf(k), 'metrics.jsonl'));
        assert.deepEqual(rows.map((r) => [r.step, r.loss, r.gradNorm, r.lr]), got.map((r) => [r.step, r.loss, r.gradNorm, r.lr]), `host ${k}`);
      }
      // Until the run grows again, the survivors' steps are a plain two-rank resume's, bit for bit.
      assert.ok(want.length >= grownAt - step);
      assert.deepEqual(got.filter((r) => r.step > step && r.step <= grownAt).map((r) => [r.step, r.loss, r.gradNorm]),
        want.filter((r) => r.step <= grownAt).map((r) => [r.step, r.loss, r.gradNorm]));
    } finally {
      hosts.drop();
    }
  });
}

test('two hosts, --nnodes 1:2: host 1 is killed and host 0 carries on alone; host 1, started again, is taken back at the next checkpoint and the run finishes on two', async (t) => {
  const hosts = makeHosts(2, `${process.pid % 100000}9`);
  if (typeof hosts === 'string') {
    t.skip(`cannot make network namespaces here: ${hosts}`);
    return;
  }
  try {
    const steps = 30;
    const run = join(dir, 'alone');
    const ckpt = (k: number): string => join(dir, `alone-host${k}`);
    const args = (k: number): string[] => ['train', config, '--nnodes', '1:2', '--node-rank', String(k), '--nproc', '1', '--master-addr', hosts.addr[0]!,
      '--master-port', '29400', `--train.runDir=${run}`, `--train.steps=${steps}`, '--checkpoint.keep=20', `--checkpoint.dir=${ckpt(k)}`];
    const nodes = [0, 1].map((k) => startNode(hosts, k, args(k)));
    await nodes[0]!.seen(new RegExp(`step +4/${steps}`));
    nodes[1]!.kill();
    rmSync(ckpt(1), { recursive: true, force: true });
    await nodes[1]!.done;
    // Started again at once: node 0 admits no one to the meeting that lost it, so it asks the next,
    // where node 0 runs alone (its ranks on loopback, its heartbeat still at 10.77.0.1).
    const back = startNode(hosts, 1, args(1));
    const [r0, r1] = await Promise.all([nodes[0]!.done, back.done]);
    assert.equal(r0.code, 0, r0.out + r0.err);
    assert.equal(r1.code, 0, r1.out + r1.err);
    const out = r0.out + r0.err;
    assert.match(r0.err, /\[elastic\] lost node 1 \(.*\); continuing on 1 host\(s\), 1 rank\(s\) \(first-meeting nodes 0; node 0 at 127\.0\.0\.1\)/, out);
    assert.match(out, /\[elastic\] lost node 1 .*single replica, accumulate reduceLast; micro-batches raised 1 -> 2 \(6 sample\(s\) each, as on the 2 rank\(s\) the job started with\); resumed from step \d+/, out);
    assert.match(r1.err, /\[elastic\] joined a running job: this host is node 1 of 2/, r1.err);
    const g = /\[elastic\] first-meeting node 1 joined at 10\.77\.0\.2; continuing on 2 host\(s\), 2 rank\(s\) \(first-meeting nodes 0, 1; node 0 at 10\.77\.0\.1\); data parallel 2, .*; resumed from step (\d+)/.exec(out);
    assert.ok(g, `no [elastic] line of rank 0 for the host taken back:\n${out}`);
    const grownAt = Number(g[1]);
    assert.ok(grownAt >= 6 && grownAt < steps && grownAt % 3 === 0, `grown at step ${grownAt}`);
    t.diagnostic(`host 1 taken back at step ${grownAt} by host 0 running alone`);
    assert.deepEqual(readMetrics(join(run, 'metrics.jsonl')).map((r) => r.step), Array.from({ length: steps }, (_, i) => i + 1));
  } finally {
    hosts.drop();
  }
});

test('three hosts on loopback sharing one run directory, --nnodes 2:3: node 0 (the host of rank 0) is killed; the new rank 0 takes over the lock its own job\'s earlier rank 0 left on another host, and the run finishes every step', async (t) => {
  // Each node has a host name of its own (a UTS namespace) on this machine's loopback, so the run
  // directory is shared storage seen from three hosts: the lock the killed rank 0 leaves names
  // another host, which no pid check can reach ([Note: run lock]).
  if (process.getuid?.() !== 0 || spawnSync('unshare', ['--uts', 'true']).status !== 0) {
    t.skip('a host name per node needs root and unshare (util-linux)');
    return;
  }
  const onHost = { exec: (k: number, cmd: string, a: string[]): [string, string[]] => ['unshare', ['--uts', 'sh', '-c', 'hostname "$0" && exec "$@"', `flotilla-test-node${k}`, cmd, ...a]] };
  const steps = 21;
  const run = join(dir, 'lost-master-shared');
  const ckpt = (k: number): string => join(dir, `lost-master-shared-node${k}`);
  const port = await freePort();
  const args = (k: number): string[] => ['train', config, '--nnodes', '2:3', '--node-rank', String(k), '--nproc', '1', '--master-addr', '127.0.0.1',
    '--master-port', String(port), `--train.runDir=${run}`, `--train.steps=${steps}`, '--checkpoint.keep=20', `--checkpoint.dir=${ckpt(k)}`];
  const nodes = [0, 1, 2].map((k) => startNode(onHost, k, args(k)));
  await nodes[0]!.seen(new RegExp(`step +10/${steps}`));
  nodes[0]!.kill();
  await nodes[0]!.done;
  const rs = await Promise.all([1, 2].map((k) => nodes[k]!.done));
  for (const r of rs) assert.equal(r.code, 0, r.out + r.err);
  const out = rs[0]!.out + rs[0]!.err;
  const m = /\[elastic\] lost node 0 .*; resumed from step (\d+)/.exec(out);
  assert.ok(m, `no [elastic] line of the new rank 0:\n${out}`);
  t.diagnostic(`node 0 lost at step 10; the survivors resumed from step ${m[1]} and finished`);
  assert.deepEqual(readMetrics(join(run, 'metrics.jsonl')).map((r) => r.step), Array.from({ length: steps }, (_, i) => i + 1));
  assert.ok(!existsSync(join(run, '.lock')), 'the run directory is still locked');
});

// `flotilla train` across hosts: network namespaces on one bridge (test/helpers/hosts.ts), one rank
// on each. Three hosts train the run a single host trains with --nproc 3, step for step and bit for
// bit, each saving into a directory of its own with a copy of the previous host's files
// ([Note: checkpoint replicas]); a launcher with the wrong job secret is refused before it starts a rank.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { checkCheckpoint } from '../src/checkpoint/checkpoint.js';
import { readMetrics } from '../src/train/metrics.js';
import { flotilla } from './helpers/cli.js';
import { makeHosts } from './helpers/hosts.js';
import { suiteSlots } from './helpers/pool.js';

// Heartbeats here time out in seconds: no other file's launch runs beside this file (test/helpers/pool.ts).
await suiteSlots.holdAll();

const dir = mkdtempSync(join(tmpdir(), 'flotilla-hosts-'));
const config = join(dir, 'tiny.toml');
writeFileSync(config, `# a tiny GPT across hosts
[model]
nLayer = 1
nHead = 2
nEmbd = 32
blockSize = 16
[data]
seqLen = 16
globalBatch = 12
[optim]
lr = 3e-3
minLr = 3e-4
warmupSteps = 2
[train]
steps = 6
evalEvery = 0
[parallel]
backend = "gloo"
[checkpoint]
every = 3
[log]
progress = "plain"
every = 1
`);

const SECRET = 'hosts-test-secret-0123456789abcdef';
/** Short beats so a lost host is found in seconds; the collective timeout stays long. */
const FAST = { FLOTILLA_HEARTBEAT_MS: '300', FLOTILLA_HEARTBEAT_TIMEOUT_MS: '3000', FLOTILLA_KILL_GRACE_MS: '2000', FLOTILLA_JOB_SECRET: SECRET };

test('three hosts, each with its own checkpoint directory: flotilla train --nnodes 3 trains bit for bit as one host with --nproc 3; every file is on two hosts; a wrong secret is refused before any rank starts', async (t) => {
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

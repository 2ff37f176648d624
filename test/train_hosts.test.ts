// `flotilla train` across hosts: network namespaces on one bridge (test/helpers/hosts.ts), one rank
// on each. Two hosts train the run a single host trains with --nproc 2, step for step and bit for
// bit; a launcher with the wrong job secret is refused before it starts a rank.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
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
globalBatch = 8
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

test('two hosts: flotilla train --nnodes 2 trains bit for bit as one host with --nproc 2; a wrong secret is refused before any rank starts', async (t) => {
  const hosts = makeHosts(2);
  if (typeof hosts === 'string') {
    t.skip(`cannot make network namespaces here: ${hosts}`);
    return;
  }
  try {
    const run = join(dir, 'two-hosts');
    const node = (k: number, env: Record<string, string> = {}) => flotilla(
      ['train', config, '--nnodes', '2', '--node-rank', String(k), '--nproc', '1', '--master-addr', hosts.addr[0]!, '--master-port', '29400', `--train.runDir=${run}`],
      { via: (c, a) => hosts.exec(k, c, a), env: { ...FAST, ...env }, timeoutMs: 120_000 },
    );
    const n0 = node(0);
    // Node 1 with another secret: node 0's heartbeat never admits it, and it gives up (here after 4 s).
    const wrong = await node(1, { FLOTILLA_JOB_SECRET: 'not-the-job-secret-0123456789', FLOTILLA_TIMEOUT_MS: '4000' });
    assert.notEqual(wrong.code, 0, wrong.out + wrong.err);
    assert.match(wrong.err, /no node heartbeat answered at 10\.77\.0\.1:\d+ within 4000 ms \(is node 0's launcher running, with the same FLOTILLA_JOB_SECRET\?\)/, wrong.err);
    assert.doesNotMatch(wrong.out + wrong.err, /\[rank \d\]/, 'a refused launcher started a rank');
    const n1 = node(1);
    const [r0, r1] = await Promise.all([n0, n1]);
    assert.equal(r0.code, 0, r0.out + r0.err);
    assert.equal(r1.code, 0, r1.out + r1.err);
    // Rank 0 bound Gloo on its host's bridge interface (the header is rank 0's).
    assert.match(r0.out, new RegExp(`c10d Gloo over TCP on ${hosts.ns[0]}v 10\\.77\\.0\\.1 .*, 2 ranks`), r0.out);
    assert.ok(existsSync(join(run, 'checkpoints', 'step-000006', 'meta.json')), 'the two-host run saved no final checkpoint');

    const ref = await flotilla(['train', config, '--nproc', '2', `--train.runDir=${join(dir, 'one-host')}`], { timeoutMs: 120_000 });
    assert.equal(ref.code, 0, ref.out + ref.err);
    const want = readMetrics(join(dir, 'one-host', 'metrics.jsonl'));
    const got = readMetrics(join(run, 'metrics.jsonl'));
    assert.equal(got.length, 6);
    assert.deepEqual(got.map((m) => [m.step, m.loss, m.gradNorm]), want.map((m) => [m.step, m.loss, m.gradNorm]));
  } finally {
    hosts.drop();
  }
});

// A real Slurm (test/helpers/slurm.ts), started for this file: two nodes in network namespaces of
// their own, and one node on loopback. A batch job's `srun -N2` runs a task on each node (its node
// id, hostname and address are the node's); `srun -n 2 flotilla train` on one node and
// `srun -N2 -n2 flotilla train` across the two (meeting at the first node, by name) train as two
// ranks and log every step; `scontrol requeue` of a running job runs it again with
// SLURM_RESTART_COUNT=1; after drop() no daemon, job process or namespace of either cluster is left.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { randomBytes } from 'node:crypto';
import { tinyGptToml } from './fixtures/tiny_gpt.js';
import { readMetrics } from '../src/train/metrics.js';
import { freePort } from '../src/launch/launcher.js';
import { BIN } from './helpers/cli.js';
import { suiteSlots } from './helpers/pool.js';
import { startSlurm, type SlurmCluster } from './helpers/slurm.js';

const [two, one] = await Promise.all([startSlurm({ nodes: 2, namespaces: true }), startSlurm({ nodes: 1 })]);
const clusters = [two, one].filter((c): c is SlurmCluster => typeof c !== 'string');
after(() => { for (const c of clusters) c.drop(); });

/** The cluster, or the test skipped with the reason it could not start. */
function cluster(c: SlurmCluster | string, t: { skip(why: string): void }): SlurmCluster | undefined {
  if (typeof c !== 'string') return c;
  t.skip(`no Slurm cluster here: ${c}`);
  return undefined;
}

const NODE = process.execPath;
const port = await freePort();

test('two nodes in namespaces: srun -N2 --ntasks-per-node=1 runs one task on each node, each seeing its own node id, hostname and address', async (t) => {
  const c = cluster(two, t);
  if (!c) return;
  const report = join(c.dir, 'report.js');
  writeFileSync(report, `const os = require('os');
const addrs = Object.values(os.networkInterfaces()).flat().filter((a) => a.family === 'IPv4' && !a.internal).map((a) => a.address);
console.log(JSON.stringify({ nodeId: process.env.SLURM_NODEID, procId: process.env.SLURM_PROCID, nodeList: process.env.SLURM_JOB_NODELIST, host: os.hostname(), addrs }));\n`);
  const id = c.submit(`srun -N2 --ntasks-per-node=1 ${NODE} ${report}\n`, ['-N2']);
  const job = await c.waitJob(id, 30_000);
  assert.equal(job.state, 'COMPLETED', c.output(id) + c.logs());
  const tasks = c.output(id).trim().split('\n').map((l) => JSON.parse(l) as { nodeId: string; procId: string; nodeList: string; host: string; addrs: string[] });
  tasks.sort((a, b) => Number(a.nodeId) - Number(b.nodeId));
  assert.deepEqual(tasks, c.nodes.map((n, k) => ({ nodeId: String(k), procId: String(k), nodeList: 'n[1-2]', host: n.name, addrs: [n.addr] })));
});

test('scontrol requeue of a running batch job runs it again, with SLURM_RESTART_COUNT=1', async (t) => {
  const c = cluster(two, t);
  if (!c) return;
  const marker = join(c.dir, 'requeue-runs');
  // The first run waits to be requeued; the second finishes.
  const id = c.submit(`echo "run \${SLURM_RESTART_COUNT:-0} on $(hostname)" >> ${marker}
if [ "\${SLURM_RESTART_COUNT:-0}" = 0 ]; then sleep 120; fi\n`);
  await c.waitJob(id, 30_000, (j) => j.state === 'RUNNING' && existsSync(marker));
  c.run('scontrol', ['requeue', String(id)]);
  const job = await c.waitJob(id, 60_000);
  assert.equal(job.state, 'COMPLETED', c.output(id) + c.logs());
  assert.equal(job.restarts, 1);
  assert.match(readFileSync(marker, 'utf8'), /^run 0 on n\d\nrun 1 on n\d\n$/);
});

test('flotilla train under srun, one task per rank: srun -n 2 on the loopback node, and srun -N2 -n2 across the two namespaced nodes (rank 0 on the first node, MASTER_ADDR its name from scontrol show hostnames); both train the tiny GPT and log every step', async (t) => {
  const steps = 4;
  const train = async (c: SlurmCluster, name: string, body: (run: string) => string, args: string[]): Promise<void> => {
    const config = join(c.dir, `${name}.toml`);
    writeFileSync(config, tinyGptToml({ train: { steps, evalEvery: 0 }, parallel: { backend: 'gloo' }, log: { progress: 'plain', every: 1 } }));
    const runDir = join(c.dir, name);
    const slot = await suiteSlots.acquire();
    let id: number;
    try {
      id = c.submit(`export FLOTILLA_REPORT=0\n${body(`${NODE} ${BIN} train ${config} --train.runDir=${runDir}`)}\n`, args);
      const job = await c.waitJob(id, 180_000);
      assert.equal(job.state, 'COMPLETED', `${name}: ${c.output(id)}${c.logs()}`);
    } finally {
      suiteSlots.release(slot);
    }
    assert.deepEqual(readMetrics(join(runDir, 'metrics.jsonl')).map((m) => m.step), Array.from({ length: steps }, (_, i) => i + 1), name);
    if (c === two) assert.match(c.output(id), new RegExp(`c10d Gloo over TCP on \\S+ ${c.nodes[0]!.addr.replaceAll('.', '\\.')} .*, 2 ranks`), c.output(id));
  };
  const runs: Promise<void>[] = [];
  if (typeof one === 'string') t.diagnostic(`no one-node Slurm cluster here: ${one}`);
  // On one machine the default master address (127.0.0.1) is right; the port is one free here.
  else runs.push(train(one, 'one-node', (cmd) => `export MASTER_PORT=${port}\nsrun -n 2 ${cmd}`, ['-n2']));
  if (typeof two === 'string') t.diagnostic(`no two-node Slurm cluster here: ${two}`);
  // Rank 0 runs on the job's first node: the master address is that node's name.
  else runs.push(train(two, 'two-nodes', (cmd) => `export FLOTILLA_JOB_SECRET=${randomBytes(16).toString('hex')}
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) MASTER_PORT=29500
srun -N2 -n2 --ntasks-per-node=1 ${cmd}`, ['-N2', '-n2']));
  if (runs.length === 0) {
    t.skip(`no Slurm cluster here: ${String(one)}`);
    return;
  }
  await Promise.all(runs);
});

test('after drop() nothing of either cluster is left: no slurmctld, slurmd, munged, job process or namespace', (t) => {
  if (clusters.length === 0) {
    t.skip(`no Slurm cluster here: ${String(two)}`);
    return;
  }
  for (const c of clusters) {
    const before = c.remains();
    assert.ok(before.some((r) => /slurmctld/.test(r)) && before.some((r) => /slurmd /.test(r)), `a running cluster shows its daemons: ${before.join('; ')}`);
    c.drop();
    assert.deepEqual(c.remains(), []);
  }
});

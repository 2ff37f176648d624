// Slurm without a cluster: the hostlist syntax against what `scontrol show hostnames` prints, the
// job's port, where `flotilla train` stands in an allocation (fake environments), the command lines
// that disagree with it, the [slurm] config rules, and `flotilla sbatch` with stub sinfo and sbatch.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { chmodSync, mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { expandHostlist, slurmPort, slurmRestarted } from '../src/distributed/slurm_vars.js';
import { readLaunchEnv, LaunchEnvError } from '../src/distributed/env.js';
import { slurmNodeTask } from '../src/launch/slurm.js';
import { parseSbatchArgs, partitionNodes, sbatchCommand, sbatchScript } from '../src/cli/sbatch.js';
import { parseConfig } from '../src/config/index.js';
import { parseTrainArgs } from '../src/cli/train_args.js';
import { replicasOf, StopRequest } from '../src/train/checkpointing.js';

test('hostlists expand as `scontrol show hostnames` prints them (Slurm 23.11 outputs)', () => {
  // Each pair: the list, and scontrol's output for it.
  const cases: [string, string][] = [
    ['node[01-03,07],gpu-a[1-2]', 'node01 node02 node03 node07 gpu-a1 gpu-a2'],
    ['r[1-2]-n[08-10]', 'r1-n08 r1-n09 r1-n10 r2-n08 r2-n09 r2-n10'],
    ['n[9-11],x[001-2]', 'n9 n10 n11 x001 x002'],
    ['n[3,1]', 'n3 n1'],
    ['n[1-2]-[5-6]', 'n1-5 n1-6 n2-5 n2-6'],
    ['n[010-012]', 'n010 n011 n012'],
    ['n[9-010]', 'n9 n10'],
    ['n[1-2],m', 'n1 n2 m'],
    ['host', 'host'],
  ];
  for (const [list, want] of cases) assert.deepEqual(expandHostlist(list), want.split(' '), list);
  assert.throws(() => expandHostlist('n[2-1]'), /runs backwards/);
  assert.throws(() => expandHostlist('n[1-2'), /unbalanced/);
  assert.throws(() => expandHostlist('n[a]'), /not a number or a range/);
});

test('the job port: 20000 + 10 x (job id mod 1000), below the ephemeral ports', () => {
  assert.equal(slurmPort(4242), 22420);
  assert.equal(slurmPort(1000), 20000);
  assert.equal(slurmPort(999), 29990);
  assert.ok(slurmPort(123999) + 9 < 32768);
});

const alloc = (extra: Record<string, string> = {}): Record<string, string> => ({
  SLURM_JOB_ID: '4242', SLURM_PROCID: '1', SLURM_NTASKS: '3', SLURM_NNODES: '3', SLURM_NODEID: '1', SLURM_LOCALID: '0',
  SLURM_JOB_NODELIST: 'gpu[07-08],cpu3', ...extra,
});

test('one task per node: nodes, node index, master address and port come from the allocation', () => {
  assert.deepEqual(slurmNodeTask(alloc(), 4, undefined), { hosts: { nnodes: 3, nodeRank: 1, masterAddr: 'gpu07', masterPort: 22420 } });
  // SLURM_JOB_NUM_NODES when SLURM_NNODES is absent; MASTER_PORT wins over the derived port.
  const { SLURM_NNODES: _, ...noNnodes } = alloc({ SLURM_JOB_NUM_NODES: '3', MASTER_PORT: '23000' });
  assert.deepEqual(slurmNodeTask(noNnodes, 2, undefined)?.hosts, { nnodes: 3, nodeRank: 1, masterAddr: 'gpu07', masterPort: 23000 });
  // The command line may repeat the allocation, or ask for MIN:MAX with MAX its node count.
  assert.deepEqual(slurmNodeTask(alloc(), 4, { nnodes: 3, minNodes: 2, nodeRank: 1 })?.hosts, { nnodes: 3, minNodes: 2, nodeRank: 1, masterAddr: 'gpu07', masterPort: 22420 });
  // One node: the launcher alone (no hosts). Not this case: outside Slurm, one task per rank, no --nproc.
  assert.deepEqual(slurmNodeTask(alloc({ SLURM_NTASKS: '1', SLURM_NNODES: '1', SLURM_NODEID: '0', SLURM_PROCID: '0' }), 2, undefined), {});
  assert.equal(slurmNodeTask({}, 2, undefined), undefined);
  assert.equal(slurmNodeTask(alloc({ SLURM_NTASKS: '6' }), 2, undefined), undefined);
  assert.equal(slurmNodeTask(alloc(), undefined, undefined), undefined);
});

test('elastic under Slurm: --nnodes MIN:MAX needs no --node-rank in an allocation (SLURM_NODEID), and MIN reaches the launcher', () => {
  const saved = process.env.SLURM_NODEID;
  process.env.SLURM_NODEID = '1';
  try {
    const a = parseTrainArgs(['job.toml', '--nnodes', '2:3', '--nproc', '2']);
    assert.deepEqual(a.hosts, { nnodes: 3, minNodes: 2, nodeRank: 1 });
    assert.deepEqual(slurmNodeTask(alloc(), a.nproc, a.hosts)?.hosts, { nnodes: 3, minNodes: 2, nodeRank: 1, masterAddr: 'gpu07', masterPort: 22420 });
  } finally {
    if (saved === undefined) delete process.env.SLURM_NODEID;
    else process.env.SLURM_NODEID = saved;
  }
  assert.throws(() => parseTrainArgs(['job.toml', '--nnodes', '2:3']), /needs --node-rank R/);
});

test('a command line that disagrees with the allocation is one error naming the fix', () => {
  assert.throws(() => slurmNodeTask(alloc(), 2, { nnodes: 4, nodeRank: 1 }), (e: Error) => e instanceof LaunchEnvError && /--nnodes 4 inside a Slurm allocation of 3 nodes \(job 4242\): drop --nnodes/.test(e.message));
  assert.throws(() => slurmNodeTask(alloc(), 2, { nnodes: 3, nodeRank: 0 }), /--node-rank 0 inside a Slurm allocation of 3 nodes .* Slurm numbers 1 \(SLURM_NODEID\): drop --node-rank/);
  assert.throws(() => slurmNodeTask(alloc(), 2, { nnodes: 3, nodeRank: 1, masterAddr: 'cpu3' }), /--master-addr cpu3 .* whose first node is gpu07/);
  assert.throws(() => slurmNodeTask(alloc({ SLURM_JOB_NODELIST: 'gpu[07-' }), 2, undefined), /SLURM_JOB_NODELIST: .*unbalanced/);
});

test('one task per rank on several nodes: env.ts meets at the first host on the job port; on one node at loopback', () => {
  const e = readLaunchEnv(alloc({ SLURM_NTASKS: '6', SLURM_TASKS_PER_NODE: '2(x3)', SLURM_LOCALID: '1' }));
  assert.deepEqual(e, { rank: 1, worldSize: 6, localRank: 1, localWorldSize: 2, masterAddr: 'gpu07', masterPort: 22420, source: 'srun' });
  const set = readLaunchEnv(alloc({ SLURM_NTASKS: '6', MASTER_ADDR: '10.1.1.1', MASTER_PORT: '1234' }));
  assert.deepEqual([set.masterAddr, set.masterPort], ['10.1.1.1', 1234]);
  const one = readLaunchEnv(alloc({ SLURM_NNODES: '1', SLURM_NTASKS: '2', SLURM_NODEID: '0' }));
  assert.deepEqual([one.masterAddr, one.masterPort], ['127.0.0.1', 29500]);
  assert.equal(slurmRestarted({ SLURM_RESTART_COUNT: '1' }), true);
  assert.equal(slurmRestarted({ SLURM_RESTART_COUNT: '0' }), false);
});

test('[slurm] requeue = true without checkpoint.dir is one config error', () => {
  assert.throws(() => parseConfig('[slurm]\nrequeue = true\n', [], 'job.toml'), /slurm\.requeue = true .* set checkpoint\.dir/);
  assert.equal(parseConfig('[slurm]\nrequeue = true\n[checkpoint]\ndir = "/shared/ckpt"\n', [], 'job.toml').slurm.requeue, true);
});

/** A directory with executable stubs, first on PATH while `fn` runs. */
async function withStubs<T>(stubs: Record<string, string>, fn: (dir: string) => Promise<T> | T): Promise<T> {
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-slurm-stubs-'));
  for (const [name, body] of Object.entries(stubs)) {
    writeFileSync(join(dir, name), `#!/bin/sh\n${body}\n`);
    chmodSync(join(dir, name), 0o755);
  }
  const path = process.env.PATH;
  process.env.PATH = `${dir}:${path}`;
  try {
    return await fn(dir);
  } finally {
    process.env.PATH = path;
  }
}

async function captured(fn: () => Promise<number>): Promise<{ code: number; out: string }> {
  const write = process.stdout.write;
  let out = '';
  process.stdout.write = ((s: string) => ((out += s), true)) as typeof process.stdout.write;
  try {
    return { code: await fn(), out };
  } finally {
    process.stdout.write = write;
  }
}

test('in a Slurm job the nodes share one checkpoint directory: [checkpoint] replicas = -1 is 0 there (and with [slurm] requeue), 1 across hosts elsewhere', () => {
  const cfg = (extra = ''): ReturnType<typeof parseConfig> => parseConfig(`[checkpoint]\ndir = "/shared/ckpt"\n${extra}`, [], 'job.toml');
  const saved = process.env.SLURM_JOB_ID;
  try {
    delete process.env.SLURM_JOB_ID;
    assert.equal(replicasOf(cfg(), 2, 1), 1, 'two hosts outside Slurm: each its own directory');
    assert.equal(replicasOf(cfg('[slurm]\nrequeue = true\n'), 2, 1), 0);
    assert.equal(replicasOf(cfg('replicas = 1\n'), 2, 1), 1);
    process.env.SLURM_JOB_ID = '77';
    assert.equal(replicasOf(cfg(), 2, 1), 0, 'two nodes of a Slurm job');
    assert.equal(replicasOf(cfg(), 2, 2), 0);
  } finally {
    if (saved === undefined) delete process.env.SLURM_JOB_ID;
    else process.env.SLURM_JOB_ID = saved;
  }
});

test('in a Slurm job a SIGUSR1 after the run (a time-limit warning after the last step) leaves the process alone', async () => {
  const saved = process.env.SLURM_JOB_ID;
  process.env.SLURM_JOB_ID = '77';
  try {
    const lines: string[] = [];
    const stop = new StopRequest((l) => lines.push(l));
    process.kill(process.pid, 'SIGUSR1');
    // The signal arrives through the event loop: wait for it (seconds under a loaded machine).
    for (let waited = 0; lines.length === 0 && waited < 10_000; waited += 20) await new Promise((r) => setTimeout(r, 20));
    assert.deepEqual(lines, ['[stop] SIGUSR1: stopping after this step with a checkpoint']);
    stop.dispose();
    // Without a handler SIGUSR1 would end this process (the test file would fail).
    process.kill(process.pid, 'SIGUSR1');
    await new Promise((r) => setTimeout(r, 50));
    assert.equal(lines.length, 1);
  } finally {
    if (saved === undefined) delete process.env.SLURM_JOB_ID;
    else process.env.SLURM_JOB_ID = saved;
  }
});

test('flotilla sbatch: the batch script, the partition check against sinfo, and --submit through sbatch', async () => {
  const a = parseSbatchArgs(['job.toml', '--nodes', '2', '--nproc=4', '--time', '02:00:00', '--partition', 'gpu', '--train.steps=9']);
  const s = sbatchScript(a, { requeue: true, name: 'tiny', flotilla: ['/usr/bin/node', '/opt/flotilla/bin/flotilla.js'], cwd: '/home/u/work dir' });
  for (const line of ['#SBATCH --nodes=2', '#SBATCH --ntasks-per-node=1', '#SBATCH --time=02:00:00', '#SBATCH --partition=gpu', '#SBATCH --signal=USR1@90', '#SBATCH --requeue', '#SBATCH --open-mode=append', '#SBATCH --job-name=tiny', "cd '/home/u/work dir'"]) {
    assert.ok(s.split('\n').includes(line), `${line} in\n${s}`);
  }
  assert.match(s, /^export FLOTILLA_JOB_SECRET=/m);
  assert.match(s, /^srun \/usr\/bin\/node \/opt\/flotilla\/bin\/flotilla\.js train job\.toml --nproc 4 --train\.steps=9$/m);
  assert.ok(!sbatchScript(a, { requeue: false, name: 'tiny', flotilla: ['flotilla'], cwd: '/' }).includes('--requeue'));
  assert.throws(() => parseSbatchArgs(['job.toml', '--nproc', '2']), /give --nodes/);

  const dir = mkdtempSync(join(tmpdir(), 'flotilla-sbatch-'));
  const cfg = join(dir, 'job.toml');
  writeFileSync(cfg, '[train]\nname = "tiny"\n');
  // sinfo: one line per partition and state; the default partition ends in '*'.
  const sinfo = 'printf "debug* 1\\ngpu 2\\ngpu 1\\n" | if [ "$4" = "-p" ]; then grep "^$5 "; else cat; fi';
  await withStubs({ sinfo, sbatch: `cat > "$(dirname "$0")/submitted"; echo "$@" > "$(dirname "$0")/args"; echo "77;cluster"` }, async (stubs) => {
    assert.deepEqual(partitionNodes('gpu'), { name: 'gpu', nodes: 3 });
    assert.deepEqual(partitionNodes(undefined), { name: 'debug', nodes: 1 });
    await assert.rejects(sbatchCommand([cfg, '--nodes', '4', '--nproc', '2', '--partition', 'gpu']), /--nodes 4 is more than partition gpu has \(3 nodes\)/);
    await assert.rejects(sbatchCommand([cfg, '--nodes', '2', '--nproc', '2']), /more than partition debug has \(1 node\); ask for at most 1, or name a larger partition/);
    const r = await captured(() => sbatchCommand([cfg, '--nodes', '3', '--nproc', '2', '--partition', 'gpu', '--submit']));
    assert.deepEqual(r, { code: 0, out: 'submitted batch job 77\n' });
    assert.equal(readFileSync(join(stubs, 'args'), 'utf8').trim(), '--parsable');
    assert.match(readFileSync(join(stubs, 'submitted'), 'utf8'), /#SBATCH --nodes=3\n[^]*\nsrun .* train .*job\.toml --nproc 2\n/);
  });
});

// Real batch jobs on a real Slurm (test/helpers/slurm.ts: two nodes in network namespaces), their
// scripts the ones `flotilla sbatch` prints. The harness's sbatch adds --chdir and --output on the
// command line (they win over the script's #SBATCH lines, so every job's output is the cluster's
// slurm-ID.out); the test cluster has one partition without a time limit, so no --time or
// --partition is given. What a case changes in the printed script is said where it does.
//   - A 2-node job (one task per node, one rank each) finishes, every step once, and trains bit for
//     bit as one host with --nproc 2.
//   - `scancel --signal=USR1 JOBID` (the steps' tasks, as --signal=USR1@90 does at the time limit)
//     with [slurm] requeue = true: the job saves, requeues itself, and the requeued job resumes from
//     that checkpoint in the same run directory and finishes as the uninterrupted run.
//   - `srun --no-kill ... --nnodes 1:2`: the second node's tasks are killed, the first carries on alone
//     and finishes every step.
//   - More nodes than the partition has is refused by `flotilla sbatch`; `--nnodes 3` inside the
//     2-node allocation is the job's error.
import { describe, test, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { tinyGptToml } from './fixtures/tiny_gpt.js';
import { readMetrics } from '../src/train/metrics.js';
import { BIN, flotilla } from './helpers/cli.js';
import { readRecord } from './helpers/ckpt_runs.js';
import { suiteSlots } from './helpers/pool.js';
import { startSlurm, type SlurmCluster } from './helpers/slurm.js';

// 4 CPUs a node: the jobs of both tests (1 CPU a node each) run at once.
const started = await startSlurm({ nodes: 2, namespaces: true, cpus: 4 });
after(() => { if (typeof started !== 'string') started.drop(); });

/** The cluster, or the test skipped with the reason it could not start. */
function cluster(t: { skip(why: string): void }): SlurmCluster | undefined {
  if (typeof started !== 'string') return started;
  t.skip(`no Slurm cluster here: ${started}`);
  return undefined;
}

// Steps of ~15 ms: enough that the signal and the kill (sent at step 3-4) land well before the end.
const STEPS = 120;
const toml = tinyGptToml({
  train: { steps: STEPS, evalEvery: 0 }, optim: { schedule: 'constant' }, parallel: { backend: 'gloo' },
  checkpoint: { every: 0 }, log: { progress: 'plain', every: 1 },
}, 'a tiny GPT as a Slurm batch job');

if (typeof started !== 'string') {
  // Jobs get the client's environment (sbatch exports it): no run report.
  started.env.FLOTILLA_REPORT = '0';
}

/** `flotilla sbatch ARGS` as a user runs it on the cluster's login host (host 0, where sinfo answers). */
function sbatchCli(c: SlurmCluster, args: string[]): { code: number | null; out: string; err: string } {
  const [cmd, argv] = c.cmd(process.execPath, [BIN, 'sbatch', ...args]);
  const r = spawnSync(cmd, argv, { cwd: c.dir, env: c.env, encoding: 'utf8', timeout: 60_000 });
  return { code: r.status, out: r.stdout, err: r.stderr };
}

/** A job's run directory, config and the script `flotilla sbatch` prints for it. */
function jobScript(c: SlurmCluster, name: string, over: string[] = []): { dir: string; script: string } {
  const dir = join(c.dir, name);
  mkdirSync(dir, { recursive: true });
  const config = join(dir, 'job.toml');
  writeFileSync(config, toml);
  const r = sbatchCli(c, [config, '--nodes', '2', '--nproc', '1', `--train.runDir=${join(dir, 'run')}`, ...over]);
  assert.equal(r.code, 0, r.out + r.err);
  assert.match(r.out, /^srun \S+ \S+ train /m, r.out);
  return { dir, script: r.out };
}

/** The script with `extra` after its srun line's command (test-only arguments). */
const withArgs = (script: string, extra: string, srunOpts = ''): string =>
  script.replace(/^srun (.*)$/m, (_, rest: string) => `srun ${srunOpts}${rest} ${extra}`);

const rows = (dir: string): number => {
  const m = join(dir, 'run', 'metrics.jsonl');
  return existsSync(m) ? readFileSync(m, 'utf8').trim().split('\n').filter(Boolean).length : 0;
};

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

async function until(what: string, ok: () => boolean, ms: number, more: () => string): Promise<void> {
  const end = Date.now() + ms;
  while (!ok()) {
    if (Date.now() > end) throw new Error(`${what} did not happen within ${ms} ms\n${more()}`);
    await sleep(20);
  }
}

const LOST_STEPS = 120;
const allSteps = Array.from({ length: STEPS }, (_, i) => i + 1);

// The two tests' jobs share the cluster and run side by side.
describe('flotilla sbatch jobs on a 2-node Slurm', { concurrency: true }, () => {
  test('real batch jobs from flotilla sbatch: a 2-node job trains bit for bit as one host; USR1 (scancel --signal=USR1) saves, requeues, and the requeued job resumes and finishes as the uninterrupted run; more nodes than the partition has is refused', async (t) => {
    const c = cluster(t);
    if (!c) return;
    const slot = await suiteSlots.acquire();
    try {
      // 4. More nodes than the partition has: refused before anything is submitted.
      {
        const config = join(c.dir, 'tiny.toml');
        writeFileSync(config, toml);
        const r = sbatchCli(c, [config, '--nodes', '3', '--nproc', '1', '--submit']);
        assert.equal(r.code, 2, r.out + r.err);
        assert.match(r.err, /sbatch: --nodes 3 is more than partition main has \(2 nodes\); ask for at most 2, or name a larger partition with --partition/, r.err);
        assert.doesNotMatch(r.out, /submitted/, 'nothing was submitted');
      }

      // The reference: one host, --nproc 2 (the same world of two ranks).
      const refDir = join(c.dir, 'one-host');
      const ref = flotilla(['train', join(c.dir, 'tiny.toml'), '--nproc', '2', `--train.runDir=${join(refDir, 'run')}`, '--record', join(refDir, 'record')]);

      // 1. The plain 2-node job; `--record` (a test hook: every rank's final parameters) is added.
      const plain = jobScript(c, 'plain');
      const plainId = c.submit(withArgs(plain.script, `--record ${join(plain.dir, 'record')}`));

      // 2. The same job with [slurm] requeue = true (its checkpoint.dir shared by the nodes, as on a cluster).
      const rq = jobScript(c, 'requeue', ['--slurm.requeue=true', `--checkpoint.dir=${join(c.dir, 'requeue', 'ckpt')}`]);
      assert.match(rq.script, /^#SBATCH --requeue$/m);
      assert.match(rq.script, /^#SBATCH --signal=USR1@90$/m);
      const rqId = c.submit(withArgs(rq.script, `--record ${join(rq.dir, 'record')}`));
      await until('3 steps of the requeue job', () => rows(rq.dir) >= 3, 120_000, () => c.output(rqId) + c.logs());
      // What --signal=USR1@90 does at the time limit: USR1 to every task of the job's steps.
      c.run('scancel', ['--signal=USR1', String(rqId)]);

      const [plainJob, rqJob, refRun] = await Promise.all([c.waitJob(plainId, 240_000), c.waitJob(rqId, 240_000), ref]);
      assert.equal(refRun.code, 0, refRun.out + refRun.err);
      const want = readMetrics(join(refDir, 'run', 'metrics.jsonl'));
      const wantParams = readRecord(join(refDir, 'record'));
      assert.deepEqual(want.map((m) => m.step), allSteps);

      assert.equal(plainJob.state, 'COMPLETED', c.output(plainId) + c.logs());
      assert.match(c.output(plainId), new RegExp(`c10d Gloo over TCP on \\S+ ${c.nodes[0]!.addr.replaceAll('.', '\\.')} .*, 2 ranks`), c.output(plainId));
      const out = c.output(rqId);
      assert.equal(rqJob.state, 'COMPLETED', out + c.logs());
      assert.equal(rqJob.restarts, 1, out);
      for (const [name, dir] of [['plain', plain.dir], ['requeue', rq.dir]] as const) {
        const got = readMetrics(join(dir, 'run', 'metrics.jsonl'));
        assert.deepEqual(got.map((m) => m.step), allSteps, `${name}: every step once\n${c.output(name === 'plain' ? plainId : rqId)}`);
        assert.deepEqual(got.map((m) => [m.loss, m.gradNorm]), want.map((m) => [m.loss, m.gradNorm]), `${name}: the losses of one host`);
        const params = readRecord(join(dir, 'record'));
        assert.deepEqual([...params.keys()].sort(), [...wantParams.keys()].sort());
        for (const [p, v] of wantParams) assert.deepEqual(params.get(p), v, `${name}: ${p}`);
      }

      const saved = Number(/\[stop\] stopped after step (\d+) of \d+/.exec(out)?.[1] ?? NaN);
      assert.ok(saved >= 3 && saved < STEPS, `saved at step ${saved}\n${out}`);
      assert.match(out, new RegExp(`\\[slurm\\] requeued job ${rqId}\\b`), out);
      assert.match(out, new RegExp(`\\[resume\\] resumed from step ${saved}\\b`), out);
    } finally {
      suiteSlots.release(slot);
    }
  });

  test('a lost node: srun --no-kill with --nnodes 1:2, the second node\'s tasks killed; the first carries on and finishes; --nnodes 3 in a 2-node allocation is the job\'s error', async (t) => {
    const c = cluster(t);
    if (!c) return;
    const slot = await suiteSlots.acquire();
    try {
      // A wrong node count inside the allocation: the job's own error.
      const bad = jobScript(c, 'three');
      const badId = c.submit(withArgs(bad.script, '--nnodes 3'));

      // Long enough to be running when its node is lost; checkpoints every 3 steps to resume from; --no-kill and --nnodes 1:2 added to the srun line.
      const lost = jobScript(c, 'lost', [`--train.steps=${LOST_STEPS}`, '--checkpoint.every=3', '--checkpoint.keep=20']);
      const id = c.submit(withArgs(lost.script, '--nnodes 1:2', '--no-kill '));
      await until('4 steps of the job', () => rows(lost.dir) >= 4, 120_000, () => c.output(id) + c.logs());
      // Every node process of this job on the second node (its flotilla launcher and rank), at once.
      const ns = c.hosts!.ns[2]!;
      const pids = (spawnSync('ip', ['netns', 'pids', ns], { encoding: 'utf8' }).stdout ?? '').split('\n').filter((p) => /^\d+$/.test(p))
        .filter((p) => { try { return readFileSync(`/proc/${p}/cmdline`, 'utf8').startsWith(`${process.execPath}\0`) && readFileSync(`/proc/${p}/environ`).includes(`SLURM_JOB_ID=${id}\0`); } catch { return false; } });
      assert.ok(pids.length >= 2, `the second node runs its launcher and rank: ${pids.join(' ')}\n${c.output(id)}`);
      for (const p of pids) process.kill(Number(p), 'SIGKILL');

      const [job, badJob] = await Promise.all([c.waitJob(id, 240_000), c.waitJob(badId, 120_000)]);
      const out = c.output(id);
      assert.deepEqual(readMetrics(join(lost.dir, 'run', 'metrics.jsonl')).map((m) => m.step), Array.from({ length: LOST_STEPS }, (_, i) => i + 1), out);
      assert.match(out, /\[elastic\] lost node 1 \(.*\); continuing on 1 host\(s\), 1 rank\(s\)/, out);
      assert.match(out, /\[elastic\] .*resumed from step \d+/, out);
      // The survivor's task ends 0; srun (and so the job) reports the killed node's task.
      assert.doesNotMatch(out, /n1: task 0: Exited/, out);
      assert.match(out, /n2: task 1: (Exited|Killed)/, out);
      t.diagnostic(`the lost-node job ended ${job.state} (${job.exitCode})`);

      assert.equal(badJob.state, 'FAILED', c.output(badId));
      assert.match(c.output(badId), /train: --nnodes 3 inside a Slurm allocation of 2 nodes \(job \d+\): drop --nnodes \(flotilla takes the allocation's nodes\), or give MIN:2 to carry on without a lost node/, c.output(badId));
      assert.ok(!existsSync(join(bad.dir, 'run')), 'no run directory for a refused job');
    } finally {
      suiteSlots.release(slot);
    }
  });
});

// A Slurm job's stops with real processes and Slurm's variables (no cluster): `flotilla train
// --nproc 2` as the one task of a one-node allocation, [slurm] requeue = true, and a stub scontrol
// on PATH that records its arguments. SIGUSR1 to one rank saves at the end of a step every rank
// agrees on and requeues the job; the same command started again as the requeued job
// (SLURM_RESTART_COUNT = 1) resumes from it, and a SIGTERM (scancel) to its launcher saves without
// a requeue; the third start finishes. Every step is in metrics.jsonl once and the final parameters
// are the uninterrupted run's, itself run as two node tasks of a 2-node allocation.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { chmodSync, existsSync, mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import type { ChildProcess } from 'node:child_process';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { readMetrics } from '../src/train/metrics.js';
import { CONFIG, flotilla, rankPids, readRecord, work, type Flotilla } from './helpers/ckpt_runs.js';
import { pool } from './helpers/pool.js';

// Every launch holds one of the suite's launch slots (the reference runs beside the first stop).
const launch = pool();

const STEPS = 20;
const stubs = mkdtempSync(join(tmpdir(), 'flotilla-scontrol-'));
const calls = join(stubs, 'calls');
writeFileSync(join(stubs, 'scontrol'), `#!/bin/sh\necho "$@" >> ${calls}\n`);
chmodSync(join(stubs, 'scontrol'), 0o755);

/** One task on one node of job 4242 (what srun sets), with the stub scontrol first on PATH. */
const slurmEnv = (restarts: number): Record<string, string> => ({
  SLURM_JOB_ID: '4242', SLURM_PROCID: '0', SLURM_NTASKS: '1', SLURM_NNODES: '1', SLURM_NODEID: '0', SLURM_LOCALID: '0',
  SLURM_JOB_NODELIST: 'localhost', SLURM_RESTART_COUNT: String(restarts), PATH: `${stubs}:${process.env.PATH}`,
});

const common = (dir: string, record: string): string[] => [
  'train', CONFIG, `--train.runDir=${dir}`, '--nproc', '2', `--train.steps=${STEPS}`, '--optim.schedule=constant',
  '--checkpoint.every=0', `--checkpoint.dir=${join(dir, 'ckpt')}`, '--slurm.requeue=true', '--record', record,
];

/** Sends `signal` to what `whom` picks once metrics.jsonl holds `rows` steps. */
function signalAt(dir: string, rows: number, signal: NodeJS.Signals, whom: (child: ChildProcess) => number | undefined): { sent: boolean; onStart: (c: ChildProcess) => void } {
  const s = {
    sent: false,
    onStart: (child: ChildProcess): void => {
      const poll = setInterval(() => {
        const m = join(dir, 'metrics.jsonl');
        if (!existsSync(m) || readFileSync(m, 'utf8').trim().split('\n').length < rows) return;
        const pid = whom(child);
        if (pid === undefined) return;
        clearInterval(poll);
        s.sent = true;
        process.kill(pid, signal);
      }, 5);
      child.on('close', () => clearInterval(poll));
    },
  };
  return s;
}

const stoppedAt = (out: string): number => Number(/\[stop\] stopped after step (\d+) of \d+/.exec(out)?.[1] ?? NaN);

test('SIGUSR1 on one rank saves and requeues (scontrol requeue $SLURM_JOB_ID); the requeued job resumes, a SIGTERM saves without a requeue, and the run ends as the uninterrupted one', async () => {
  // The uninterrupted run: two node tasks of a 2-node allocation (both on this host), one rank each,
  // which meet at the nodelist's first host on the job's port ([Note: slurm geometry]).
  const refDir = join(work, 'slurm-ref');
  const nodeTask = (node: number): Promise<Flotilla> => flotilla(
    ['train', CONFIG, `--train.runDir=${refDir}`, '--nproc', '1', `--train.steps=${STEPS}`, '--optim.schedule=constant', '--checkpoint.every=0', '--record', join(refDir, 'record')],
    { env: { SLURM_JOB_ID: '4243', SLURM_PROCID: String(node), SLURM_NTASKS: '2', SLURM_NNODES: '2', SLURM_NODEID: String(node), SLURM_LOCALID: '0', SLURM_JOB_NODELIST: 'localhost,localhost' } },
  );
  const reference = launch(() => Promise.all([nodeTask(0), nodeTask(1)]));
  const dir = join(work, 'slurm-job');

  // 1. The time limit is near: SIGUSR1 reaches rank 1 only.
  const usr1 = signalAt(dir, 3, 'SIGUSR1', () => rankPids(dir).get(1));
  const first = await launch(() => flotilla(common(dir, join(dir, 'record-1')), { env: slurmEnv(0), onStart: usr1.onStart }));
  assert.ok(usr1.sent);
  assert.equal(first.code, 0, `${first.out}\n${first.err}`);
  const s1 = stoppedAt(first.out);
  assert.ok(s1 >= 3 && s1 < STEPS, `stopped after step ${s1}\n${first.out}`);
  assert.equal(readFileSync(join(dir, 'ckpt', 'latest'), 'utf8').trim(), `step-${String(s1).padStart(6, '0')}`);
  assert.equal(readFileSync(calls, 'utf8'), 'requeue 4242\n', 'rank 0 requeued the job once, after the save');
  assert.match(first.out, /\[slurm\] requeued job 4242/);

  // 2. The requeued job (the same command) resumes by itself; scancel's SIGTERM reaches its launcher.
  const term = signalAt(dir, s1 + 3, 'SIGTERM', (child) => child.pid);
  const second = await launch(() => flotilla(common(dir, join(dir, 'record-2')), { env: slurmEnv(1), onStart: term.onStart }));
  assert.ok(term.sent);
  assert.equal(second.code, 0, `${second.out}\n${second.err}`);
  assert.match(second.out, new RegExp(`\\[resume\\] resumed from step ${s1}\\b`));
  const s2 = stoppedAt(second.out);
  assert.ok(s2 > s1 && s2 < STEPS, `stopped after step ${s2}\n${second.out}`);
  assert.equal(readFileSync(join(dir, 'ckpt', 'latest'), 'utf8').trim(), `step-${String(s2).padStart(6, '0')}`);
  assert.equal(readFileSync(calls, 'utf8'), 'requeue 4242\n', 'a SIGTERM saves without a requeue');

  // 3. Started again, it finishes.
  const third = await launch(() => flotilla(common(dir, join(dir, 'record-3')), { env: slurmEnv(2) }));
  assert.equal(third.code, 0, `${third.out}\n${third.err}`);
  assert.match(third.out, new RegExp(`\\[resume\\] resumed from step ${s2}\\b`));

  const refNodes = await reference;
  for (const r of refNodes) assert.equal(r.code, 0, `${r.out}\n${r.err}`);
  assert.match(refNodes[0]!.out, /\[world\] [^\n]*, 2 ranks,/, 'the two node tasks (one rank each) met in one world');
  const steps = readMetrics(join(dir, 'metrics.jsonl')).map((m) => m.step);
  assert.deepEqual(steps, Array.from({ length: STEPS }, (_, i) => i + 1), 'every step once, no gap');
  assert.deepEqual(readMetrics(join(dir, 'metrics.jsonl')).map((m) => m.loss), readMetrics(join(refDir, 'metrics.jsonl')).map((m) => m.loss));
  const want = readRecord(join(refDir, 'record'));
  const got = readRecord(join(dir, 'record-3'));
  assert.deepEqual([...got.keys()].sort(), [...want.keys()].sort());
  for (const [name, v] of want) assert.deepEqual(got.get(name), v, name);
});

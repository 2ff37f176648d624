// `flotilla sbatch CONFIG --nodes N --nproc K ...`: the batch script of a Slurm job that trains
// CONFIG on N nodes, K ranks each, printed (or submitted with --submit).
//
// [Note: sbatch script] One srun task per node: each task is that node's `flotilla train`, which
// reads the allocation ([Note: slurm geometry] in src/launch/slurm.ts) and starts K ranks.
// `--signal=USR1@90` (not B:USR1): without B: Slurm signals the job steps' processes (the srun
// tasks, so flotilla on every node and its ranks) 90 s before the time limit, and the ranks save a
// checkpoint after their current step ([Note: slurm stop]); B: would signal only the batch shell,
// which runs no rank. With [slurm] requeue = true, `#SBATCH --requeue` lets rank 0's `scontrol
// requeue` put the job back in the queue, and the script run again (SLURM_RESTART_COUNT > 0)
// resumes from that checkpoint; the log is appended to (--open-mode=append), not truncated.
// FLOTILLA_JOB_SECRET is made once per start of the script and reaches every node through srun.
import { spawnSync } from 'node:child_process';
import { resolve } from 'node:path';
import { onPath } from '../distributed/mpi_install.js';
import { UsageError } from './usage.js';

export interface SbatchArgs {
  config: string;
  nodes: number;
  nproc: number;
  time?: string;
  partition?: string;
  jobName?: string;
  output?: string;
  submit: boolean;
  overrides: string[];
}

const VALUED = ['--nodes', '--nproc', '--time', '--partition', '--job-name', '--output'] as const;

/** Parses the arguments after `flotilla sbatch`. */
export function parseSbatchArgs(args: readonly string[]): SbatchArgs {
  const v: Partial<Record<(typeof VALUED)[number], string>> = {};
  let config: string | undefined;
  let submit = false;
  const overrides: string[] = [];
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    const flag = VALUED.find((f) => a === f || a.startsWith(`${f}=`));
    if (flag !== undefined) {
      const val = a === flag ? args[++i] : a.slice(flag.length + 1);
      if (val === undefined || val === '') throw new UsageError(`sbatch: ${flag} needs a value`);
      v[flag] = val;
    } else if (a === '--submit') {
      submit = true;
    } else if (/^--[A-Za-z0-9_]+\.[A-Za-z0-9_]+=/s.test(a)) {
      overrides.push(a);
    } else if (a.startsWith('-')) {
      throw new UsageError(`sbatch: unknown option ${a}; options are --nodes N --nproc K [--time T] [--partition P] [--job-name NAME] [--output FILE] [--submit] and --section.field=value overrides`);
    } else if (config === undefined) {
      config = a;
    } else {
      throw new UsageError(`sbatch: one config file expected, got ${JSON.stringify(config)} and ${JSON.stringify(a)}`);
    }
  }
  if (config === undefined) throw new UsageError('sbatch: missing the config file: flotilla sbatch <config.toml> --nodes N --nproc K');
  const count = (flag: '--nodes' | '--nproc'): number => {
    const raw = v[flag];
    if (raw === undefined) throw new UsageError(`sbatch: give ${flag} (e.g. flotilla sbatch ${config} --nodes 2 --nproc 4)`);
    if (!/^\d+$/.test(raw) || Number(raw) < 1) throw new UsageError(`sbatch: ${flag} needs a positive integer, got ${JSON.stringify(raw)}`);
    return Number(raw);
  };
  return {
    config, nodes: count('--nodes'), nproc: count('--nproc'), submit, overrides,
    ...(v['--time'] !== undefined ? { time: v['--time'] } : {}), ...(v['--partition'] !== undefined ? { partition: v['--partition'] } : {}),
    ...(v['--job-name'] !== undefined ? { jobName: v['--job-name'] } : {}), ...(v['--output'] !== undefined ? { output: v['--output'] } : {}),
  };
}

/** Quotes a word for bash when it needs it. */
function sh(word: string): string {
  return /^[A-Za-z0-9_@%+=:,./-]+$/.test(word) ? word : `'${word.replace(/'/g, `'\\''`)}'`;
}

/** The batch script ([Note: sbatch script]); `flotilla` is the command line that starts flotilla. */
export function sbatchScript(a: SbatchArgs, o: { requeue: boolean; name: string; flotilla: string[]; cwd: string }): string {
  const lines = [
    '#!/bin/bash',
    `#SBATCH --job-name=${sh(a.jobName ?? o.name)}`,
    `#SBATCH --nodes=${a.nodes}`,
    '#SBATCH --ntasks-per-node=1',
    ...(a.time !== undefined ? [`#SBATCH --time=${sh(a.time)}`] : []),
    ...(a.partition !== undefined ? [`#SBATCH --partition=${sh(a.partition)}`] : []),
    `#SBATCH --output=${sh(a.output ?? 'flotilla-%x-%j.out')}`,
    '#SBATCH --open-mode=append',
    '#SBATCH --signal=USR1@90',
    ...(o.requeue ? ['#SBATCH --requeue'] : []),
    '# Written by `flotilla sbatch`: one task per node, each starting its node\'s ranks; USR1 (90 s',
    `# before the time limit) or SIGTERM (scancel, preemption) saves a checkpoint after the current step${o.requeue ? ',\n# and USR1 then requeues the job, which resumes from that checkpoint' : ''}.`,
    'set -euo pipefail',
    `cd ${sh(o.cwd)}`,
    '# One secret per start of the job, the same on every node (srun passes the environment on).',
    'export FLOTILLA_JOB_SECRET="${FLOTILLA_JOB_SECRET:-$(od -An -tx1 -N32 /dev/urandom | tr -d \' \\n\')}"',
    `srun ${[...o.flotilla, 'train', a.config, '--nproc', String(a.nproc), ...a.overrides].map(sh).join(' ')}`,
    '',
  ];
  return lines.join('\n');
}

/** Nodes of a partition (the default one when undefined) as sinfo reports them; undefined without sinfo or an answer. */
export function partitionNodes(partition: string | undefined): { name: string; nodes: number } | undefined {
  if (onPath('sinfo') === undefined) return undefined;
  const r = spawnSync('sinfo', ['-h', '-o', '%P %D', ...(partition !== undefined ? ['-p', partition] : [])], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
  if (r.status !== 0 || r.error) return undefined;
  // One line per partition and node state ("debug* 2"); the default partition's name ends in '*'.
  let name: string | undefined, nodes = 0;
  for (const line of r.stdout.split('\n')) {
    const m = /^(\S+)\s+(\d+)\s*$/.exec(line.trim());
    if (!m) continue;
    const isDefault = m[1]!.endsWith('*');
    const n = m[1]!.replace(/\*$/, '');
    if (partition !== undefined ? n !== partition : !isDefault) continue;
    name = n;
    nodes += Number(m[2]);
  }
  return name === undefined ? undefined : { name, nodes };
}

/** `flotilla sbatch ...`: prints the script, or submits it and prints the job id. */
export async function sbatchCommand(args: readonly string[]): Promise<number> {
  const a = parseSbatchArgs(args);
  const { loadConfig } = await import('../config/index.js');
  const cfg = loadConfig(a.config, a.overrides); // a bad config is one message here, not in the queue
  const part = partitionNodes(a.partition);
  if (part !== undefined && a.nodes > part.nodes) {
    throw new UsageError(`sbatch: --nodes ${a.nodes} is more than partition ${part.name} has (${part.nodes} node${part.nodes === 1 ? '' : 's'}); ask for at most ${part.nodes}${a.partition === undefined ? ', or name a larger partition with --partition' : ''}`);
  }
  const script = sbatchScript({ ...a, config: resolve(a.config) }, {
    requeue: cfg.slurm.requeue, name: cfg.train.name, cwd: process.cwd(), flotilla: [process.execPath, resolve(process.argv[1] ?? 'flotilla')],
  });
  if (!a.submit) {
    process.stdout.write(script);
    return 0;
  }
  if (onPath('sbatch') === undefined) throw new UsageError('sbatch --submit: the sbatch command is not on PATH; run this on a Slurm login node, or drop --submit and submit the printed script there');
  const r = spawnSync('sbatch', ['--parsable'], { input: script, encoding: 'utf8', stdio: ['pipe', 'pipe', 'pipe'] });
  if (r.error || r.status !== 0) {
    process.stderr.write(`flotilla sbatch: sbatch failed${r.status !== null ? ` (exit ${r.status})` : ''}: ${(r.error?.message ?? r.stderr).trim()}\n`);
    return 1;
  }
  const id = r.stdout.trim().split(';')[0]!;
  process.stdout.write(`submitted batch job ${id}\n`);
  return 0;
}

// A real Slurm cluster for one test file, on this machine: its own munged (key and socket in a
// temporary directory), slurmctld and slurmd from Debian's packages (scripts/setup.sh), started by
// startSlurm and all stopped by drop() (also when the file's process exits or is told to stop).
// Two shapes:
//   - one node on loopback ({ nodes: 1 }): node n1 at 127.0.0.1, controller on 127.0.0.1, free ports;
//   - nodes in network namespaces ({ nodes: N, namespaces: true }, test/helpers/hosts.ts): the
//     controller alone in host 0 (10.77.0.1, so cutting a node never cuts the controller), node k in
//     host k (10.77.0.k+1) with hostname nk in a UTS namespace of its own, so a task's `hostname`
//     names its node. Clients (sbatch, squeue, scontrol) run inside host 0: cmd() wraps them.
// Job scripts run with the client's environment (sbatch exports it): SLURM_CONF reaches their srun.
// Node names resolve inside the daemons and jobs (a hosts file of the cluster's own). No side
// effects at import. A test, in short:
//   const c = await startSlurm({ nodes: 2, namespaces: true });   // a string: why not (t.skip it)
//   after(() => c.drop());
//   const id = c.submit(`srun -N2 ${process.execPath} ${BIN} train ...`, ['-N2']);
//   const job = await c.waitJob(id, 120_000);                      // job.state, job.restarts
//   c.output(id);                                                   // its slurm-ID.out
// Node k (0-based) is host k + 1 of c.hosts: c.hosts.cut(k + 1) takes it off the network.
//
// slurm.conf, and why:
//   SlurmUser/SlurmdUser=root     the suite runs as root; no slurm user or file ownership to set up.
//   AuthInfo=socket=...           our munged's socket, not the system one (which is not running);
//     ,cred_expire=5              a requeued job waits this long (+1 s) before it may start again
//                                 (default 120 s); 5 is the least Slurm takes. Step credentials live
//                                 as long, plenty for a launch on one machine.
//   SchedulerParameters=sched_interval=1  pending jobs (a requeued one past its wait) are looked at
//                                 every second, not every 60 s.
//   SlurmdParameters=config_overrides  nodes declare CPUs of their own (several nodes share this
//                                 machine's cores) without being drained for differing from hardware.
//   ProctrackType=proctrack/linuxproc, TaskPlugin=task/none  no cgroup set-up (the nodes share
//                                 one machine's cgroups); processes are tracked by parentage.
//   SelectType=select/cons_tres with CR_CPU  jobs take CPUs, not whole nodes, memory is not tracked.
//   OverSubscribe=YES             jobs asking --oversubscribe may share CPUs.
//   ReturnToService=2             a node that was down (cut, killed) is taken back when it registers.
//   MinJobAge=60                  a finished job's record stays long enough for waitJob to read it
//                                 under load, and is gone well before the next file's cluster.
//   JobRequeue=1                  batch jobs may be requeued (scontrol requeue, a lost node).
//   Spool, state, pid and log files in the temporary directory, %n per node.
//   No accounting (sacct): job states come from scontrol show job, output from the job's files.
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync, chmodSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { hostname, tmpdir } from 'node:os';
import { join } from 'node:path';
import { freePort } from '../../src/launch/launcher.js';
import { makeHosts, type Hosts } from './hosts.js';

export interface SlurmOptions {
  /** Number of compute nodes (n1, n2, ...). */
  nodes: number;
  /** Each node in a network namespace of its own (needs root); otherwise one node on loopback. */
  namespaces?: boolean;
  /** CPUs each node declares (default 2). */
  cpus?: number;
  /** More slurm.conf lines (e.g. SlurmdTimeout=10), after the harness's own. */
  conf?: string[];
}

export interface SlurmJob {
  id: number;
  /** JobState: COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL, ... (RUNNING etc. while it runs). */
  state: string;
  /** scontrol's ExitCode, e.g. "0:0". */
  exitCode: string;
  restarts: number;
  nodeList: string;
  /** Every field of `scontrol show job -o`. */
  fields: Record<string, string>;
}

export interface SlurmCluster {
  /** The temporary directory: slurm.conf, logs, job scripts and (by default) job output. */
  dir: string;
  conf: string;
  /** Environment for clients and jobs (process.env with SLURM_CONF). */
  env: NodeJS.ProcessEnv;
  nodes: { name: string; addr: string }[];
  /** The namespaces when the nodes have them (node k is host k+1; host 0 runs slurmctld). */
  hosts?: Hosts;
  /** A client command (sbatch, scontrol, ...) as [file, args] for spawn, where it reaches slurmctld. */
  cmd(tool: string, args: string[]): [string, string[]];
  /** Runs a client command, returns its stdout; throws with its output when it fails. */
  run(tool: string, args: string[]): string;
  /** Writes `script` (a body; `#!/bin/bash` is added when missing) and sbatches it with `args`; returns the job id. */
  submit(script: string, args?: string[]): number;
  /** The job now, or undefined once Slurm has forgotten it. */
  job(id: number): SlurmJob | undefined;
  /** Polls until the job is in a final state (requeues are not final); rejects after timeoutMs with the logs' ends. */
  waitJob(id: number, timeoutMs: number, until?: (j: SlurmJob) => boolean): Promise<SlurmJob>;
  /** The job's default output file (dir/slurm-ID.out), '' when absent. */
  output(id: number): string;
  /** The last lines of slurmctld's and every slurmd's log (for failure messages). */
  logs(): string;
  /** Stops every daemon and job process, deletes the namespaces and the directory. Idempotent. */
  drop(): void;
  /** What of the cluster is still there: its processes (pid and command) and namespaces. */
  remains(): string[];
}

const FINAL = new Set(['COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT', 'NODE_FAIL', 'PREEMPTED', 'OUT_OF_MEMORY', 'BOOT_FAIL', 'DEADLINE', 'SPECIAL_EXIT']);

const which = (tool: string): boolean => spawnSync('sh', ['-c', `command -v ${tool}`], { stdio: 'ignore', env: { ...process.env, PATH: `${process.env.PATH}:/usr/sbin:/sbin` } }).status === 0;

/** Processes whose environment names this cluster's slurm.conf (daemons, slurmstepd, job tasks). */
function processesOf(conf: string): number[] {
  const mark = Buffer.from(`SLURM_CONF=${conf}\0`);
  const pids: number[] = [];
  for (const p of readdirSync('/proc')) {
    if (!/^\d+$/.test(p) || Number(p) === process.pid) continue;
    try {
      if (readFileSync(`/proc/${p}/environ`).includes(mark)) pids.push(Number(p));
    } catch {
      // gone, or not ours to read
    }
  }
  return pids;
}

const live = new Set<SlurmCluster>();
let clusters = 0;
let hooked = false;
function hookExit(): void {
  if (hooked) return;
  hooked = true;
  process.on('exit', () => { for (const c of live) c.drop(); });
  for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) {
    process.once(sig, () => {
      for (const c of live) c.drop();
      process.kill(process.pid, sig);
    });
  }
}

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

/** Starts a cluster and waits until its nodes are idle; returns why not (a string) when it cannot. */
export async function startSlurm(o: SlurmOptions): Promise<SlurmCluster | string> {
  for (const tool of ['munged', 'slurmctld', 'slurmd', 'sbatch', 'scontrol']) {
    if (!which(tool)) return `${tool} is not installed (scripts/setup.sh installs slurmctld, slurmd, slurm-client and munge)`;
  }
  if (process.getuid?.() !== 0) return 'the Slurm daemons run as root here (the suite runs as root)';
  const sbin = `${process.env.PATH}:/usr/sbin:/sbin`;
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-slurm-'));
  const conf = join(dir, 'slurm.conf');
  const env: NodeJS.ProcessEnv = { ...process.env, PATH: sbin, SLURM_CONF: conf };
  let hosts: Hosts | undefined;
  // Namespaces flts<pid><k>a, ... and the bridge's flts<pid><k>s (interface names stay within 15 characters).
  const tag = `s${process.pid}${clusters++ % 10}`;
  if (o.namespaces) {
    const h = makeHosts(o.nodes + 1, tag);
    if (typeof h === 'string') {
      rmSync(dir, { recursive: true, force: true });
      return h;
    }
    hosts = h;
  }
  const nodes = Array.from({ length: o.nodes }, (_, k) => ({ name: `n${k + 1}`, addr: hosts ? hosts.addr[k + 1]! : '127.0.0.1' }));
  if (!hosts && o.nodes !== 1) return 'more than one node needs namespaces: true';
  const ctlAddr = hosts ? hosts.addr[0]! : '127.0.0.1';
  // In namespaces every daemon has its addresses to itself: the default ports.
  const [ctlPort, dPort] = hosts ? [6817, 6818] : [await freePort(), await freePort()];
  const cpus = o.cpus ?? 2;
  writeFileSync(conf, [
    'ClusterName=flotilla',
    // slurmctld starts only on the host it names: this machine, or the UTS namespace named ctl.
    `SlurmctldHost=${hosts ? 'ctl' : hostname()}(${ctlAddr})`,
    'SlurmUser=root', 'SlurmdUser=root',
    'AuthType=auth/munge', 'CredType=cred/munge', `AuthInfo=socket=${join(dir, 'munge.sock')},cred_expire=5`,
    `SlurmctldPort=${ctlPort}`, `SlurmdPort=${dPort}`,
    `StateSaveLocation=${join(dir, 'state')}`, `SlurmdSpoolDir=${join(dir, 'spool-%n')}`,
    `SlurmctldPidFile=${join(dir, 'slurmctld.pid')}`, `SlurmdPidFile=${join(dir, 'slurmd-%n.pid')}`,
    `SlurmctldLogFile=${join(dir, 'slurmctld.log')}`, `SlurmdLogFile=${join(dir, 'slurmd-%n.log')}`,
    'SlurmdParameters=config_overrides',
    'ProctrackType=proctrack/linuxproc', 'TaskPlugin=task/none',
    'SelectType=select/cons_tres', 'SelectTypeParameters=CR_CPU',
    'SchedulerType=sched/builtin', 'SchedulerParameters=sched_interval=1', 'MpiDefault=none', 'SwitchType=switch/none',
    'JobAcctGatherType=jobacct_gather/none', 'AccountingStorageType=accounting_storage/none',
    'ReturnToService=2', 'MinJobAge=60', 'JobRequeue=1', 'KillWait=5', 'InactiveLimit=0',
    ...(o.conf ?? []),
    ...nodes.map((n) => `NodeName=${n.name} NodeAddr=${n.addr} NodeHostname=${n.name} CPUs=${cpus} RealMemory=1000 State=UNKNOWN`),
    'PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES',
  ].join('\n') + '\n');
  for (const n of nodes) mkdirSync(join(dir, `spool-${n.name}`));
  writeFileSync(join(dir, 'munge.key'), randomBytes(128));
  chmodSync(join(dir, 'munge.key'), 0o600);

  const children: ChildProcess[] = [];
  // Into host k's network namespace only (nsenter), not `ip netns exec`'s fresh /sys, under which
  // slurmd finds no cgroup filesystem and stops.
  const inHost = (k: number, file: string, args: string[]): [string, string[]] =>
    (hosts ? ['nsenter', [`--net=/run/netns/${hosts.ns[k]}`, file, ...args]] : [file, args]);
  const daemon = (file: string, args: string[], host = 0): void => {
    const [cmd, argv] = inHost(host, file, args);
    const c = spawn(cmd, argv, { env, stdio: 'ignore' });
    c.on('error', () => {});
    children.push(c);
  };
  const cmd = (tool: string, args: string[]): [string, string[]] => inHost(0, tool, args);
  const run = (tool: string, args: string[]): string => {
    const [c, a] = cmd(tool, args);
    const r = spawnSync(c, a, { env, encoding: 'utf8', timeout: 30_000 });
    if (r.status !== 0) throw new Error(`${tool} ${args.join(' ')} failed (${r.status ?? r.signal}): ${r.stdout}${r.stderr}${r.error?.message ?? ''}`);
    return r.stdout;
  };
  const logs = (): string => ['slurmctld.log', ...nodes.map((n) => `slurmd-${n.name}.log`)].map((f) => {
    const p = join(dir, f);
    return existsSync(p) ? `--- ${f}\n${readFileSync(p, 'utf8').split('\n').slice(-15).join('\n')}` : `--- ${f}: none`;
  }).join('\n');

  let dropped = false;
  const cluster: SlurmCluster = {
    dir, conf, env, nodes, hosts, cmd, run, logs,
    submit(script, args = []) {
      const file = join(dir, `job-${randomBytes(4).toString('hex')}.sh`);
      writeFileSync(file, script.startsWith('#!') ? script : `#!/bin/bash\n${script}`, { mode: 0o755 });
      const out = run('sbatch', ['--parsable', `--chdir=${dir}`, `--output=${join(dir, 'slurm-%j.out')}`, ...args, file]);
      return Number(out.trim().split(';')[0]);
    },
    job(id) {
      const [c, a] = cmd('scontrol', ['show', 'job', '-o', String(id)]);
      const r = spawnSync(c, a, { env, encoding: 'utf8', timeout: 30_000 });
      if (r.status !== 0) return undefined;
      const fields: Record<string, string> = {};
      for (const m of r.stdout.matchAll(/(\w+)=(\S*)/g)) fields[m[1]!] ??= m[2]!;
      return { id, state: fields.JobState ?? '', exitCode: fields.ExitCode ?? '', restarts: Number(fields.Restarts ?? 0), nodeList: fields.NodeList ?? '', fields };
    },
    async waitJob(id, timeoutMs, until = (j) => FINAL.has(j.state)) {
      const end = Date.now() + timeoutMs;
      let last: SlurmJob | undefined;
      for (;;) {
        const j = cluster.job(id);
        if (j) last = j;
        if (j && until(j)) return j;
        if (dropped) throw new Error(`job ${id}: the cluster was dropped while waiting (last state ${last?.state ?? 'unknown'})`);
        if (Date.now() > end) {
          throw new Error(`job ${id} did not get there within ${timeoutMs} ms (last state ${last?.state ?? 'unknown'})\n${cluster.output(id)}\n${logs()}`);
        }
        await sleep(250);
      }
    },
    output(id) {
      const p = join(dir, `slurm-${id}.out`);
      return existsSync(p) ? readFileSync(p, 'utf8') : '';
    },
    remains() {
      const names = new Set(spawnSync('ip', ['netns', 'list'], { encoding: 'utf8' }).stdout?.split('\n').map((l) => l.split(' ')[0] ?? '') ?? []);
      const cmdline = (p: number): string => {
        try {
          return readFileSync(`/proc/${p}/cmdline`, 'utf8').replaceAll('\0', ' ').trim();
        } catch {
          return '';
        }
      };
      return [
        ...processesOf(conf).map((p) => `process ${p}: ${cmdline(p)}`),
        ...children.filter((c) => c.pid !== undefined && existsSync(`/proc/${c.pid}/cmdline`) && cmdline(c.pid) !== '').map((c) => `daemon ${c.pid}: ${cmdline(c.pid!)}`),
        ...[...names].filter((n) => n.startsWith(`flt${tag}`)).map((n) => `namespace ${n}`),
      ];
    },
    drop() {
      if (dropped) return;
      dropped = true;
      live.delete(cluster);
      // Every process of the cluster: the daemons we started, then whatever carries its SLURM_CONF
      // (slurmstepd and job tasks, which slurmd leaves behind it), then the namespaces' processes.
      for (const c of children) if (c.exitCode === null) c.kill('SIGKILL');
      for (let round = 0; round < 3; round++) {
        const pids = processesOf(conf);
        if (hosts) {
          for (const ns of hosts.ns) {
            const r = spawnSync('ip', ['netns', 'pids', ns], { encoding: 'utf8' });
            for (const p of (r.stdout ?? '').split('\n')) if (/^\d+$/.test(p)) pids.push(Number(p));
          }
        }
        if (pids.length === 0) break;
        for (const p of pids) {
          try {
            process.kill(p, 'SIGKILL');
          } catch {
            // already gone
          }
        }
        spawnSync('sleep', ['0.1']);
      }
      hosts?.drop();
      rmSync(dir, { recursive: true, force: true });
    },
  };
  live.add(cluster);
  hookExit();

  const fail = (why: string): string => {
    const text = `${why}\n${logs()}`;
    cluster.drop();
    return text;
  };
  daemon('munged', ['-F', '-f', `--key-file=${join(dir, 'munge.key')}`, `--socket=${join(dir, 'munge.sock')}`,
    `--pid-file=${join(dir, 'munged.pid')}`, `--log-file=${join(dir, 'munged.log')}`, `--seed-file=${join(dir, 'munged.seed')}`]);
  for (let i = 0; !existsSync(join(dir, 'munge.sock')); i++) {
    if (i > 100) return fail('munged did not start within 10 s');
    await sleep(100);
  }
  // Node names resolve in the daemons and jobs (MASTER_ADDR=$(scontrol show hostnames ... | head -n 1)
  // works as on a real cluster): each Slurm daemon runs in a mount namespace of its own with the
  // cluster's hosts file over /etc/hosts; in namespaces also in a UTS namespace named for it (a
  // task's hostname is its node's).
  const hostsFile = join(dir, 'hosts');
  writeFileSync(hostsFile, ['127.0.0.1 localhost', ...(hosts ? [`${ctlAddr} ctl`] : []), ...nodes.map((n) => `${n.addr} ${n.name}`)].join('\n') + '\n');
  const named = (name: string, file: string, args: string[]): [string, string[]] => ['unshare', [
    '--mount', ...(hosts ? ['--uts'] : []), 'sh', '-c',
    `mount --bind ${hostsFile} /etc/hosts && ${hosts ? `hostname ${name} && ` : ''}exec ${file} ${args.join(' ')}`,
  ]];
  daemon(...named('ctl', 'slurmctld', ['-D', '-i', '-f', conf]), 0);
  nodes.forEach((n, k) => daemon(...named(n.name, 'slurmd', ['-D', '-f', conf, '-N', n.name]), k + 1));
  // Ready when slurmctld answers and every node is idle.
  const end = Date.now() + 30_000;
  for (;;) {
    const [c, a] = cmd('sinfo', ['-h', '-N', '-o', '%N %t']);
    const r = spawnSync(c, a, { env, encoding: 'utf8', timeout: 10_000 });
    const idle = (r.stdout ?? '').split('\n').filter((l) => / idle$/.test(l)).length;
    if (r.status === 0 && idle === nodes.length) break;
    if (children.some((ch) => ch.exitCode !== null)) return fail(`a Slurm daemon exited at start (sinfo: ${r.stdout}${r.stderr})`);
    if (Date.now() > end) return fail(`the nodes were not idle within 30 s (sinfo: ${r.stdout}${r.stderr})`);
    await sleep(100);
  }
  return cluster;
}

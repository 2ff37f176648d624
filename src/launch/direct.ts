// Ranks started directly (`flotilla run`, backend gloo): each rank a child process of the launcher
// with the torchrun-style contract (src/distributed/env.ts) in its environment, its output prefixed
// `[rank k]`. Ranks start under `setpriv --pdeathsig TERM` where setpriv exists, so even a rank that
// never reaches initProcessGroup gets SIGTERM when the launcher dies. The supervisor decides the rest.
import { spawn, type ChildProcess } from 'node:child_process';
import { createInterface } from 'node:readline';
import { onPath } from '../distributed/mpi_install.js';
import type { Supervisor, SupervisorIO } from './supervisor.js';

export interface DirectGroup {
  /** Global ranks start at nodeRank * nproc. */
  nproc: number;
  nodeRank: number;
  worldSize: number;
  cmd: string;
  args: string[];
  /** The environment every rank shares (the launcher adds each rank's own contract variables). */
  env: NodeJS.ProcessEnv;
  masterAddr: string;
  masterPort: number;
}

/** Starts the ranks and reports their exits to the supervisor; resolves once all have closed. */
export function runDirect(g: DirectGroup, io: SupervisorIO, sup: Supervisor): Promise<void> {
  let [cmd, baseArgs] = [g.cmd, g.args];
  const setpriv = process.platform === 'linux' ? onPath('setpriv') : undefined;
  if (setpriv !== undefined) [cmd, baseArgs] = [setpriv, ['--pdeathsig', 'TERM', '--', cmd, ...baseArgs]];
  const children = new Map<number, ChildProcess>();
  sup.attach({
    signal: (signal) => {
      for (const r of sup.running) children.get(r)?.kill(signal);
    },
    pids: () => [...children].filter(([, c]) => c.pid !== undefined).map(([rank, c]) => ({ rank, pid: c.pid! })),
  });
  return new Promise<void>((resolve) => {
    let left = g.nproc;
    for (let local = 0; local < g.nproc; local++) {
      const rank = g.nodeRank * g.nproc + local;
      const env: NodeJS.ProcessEnv = {
        ...g.env,
        RANK: String(rank), WORLD_SIZE: String(g.worldSize), LOCAL_RANK: String(local), LOCAL_WORLD_SIZE: String(g.nproc),
        GROUP_RANK: String(g.nodeRank), MASTER_ADDR: g.masterAddr, MASTER_PORT: String(g.masterPort),
        FLOTILLA_LAUNCHER_PID: String(process.pid),
      };
      const child = spawn(cmd, baseArgs, { env, stdio: ['ignore', 'pipe', 'pipe'] });
      children.set(rank, child);
      const prefix = `[rank ${rank}] `;
      createInterface({ input: child.stdout!, crlfDelay: Infinity }).on('line', (l) => void io.stdout.write(`${prefix}${l}\n`));
      createInterface({ input: child.stderr!, crlfDelay: Infinity }).on('line', (l) => void io.stderr.write(`${prefix}${l}\n`));
      let startError: string | undefined;
      child.on('error', (e) => {
        startError = e.message;
      });
      // The verdict waits for 'close' (the rank's output is drained by then), or 1 s after 'exit'
      // when something else holds the rank's pipes open.
      child.on('exit', (code, signal) => void setTimeout(() => sup.rankExited(rank, code, signal, startError), 1000).unref());
      child.on('close', (code, signal) => {
        // A rank that could not start has 'error' and 'close' but no 'exit'.
        sup.rankExited(rank, code, signal, startError);
        if (--left === 0) resolve();
      });
    }
  });
}

// `flotilla run` on the command line: its options, parsed into the launcher's RunOptions
// (src/launch/launcher.ts), and the usage text. Options come before the script; everything after
// the script goes to it unchanged.
import { DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, checkFlotillaEnv } from '../distributed/env.js';
import { mpiInstalled, MPI_INSTALL_HINT } from '../distributed/mpi_install.js';
import { launch, type LauncherIO, type RunOptions } from '../launch/launcher.js';
import { UsageError, parseNnodes } from './usage.js';

export type { LauncherIO, RunOptions };

export const RUN_USAGE = `usage: flotilla run --nproc N [options] script.ts [script args...]

Starts N ranks of the script on this host with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set, prefixes their output with [rank k], and stops them all when one fails.

options:
  --nproc N            ranks on this node (alias --nproc-per-node)
  --nnodes M           nodes in the job (default 1); MIN:MAX starts on MAX nodes and, when a node
                       is lost, carries on without it while MIN remain (the ranks restart on the
                       smaller world, with FLOTILLA_RESTART_COUNT > 0 and FLOTILLA_ELASTIC set)
  --node-rank R        this node's index, 0..M-1 (default 0)
  --master-addr A      address of the node that runs global rank 0 (default ${DEFAULT_MASTER_ADDR}); an
                       elastic job may list several, A,B,C (node 0 first): a host started later, or
                       started again after it was lost, tries each in turn to find the job's node 0
  --master-port P      rendezvous port there (default: a free port on one node, ${DEFAULT_MASTER_PORT} on several)
  --max-restarts K     restart the whole group up to K times after a failure (default 0)
  --backend B          gloo (default), mpi (ranks start through Open MPI's mpirun; one node), or
                       auto (mpi when Open MPI is installed, else gloo)
  -h, --help           show this help`;

const OPTIONS: Record<string, keyof RunOptions> = {
  'nproc': 'nproc', 'nproc-per-node': 'nproc', 'nnodes': 'nnodes', 'node-rank': 'nodeRank',
  'master-addr': 'masterAddr', 'master-port': 'masterPort', 'max-restarts': 'maxRestarts', 'backend': 'backend',
};

function parseInt(flag: string, raw: string, min: number, max = Number.MAX_SAFE_INTEGER): number {
  if (!/^\d+$/.test(raw.trim())) throw new UsageError(`--${flag} ${JSON.stringify(raw)}: expected an integer`);
  const v = Number(raw);
  if (v < min || v > max) throw new UsageError(`--${flag} ${v}: must be ${max === Number.MAX_SAFE_INTEGER ? `at least ${min}` : `between ${min} and ${max}`}`);
  return v;
}

/**
 * Parses the arguments after `flotilla run`. Options come before the script; everything after the
 * script goes to it unchanged. Accepts --opt value, --opt=value, and torchrun's underscore spellings.
 */
export function parseRunArgs(argv: readonly string[]): RunOptions {
  const raw: Partial<Record<keyof RunOptions, string>> = {};
  let i = 0;
  for (; i < argv.length; i++) {
    const a = argv[i]!;
    if (a === '-h' || a === '--help') throw new UsageError('', true);
    if (a === '--') {
      i++;
      break;
    }
    if (!a.startsWith('-')) break;
    const eq = a.indexOf('=');
    const flag = (eq >= 0 ? a.slice(2, eq) : a.slice(2)).replace(/_/g, '-');
    const key = OPTIONS[flag];
    if (!a.startsWith('--') || key === undefined) {
      throw new UsageError(`unknown option ${a} (options: ${Object.keys(OPTIONS).map((o) => `--${o}`).join(', ')}; the script and its arguments come last)`);
    }
    let value: string | undefined;
    if (eq >= 0) value = a.slice(eq + 1);
    else {
      value = argv[++i];
      if (value === undefined) throw new UsageError(`--${flag} needs a value`);
    }
    raw[key] = value;
  }
  const script = argv[i];
  if (script === undefined) throw new UsageError('no script given: flotilla run --nproc N script.ts [args...]');
  if (raw.nproc === undefined) throw new UsageError('--nproc N is required (ranks to start on this node)');
  const nproc = parseInt('nproc', raw.nproc, 1);
  const { nnodes, minNodes = nnodes } = raw.nnodes === undefined ? { nnodes: 1 } : parseNnodes(raw.nnodes, (m) => new UsageError(m));
  const nodeRank = raw.nodeRank === undefined ? 0 : parseInt('node-rank', raw.nodeRank, 0);
  if (nodeRank >= nnodes) throw new UsageError(`--node-rank ${nodeRank} must be below --nnodes ${nnodes}`);
  const masterAddrs = (raw.masterAddr ?? DEFAULT_MASTER_ADDR).split(',');
  if (masterAddrs.some((a) => a.trim() === '' || /\s/.test(a))) {
    throw new UsageError(`--master-addr ${JSON.stringify(raw.masterAddr)}: expected a host name or address, or a list of them (A,B,C)`);
  }
  if (masterAddrs.length > 1 && minNodes === nnodes) {
    throw new UsageError(`--master-addr ${raw.masterAddr}: a list of addresses is for an elastic job, whose node 0 moves when a host is lost; give --nnodes MIN:MAX, or one address`);
  }
  const masterAddr = masterAddrs[0]!;
  const maxRestarts = raw.maxRestarts === undefined ? 0 : parseInt('max-restarts', raw.maxRestarts, 0);
  const masterPort = raw.masterPort === undefined ? undefined : parseInt('master-port', raw.masterPort, 1, 65535);
  if (masterPort !== undefined && nnodes > 1 && masterPort + maxRestarts > 65535) {
    throw new UsageError(`--master-port ${masterPort} + --max-restarts ${maxRestarts} exceeds 65535 (attempt k uses port P + k on several nodes)`);
  }
  const backend = parseBackend(raw.backend, nnodes);
  return { nproc, nnodes, ...(minNodes < nnodes ? { minNodes } : {}), nodeRank, masterAddr, ...(masterAddrs.length > 1 ? { masterAddrs } : {}), masterPort, maxRestarts, backend, script, scriptArgs: argv.slice(i + 1) };
}

/** The collectives a launch of `--backend raw` runs ('auto': Open MPI on one host when installed, else Gloo). */
export function parseBackend(raw: string | undefined, nnodes: number): 'gloo' | 'mpi' {
  const b = raw ?? 'gloo';
  if (b !== 'gloo' && b !== 'mpi' && b !== 'auto') throw new UsageError(`--backend ${JSON.stringify(b)}: expected gloo, mpi or auto`);
  if (b === 'gloo' || (b === 'auto' && (nnodes > 1 || !mpiInstalled()))) return 'gloo';
  if (nnodes > 1) throw new UsageError('--backend mpi starts ranks on one node; across hosts run mpirun with a hostfile yourself (each rank picks MPI under mpirun), or use --backend gloo');
  if (!mpiInstalled()) throw new UsageError(`--backend mpi: Open MPI is not available here (${MPI_INSTALL_HINT})`);
  return 'mpi';
}

/**
 * `flotilla run`: parses argv (the arguments after `run`) and runs the ranks (launch()); resolves
 * to the exit code, 2 for a usage error or a bad FLOTILLA_* variable.
 */
export async function runLauncher(argv: readonly string[], ioOpts: LauncherIO = {}): Promise<number> {
  const stdout = ioOpts.stdout ?? process.stdout;
  const stderr = ioOpts.stderr ?? process.stderr;
  try {
    checkFlotillaEnv(); // a bad FLOTILLA_* value: one line here, not a failure in every rank
  } catch (e) {
    if ((e as Error).name !== 'LaunchEnvError') throw e;
    stderr.write(`flotilla run: ${(e as Error).message}\n`);
    return 2;
  }
  let o: RunOptions;
  try {
    o = parseRunArgs(argv[0] === 'run' ? argv.slice(1) : argv);
  } catch (e) {
    if (!(e instanceof UsageError)) throw e;
    if (e.help) {
      stdout.write(`${RUN_USAGE}\n`);
      return 0;
    }
    stderr.write(`flotilla run: ${e.message}\n\n${RUN_USAGE}\n`);
    return 2;
  }
  return launch(o, ioOpts);
}

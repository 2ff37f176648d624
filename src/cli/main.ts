// The `flotilla` command: train from a TOML config (on one process or, with --nproc, through the
// launcher), run any script on N ranks, and print the documented config.
import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { resolve } from 'node:path';
// Only the error class at load time: the config reads the model registry, which loads the addon,
// whose FLOTILLA_* settings main() checks first (the commands import the config when they run).
import { ConfigError } from '../config/error.js';
import { LaunchEnvError } from '../distributed/env.js';
import { UsageError, parseNnodes } from './usage.js';

const MAIN = fileURLToPath(import.meta.url);

export const USAGE = `flotilla — distributed training for TypeScript

usage:
  flotilla train <config.toml> [--nproc N] [--resume [PATH|latest]] [--max-restarts K] [--section.field=value ...]
                 [--nnodes M --node-rank R --master-addr A --master-port P]
      Train the model a config describes. --resume continues a run from its newest checkpoint (or
      the checkpoint PATH names), under this config's layout; --max-restarts K restarts a failed
      group up to K times, each from the latest checkpoint. --nproc N (N > 1) starts N local ranks through the
      launcher (data parallel; through mpirun on Open MPI when installed, see parallel.backend). Overrides win over the file, e.g. --optim.lr=3e-4 --train.steps=50.
      --nnodes M: the same run on M hosts, N ranks each (Gloo), with the rules of \`flotilla run\`
      across hosts (FLOTILLA_JOB_SECRET, the interface, the heartbeat); start it on every host
      with its own --node-rank. Rank 0 (node 0) keeps the run directory. --nnodes MIN:MAX: when
      a host is lost and MIN remain, the others carry on without it from the newest checkpoint; a
      host started later with the job's command (or started again) joins at the next checkpoint, and
      --master-addr A,B,C lists where it may find node 0 by then (each tried in turn).
  flotilla verify <config.toml> --nproc N [--steps K] [--section.field=value ...]
  flotilla verify <config.toml> --nproc N --resume K [--steps S] [--then [--nproc M] [--section.field=value ...]]
      With --resume: train S steps (default 2K) saving at step K, resume that checkpoint (under the
      layout after --then, or the same one) and compare steps K+1..S: bit-identical for the same
      layout, within 1e-5 (parameters 1e-4) for another; PASS or FAIL as above.
      Train K steps (default 5) under the config's layout on N ranks and the same steps in one
      process on the same global batches; print per-step loss and grad-norm differences, the largest
      parameter difference, and PASS or FAIL (exit status 0 or 1) against the stated tolerance.
  flotilla run --nproc N <script.ts|script.js> [args ...]
      Start N ranks of a script with the launch environment (RANK, WORLD_SIZE, MASTER_ADDR, ...);
      run \`flotilla run --help\` for the launcher's options.
  flotilla config [config.toml] [--section.field=value ...]
      Print the resolved config with every field documented (the defaults without a file).
  flotilla schedule --pp P --micro M --schedule gpipe|1f1b|interleaved|zb [--virtual V] [--actions]
      Print a pipeline schedule as a grid (ranks x time, '.' = idle) after checking it, with its
      simulated bubble fraction and the theory; --actions also lists each rank's sends and receives.
  flotilla export <checkpoint|run dir> <out.safetensors>
      Write the model's parameters as one safetensors file (PyTorch and Hugging Face read it), the
      model config in its metadata.
  flotilla export <checkpoint|run dir> <out dir> --format hf [--dtype bf16|fp32] [--max-shard-size 5GB]
      Write a Hugging Face directory transformers loads (GPT2LMHeadModel, LlamaForCausalLM):
      config.json, safetensors (sharded with an index above the size), the run's tokenizer.json.
  flotilla generate <checkpoint|run dir|exported.safetensors|hf dir> --prompt TEXT [--prompt TEXT ...]
                    [--tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--ignore-eos] [--out FILE]
      Sample text from a trained model in one process, every prompt in one batch with a key/value
      cache; a continuation stops at the tokenizer's end-of-text unless --ignore-eos (deterministic
      for a seed).
  flotilla checkpoint check <checkpoint|run dir> [the same on other hosts ...]
      Verify a checkpoint's files, sizes, checksums and completeness without building a model;
      several directories: one checkpoint saved without shared storage, across the hosts' directories.
  flotilla report RUN [RUN...] [--out FILE]
      Write RUN/report.html: charts of loss, validation loss, learning rate, gradient norm and
      tokens/s against step (several runs overlaid), the resolved config, layout, checkpoints and
      sample. \`flotilla train\` writes it at the end of every run.
  flotilla prepare SOURCES... --tokenizer byte|gpt2|tokenizer.json --out DIR [--field text] [--workers N] [--skip-bad]
      Tokenize text files, directories, .jsonl and parquet into token shards with document indexes
      and a manifest, in parallel; a re-run skips finished shards. Train on DIR with data.source.
  flotilla tokenizer train --vocab N FILES... --out tokenizer.json
      Learn a byte-level BPE of N ids from text or .jsonl files ("moby-dick" names the demo corpus).
  flotilla --help | --version

example:
  flotilla train examples/gpt-tiny.toml --nproc 2`;


function version(): string {
  const pkg = JSON.parse(readFileSync(resolve(MAIN, '..', '..', '..', 'package.json'), 'utf8')) as { version: string };
  return pkg.version;
}

interface TrainArgs {
  config: string;
  nproc?: number;
  /** --resume: 'latest' or a checkpoint path. */
  resume?: string;
  /** --max-restarts K (train through the launcher). */
  maxRestarts?: number;
  overrides: string[];
  /** `flotilla verify` sets it: every rank records its steps and final parameters there. */
  record?: string;
  /** `verify` only: steps to compare. */
  steps?: number;
  /** `train --nnodes M ...`: the hosts of the job (flotilla run's options, passed on to the launcher). */
  hosts?: HostArgs;
}

/** Where this host stands in a multi-host `flotilla train` (flotilla run's meaning for each). */
interface HostArgs {
  nnodes: number;
  /** --nnodes MIN:MAX: carry on without a lost host while MIN remain. */
  minNodes?: number;
  nodeRank: number;
  masterAddr?: string;
  masterPort?: number;
}

const HOST_FLAGS = ['--nnodes', '--node-rank', '--master-addr', '--master-port'] as const;

function parseNproc(v: string | undefined): number {
  if (v === undefined || !/^\d+$/.test(v) || Number(v) < 1) {
    throw new UsageError(`--nproc needs a positive integer, got ${v === undefined ? 'nothing' : JSON.stringify(v)} (e.g. --nproc 2)`);
  }
  return Number(v);
}

/** Splits `train` arguments into the config path, --nproc and the --section.field overrides. */
export function parseTrainArgs(args: readonly string[], command = 'train'): TrainArgs {
  let config: string | undefined;
  let nproc: number | undefined;
  let record: string | undefined;
  let steps: number | undefined;
  let resume: string | undefined;
  let maxRestarts: number | undefined;
  const host: Partial<Record<(typeof HOST_FLAGS)[number], string>> = {};
  const overrides: string[] = [];
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    const hostFlag = command === 'train' ? HOST_FLAGS.find((f) => a === f || a.startsWith(`${f}=`)) : undefined;
    if (hostFlag !== undefined) {
      const v = a === hostFlag ? args[++i] : a.slice(hostFlag.length + 1);
      if (v === undefined || v === '') throw new UsageError(`${hostFlag} needs a value`);
      host[hostFlag] = v;
    } else if (a === '--record' && command === 'train') {
      record = args[++i];
      if (record === undefined) throw new UsageError('--record needs a directory');
    } else if ((a === '--steps' || a.startsWith('--steps=')) && command === 'verify') {
      const v = a === '--steps' ? args[++i] : a.slice('--steps='.length);
      if (v === undefined || !/^\d+$/.test(v) || Number(v) < 1) throw new UsageError(`--steps needs a positive integer, got ${v === undefined ? 'nothing' : JSON.stringify(v)}`);
      steps = Number(v);
    } else if (a === '--resume' || a.startsWith('--resume=')) {
      // The path is optional: `--resume` alone (or followed by another option) means the latest.
      const next = args[i + 1];
      resume = a.startsWith('--resume=') ? a.slice('--resume='.length) || 'latest'
        : next !== undefined && !next.startsWith('--') && !next.endsWith('.toml') ? (i++, next) : 'latest';
    } else if ((a === '--max-restarts' || a.startsWith('--max-restarts=')) && command === 'train') {
      const v = a === '--max-restarts' ? args[++i] : a.slice('--max-restarts='.length);
      if (v === undefined || !/^\d+$/.test(v)) throw new UsageError(`--max-restarts needs a whole number, got ${v === undefined ? 'nothing' : JSON.stringify(v)}`);
      maxRestarts = Number(v);
    } else if (a === '--nproc' || a === '--nproc-per-node') {
      nproc = parseNproc(args[++i]);
    } else if (a.startsWith('--nproc=') || a.startsWith('--nproc-per-node=')) {
      nproc = parseNproc(a.slice(a.indexOf('=') + 1));
    } else if (/^--[A-Za-z0-9_]+\.[A-Za-z0-9_]+=/s.test(a)) {
      overrides.push(a);
    } else if (/^--[A-Za-z0-9_]+\.[A-Za-z0-9_]+$/.test(a)) {
      const v = args[i + 1];
      if (v === undefined || v.startsWith('--')) throw new UsageError(`${a} needs a value: write ${a}=value`);
      overrides.push(`${a}=${v}`);
      i++;
    } else if (a.startsWith('-')) {
      throw new UsageError(`${command}: unknown option ${a}; options are --nproc N${command === 'verify' ? ', --steps K' : ''} and --section.field=value overrides (see flotilla --help)`);
    } else if (config === undefined) {
      config = a;
    } else {
      throw new UsageError(`train: one config file expected, got ${JSON.stringify(config)} and ${JSON.stringify(a)}`);
    }
  }
  if (config === undefined) throw new UsageError('train: missing the config file: flotilla train <config.toml> (e.g. examples/gpt-tiny.toml)');
  const hosts = parseHostArgs(host);
  return { config, overrides, ...(hosts !== undefined ? { hosts } : {}), ...(nproc !== undefined ? { nproc } : {}), ...(resume !== undefined ? { resume } : {}), ...(maxRestarts !== undefined ? { maxRestarts } : {}), ...(record !== undefined ? { record } : {}), ...(steps !== undefined ? { steps } : {}) };
}

/** --nnodes and its companions; undefined for a one-host run. Values are checked again by the launcher. */
function parseHostArgs(h: Partial<Record<(typeof HOST_FLAGS)[number], string>>): HostArgs | undefined {
  const count = (flag: string, v: string, min: number): number => {
    if (!/^\d+$/.test(v) || Number(v) < min) throw new UsageError(`train: ${flag} needs a whole number >= ${min}, got ${JSON.stringify(v)}`);
    return Number(v);
  };
  if (h['--nnodes'] === undefined) {
    const stray = HOST_FLAGS.filter((f) => h[f] !== undefined);
    if (stray.length > 0) throw new UsageError(`train: ${stray.join(', ')} ${stray.length > 1 ? 'go' : 'goes'} with --nnodes M (the hosts of the job)`);
    return undefined;
  }
  const { nnodes, minNodes } = parseNnodes(h['--nnodes'], (m) => new UsageError(`train: ${m}`)); // flotilla run's grammar
  if (nnodes === 1) return undefined;
  if (h['--node-rank'] === undefined) throw new UsageError(`train: --nnodes ${nnodes} needs --node-rank R (this host's index, 0..${nnodes - 1})`);
  const nodeRank = count('--node-rank', h['--node-rank'], 0);
  if (nodeRank >= nnodes) throw new UsageError(`train: --node-rank ${nodeRank} must be below --nnodes ${nnodes}`);
  return {
    nnodes, nodeRank, ...(minNodes !== undefined ? { minNodes } : {}),
    ...(h['--master-addr'] !== undefined ? { masterAddr: h['--master-addr'] } : {}),
    ...(h['--master-port'] !== undefined ? { masterPort: count('--master-port', h['--master-port'], 1) } : {}),
  };
}

async function trainCommand(args: readonly string[]): Promise<number> {
  const a = parseTrainArgs(args);
  const { readLaunchEnv, checkFlotillaEnv } = await import('../distributed/env.js');
  checkFlotillaEnv(); // first: the ranks' addon reads these settings when it loads
  const { checkRunnable, loadConfig } = await import('../config/index.js');
  const cfg = loadConfig(a.config, a.overrides); // every rank and the launching process validate first
  const env = readLaunchEnv();
  const inWorld = env.source !== 'single';
  const hosts = a.hosts;
  if (hosts !== undefined && inWorld) throw new UsageError(`train: --nnodes given inside a world already started by ${env.source}; drop --nnodes`);
  // Rank 0 runs on node 0: only there does the run directory (and a checkpoint to resume) have to be.
  // With a list of master addresses node 0 may be a host returning to a job that runs elsewhere now
  // (it comes in as another node): then rank 0 checks, wherever it runs.
  if (!inWorld && (hosts === undefined || (hosts.nodeRank === 0 && !hosts.masterAddr?.includes(',')))) {
    // Before any rank starts: an earlier run's directory is refused once, here (rank 0 checks again).
    // Resuming continues an existing run directory; a checkpoint PATH may also start a new one.
    // The run record and the checkpoint format load no tensor code: the launcher never loads the addon.
    const { resumeTarget, runDirOf, runDirProblem } = await import('../train/run_record.js');
    const problem = runDirProblem(cfg, { resume: a.resume !== undefined && existsSync(runDirOf(cfg)) });
    if (problem !== undefined) throw new ConfigError([problem], a.config);
    if (a.resume !== undefined) {
      // A missing or broken checkpoint is one message here, before any rank starts.
      const { readMeta } = await import('../checkpoint/format.js');
      // Across hosts without shared storage this host may hold only part of it (the ranks gather the rest).
      readMeta(resumeTarget(cfg, a.resume)!, { partial: hosts !== undefined });
    }
  }
  if (((a.nproc !== undefined && a.nproc > 1) || hosts !== undefined) && !inWorld) {
    const nproc = a.nproc ?? 1;
    const problems = checkRunnable(cfg, nproc * (hosts?.nnodes ?? 1));
    if (problems.length > 0) throw new ConfigError(problems, a.config);
    const { runLauncher } = await import('./run.js');
    // [parallel] backend: "auto" picks Open MPI where it is installed (ranks start through mpirun);
    // across hosts the ranks meet over Gloo ("auto" is Gloo there).
    if (hosts !== undefined && cfg.parallel.backend === 'mpi') {
      throw new UsageError(`train: --nnodes ${hosts.nnodes} trains over Gloo across hosts; set [parallel] backend = "gloo" or "auto" (--parallel.backend=gloo)`);
    }
    if (hosts?.minNodes !== undefined && cfg.checkpoint.every === 0) {
      throw new UsageError(`train: --nnodes ${hosts.minNodes}:${hosts.nnodes} carries on from the newest checkpoint when a host is lost; set [checkpoint] every (e.g. --checkpoint.every=100)`);
    }
    const backend = hosts !== undefined ? 'gloo' : cfg.parallel.backend;
    const hostArgs = hosts === undefined ? [] : [
      '--nnodes', hosts.minNodes !== undefined ? `${hosts.minNodes}:${hosts.nnodes}` : String(hosts.nnodes), '--node-rank', String(hosts.nodeRank),
      ...(hosts.masterAddr !== undefined ? ['--master-addr', hosts.masterAddr] : []), ...(hosts.masterPort !== undefined ? ['--master-port', String(hosts.masterPort)] : []),
    ];
    return runLauncher([
      '--nproc', String(nproc), ...hostArgs, '--backend', backend, ...(a.maxRestarts !== undefined ? ['--max-restarts', String(a.maxRestarts)] : []),
      MAIN, 'train', a.config, ...a.overrides, ...(a.record ? ['--record', a.record] : []), ...(a.resume !== undefined ? [`--resume=${a.resume}`] : []),
    ]);
  }
  if (a.nproc !== undefined && inWorld && a.nproc !== env.worldSize) {
    throw new UsageError(`train: --nproc ${a.nproc} given inside a world of ${env.worldSize} ranks already started by ${env.source}; drop --nproc`);
  }
  const { train } = await import('../train/trainer.js');
  // Rank 0 draws RUN/report.html from metrics.jsonl when the run ends, however it ends, once the run
  // holds its directory (a refused directory is left as it was). FLOTILLA_REPORT=0 skips it (about
  // half a second of CPU): the tests do, except those of the report.
  const reportEnv = process.env.FLOTILLA_REPORT?.trim();
  if (reportEnv && reportEnv !== '0' && reportEnv !== '1') {
    throw new LaunchEnvError(`FLOTILLA_REPORT=${JSON.stringify(process.env.FLOTILLA_REPORT)} must be 1 (write RUN/report.html when the run ends, the default) or 0 (do not)`);
  }
  let report: { finish(): Promise<void> } | undefined;
  const onRunDir = async (dir: string): Promise<void> => {
    if (reportEnv === '0') return;
    const { watchRun } = await import('../report/watch.js');
    report = watchRun(dir, (l) => { if (cfg.log.progress !== 'off') process.stdout.write(`[report] ${l}\n`); });
  };
  try {
    const summary = await train(cfg, { configPath: a.config, overrides: a.overrides, onRunDir, ...(a.record ? { recordDir: a.record } : {}), ...(a.resume !== undefined ? { resume: a.resume } : {}) });
    // [log] sampleTokens: rank 0 samples from the last checkpoint, before the report is drawn.
    if (env.rank === 0 && cfg.log.sampleTokens > 0 && summary.checkpoint !== undefined && summary.runDir !== '') {
      const { generate } = await import('./checkpoint.js');
      const [s] = await generate(summary.checkpoint, { prompts: [cfg.log.samplePrompt], tokens: cfg.log.sampleTokens, temperature: 0.8, topK: 40, topP: 1, seed: cfg.train.seed, ignoreEos: false });
      const text = `${s!.prompt}${s!.text}`;
      writeFileSync(resolve(summary.runDir, 'sample.txt'), `${text}\n`);
      if (cfg.log.progress !== 'off') process.stdout.write(`[sample] ${cfg.log.sampleTokens} tokens from ${summary.checkpoint} (${resolve(summary.runDir, 'sample.txt')}):\n${text}\n`);
    }
  } finally {
    await report?.finish(); // never throws: a report that cannot be written is one printed line
  }
  return 0;
}

async function configCommand(args: readonly string[]): Promise<number> {
  const { configToToml, defaultConfig, loadConfig, parseConfig } = await import('../config/index.js');
  const file = args[0] !== undefined && !args[0].startsWith('--') ? args[0] : undefined;
  const overrides = file === undefined ? args : args.slice(1);
  const cfg = file !== undefined ? loadConfig(file, overrides) : overrides.length > 0 ? parseConfig('', overrides, 'overrides') : defaultConfig();
  process.stdout.write(configToToml(cfg, { header: file ? `Resolved from ${file}${overrides.length ? ` ${overrides.join(' ')}` : ''}` : 'flotilla defaults' }));
  return 0;
}

interface ScheduleArgs {
  pp: number;
  micro: number;
  schedule: string;
  virtual?: number;
  actions: boolean;
}

/** Parses `schedule` arguments: --pp P --micro M --schedule S [--virtual V] [--actions]. */
export function parseScheduleArgs(args: readonly string[]): ScheduleArgs {
  const vals: Record<string, string> = {};
  let actions = false;
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    const m = /^--(pp|micro|schedule|virtual)(?:=(.*))?$/s.exec(a);
    if (a === '--actions') {
      actions = true;
    } else if (m !== null) {
      const v = m[2] ?? args[++i];
      if (v === undefined || v === '') throw new UsageError(`schedule: --${m[1]} needs a value (e.g. --${m[1]} ${m[1] === 'schedule' ? '1f1b' : '4'})`);
      vals[m[1]!] = v;
    } else {
      throw new UsageError(`schedule: unknown argument ${a}; usage: flotilla schedule --pp P --micro M --schedule gpipe|1f1b|interleaved|zb [--virtual V] [--actions]`);
    }
  }
  const count = (k: string): number | undefined => {
    const v = vals[k];
    if (v === undefined) return undefined;
    if (!/^\d+$/.test(v) || Number(v) < 1) throw new UsageError(`schedule: --${k} needs a positive integer, got ${JSON.stringify(v)}`);
    return Number(v);
  };
  const pp = count('pp');
  const micro = count('micro');
  const virtual = count('virtual');
  const schedule = vals.schedule;
  if (pp === undefined || micro === undefined || schedule === undefined) {
    throw new UsageError('schedule: --pp, --micro and --schedule are required, e.g. flotilla schedule --pp 4 --micro 8 --schedule 1f1b');
  }
  return { pp, micro, schedule, actions, ...(virtual !== undefined ? { virtual } : {}) };
}

async function scheduleCommand(args: readonly string[]): Promise<number> {
  const a = parseScheduleArgs(args);
  const ps = await import('../parallel/pipeline/schedule.js');
  if (!(ps.SCHEDULE_NAMES as readonly string[]).includes(a.schedule)) {
    throw new UsageError(`schedule: unknown schedule ${JSON.stringify(a.schedule)}; schedules are ${ps.SCHEDULE_NAMES.join(', ')}`);
  }
  const name = a.schedule as import('../parallel/pipeline/schedule.js').ScheduleName;
  let s;
  try {
    s = ps.buildSchedule(name, { pp: a.pp, micro: a.micro, ...(a.virtual !== undefined ? { virtualStages: a.virtual } : {}) });
  } catch (e) {
    throw new UsageError(`schedule: ${(e as Error).message}`);
  }
  ps.validateSchedule(s);
  process.stdout.write(ps.describeSchedule(s, { actions: a.actions }));
  return 0;
}

/** Runs the command line; resolves to the exit code. */
export async function main(argv: readonly string[]): Promise<number> {
  const [cmd, ...rest] = argv;
  try {
    switch (cmd) {
      case undefined:
        process.stderr.write(`${USAGE}\n`);
        return 2;
      case '-h':
      case '--help':
      case 'help':
        process.stdout.write(`${USAGE}\n`);
        return 0;
      case '-v':
      case '--version':
        process.stdout.write(`flotilla ${version()}\n`);
        return 0;
      case 'train':
        if (rest.includes('--help') || rest.includes('-h')) {
          process.stdout.write(`${USAGE}\n`);
          return 0;
        }
        return await trainCommand(rest);
      case 'run': {
        const { runLauncher } = await import('./run.js');
        return await runLauncher([...rest]);
      }
      case 'config':
        return await configCommand(rest);
      case 'verify': {
        if (rest.includes('--help') || rest.includes('-h')) {
          process.stdout.write(`${USAGE}\n`);
          return 0;
        }
        // `--then ...`: the layout a `verify --resume K` run resumes under.
        const cut = rest.indexOf('--then');
        const a = parseTrainArgs(cut >= 0 ? rest.slice(0, cut) : rest, 'verify');
        if (a.resume !== undefined) {
          const k = Number(a.resume);
          if (!Number.isInteger(k) || k < 1) throw new UsageError(`verify: --resume needs the step to save and resume at (a whole number >= 1), got ${JSON.stringify(a.resume)}`);
          if (a.nproc === undefined) throw new UsageError('verify --resume: give the rank count with --nproc N');
          let then: { nproc: number; overrides: string[] } | undefined;
          if (cut >= 0) {
            const t = parseTrainArgs([a.config, ...rest.slice(cut + 1)], 'verify');
            then = { nproc: t.nproc ?? a.nproc, overrides: t.overrides };
          }
          const { verifyResumeCommand } = await import('./verify_resume.js');
          return await verifyResumeCommand({ config: a.config, nproc: a.nproc, steps: a.steps ?? 2 * k, resumeAt: k, overrides: a.overrides, ...(then ? { then } : {}) }, MAIN, (l) => process.stdout.write(`${l}\n`));
        }
        if (cut >= 0) throw new UsageError('verify: --then goes with --resume K');
        if (a.nproc === undefined || a.nproc < 2) throw new UsageError('verify: give the layout\'s rank count with --nproc N (N >= 2), e.g. flotilla verify examples/gpt-tiny.toml --nproc 2 --parallel.zero=3');
        const { verifyCommand } = await import('./verify.js');
        return await verifyCommand({ config: a.config, nproc: a.nproc, steps: a.steps ?? 5, overrides: a.overrides }, MAIN, (l) => process.stdout.write(`${l}\n`));
      }
      case 'schedule':
        return await scheduleCommand(rest);
      case 'prepare':
        return await (await import('./prepare.js')).prepareCommand(rest);
      case 'tokenizer':
        return await (await import('./tokenizer.js')).tokenizerCommand(rest);
      case 'report': {
        const { reportCommand } = await import('./report.js');
        return await reportCommand(rest, (l) => process.stdout.write(`${l}\n`));
      }
      case 'export':
      case 'generate':
      case 'checkpoint': {
        const c = await import('./checkpoint.js');
        const print = (l: string) => process.stdout.write(`${l}\n`);
        if (cmd === 'export') return c.exportCommand(rest, print);
        if (cmd === 'checkpoint') return c.checkpointCommand(rest, print);
        return await c.generateCommand(rest, print);
      }
      default:
        throw new UsageError(`unknown command ${JSON.stringify(cmd)}; commands: train, verify, run, config, schedule, prepare, tokenizer, export, generate, checkpoint, report (see flotilla --help)`);
    }
  } catch (e) {
    const err = e as Error;
    if (err instanceof UsageError || err instanceof ConfigError || err instanceof LaunchEnvError) {
      process.stderr.write(`flotilla: ${err.message}\n`);
      return 2;
    }
    process.stderr.write(`flotilla: ${process.env.FLOTILLA_DEBUG ? err?.stack ?? String(e) : err?.message ?? String(e)}\n`);
    return 1;
  }
}

// Run when executed directly (node --import tsx src/cli/main.ts ...), not when imported (bin/, tests).
if (process.argv[1] !== undefined && import.meta.url === pathToFileURL(resolve(process.argv[1])).href) {
  process.exit(await main(process.argv.slice(2)));
}

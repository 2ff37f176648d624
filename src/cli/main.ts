// The `flotilla` command: train from a TOML config (on one process or, with --nproc, through the
// launcher), run any script on N ranks, and print the documented config.
import { existsSync, readFileSync } from 'node:fs';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { resolve } from 'node:path';
// Only the error class at load time: the config reads the model registry, which loads the addon,
// whose FLOTILLA_* settings main() checks first (the commands import the config when they run).
import { ConfigError } from '../config/error.js';
import { LaunchEnvError } from '../distributed/env.js';
import { slurmRestarted } from '../distributed/slurm_vars.js';
import { UsageError } from './usage.js';
import { parseTrainArgs, verifyLayouts } from './train_args.js';
import { prepareRunData, trainHere } from './train_run.js';

const MAIN = fileURLToPath(import.meta.url);

export const USAGE = `flotilla — distributed training for TypeScript

usage:
  flotilla train <config.toml> [--nproc N] [--plan] [--resume [PATH|latest]] [--max-restarts K] [--section.field=value ...]
                 [--nnodes M --node-rank R --master-addr A --master-port P]
      Train the model a config describes. --resume continues a run from its newest checkpoint (or
      the checkpoint PATH names), under this config's layout; --max-restarts K restarts a failed
      group up to K times, each from the latest checkpoint. --nproc N (N > 1) starts N local ranks through the
      launcher (data parallel; through mpirun on Open MPI when installed, see parallel.backend). Overrides win over the file, e.g. --optim.lr=3e-4 --train.steps=50.
      --plan (or [parallel] auto = true): train with the layout \`flotilla plan\` ranks first, and say which.
      --nnodes M: the same run on M hosts, N ranks each (Gloo), with the rules of \`flotilla run\`
      across hosts (FLOTILLA_JOB_SECRET, the interface, the heartbeat); start it on every host
      with its own --node-rank. Rank 0 (node 0) keeps the run directory. --nnodes MIN:MAX: when
      a host is lost and MIN remain, the others carry on without it from the newest checkpoint; a
      host started later with the job's command (or started again) joins at the next checkpoint, and
      --master-addr A,B,C lists where it may find node 0 by then (each tried in turn).
      In a Slurm job (\`srun flotilla train CONFIG --nproc N\`, one task per node) the nodes, this
      node's index, the master address and port come from the allocation; with one task per rank
      (\`srun -n W flotilla train CONFIG\`) each task is a rank. SIGUSR1 or SIGTERM on any rank saves
      a checkpoint after the current step and stops; [slurm] requeue = true then requeues the job,
      which resumes from that checkpoint (SLURM_RESTART_COUNT > 0).
  flotilla sbatch <config.toml> --nodes N --nproc K [--time T] [--partition P] [--job-name NAME] [--output FILE] [--submit] [--section.field=value ...]
      Print a Slurm batch script that trains the config on N nodes, K ranks each (#SBATCH --nodes,
      --ntasks-per-node=1, --signal=USR1@90, --open-mode=append, --requeue with [slurm] requeue,
      FLOTILLA_JOB_SECRET; its body \`srun flotilla train ...\`); --submit hands it to sbatch and
      prints the job id. More nodes than the partition has (sinfo) is an error.
  flotilla verify <config.toml> --nproc N [--steps K] [--section.field=value ...] [--and [--nproc M] [--section.field=value ...]] ...
      Train K steps (default 5) under the config's layout on N ranks and the same steps in one
      process on the same global batches; print per-step loss and grad-norm differences, the largest
      parameter difference, and PASS or FAIL (exit status 0 or 1) against the stated tolerance.
      Each --and adds a layout (the first one's overrides, then its own): layouts of one rank count
      train one after another in one world, and each is reported on its own.
  flotilla verify <config.toml> --nproc N --resume K [--steps S] [--then [--nproc M] [--section.field=value ...]]
      With --resume: train S steps (default 2K) saving at step K, resume that checkpoint (under the
      layout after --then, or the same one) and compare steps K+1..S: bit-identical for the same
      layout, within 1e-5 (parameters 1e-4) for another; PASS or FAIL as above.
  flotilla plan <config.toml> --nproc N [--nnodes M] [--memory GiB] [--json] [--top K] [--measure K] [--rounds K] [--section.field=value ...]
      Which layouts the config's model can take on N ranks per host (x M hosts): data parallel,
      ZeRO 0-3, HSDP, pipeline schedules, tensor (+ sequence), context and expert parallelism,
      micro-batches, activation checkpointing, precision. Predicts each rank's peak memory and the
      step time from a short calibration on this machine (cached), ranks them by step time, marks
      what does not fit in --memory GiB per rank (default: this machine's memory over N), and
      prints the flags that select each. Flags of layout fields pin them. --json: every layout as
      JSON; --measure K: train the first K that fit for a few steps and print measured beside
      predicted. --rounds K (default 3): each measurement is K fresh launches and their median,
      since one process can run the whole of its life slower than the next (measurements already
      cached are kept). Collectives across hosts are not measured here (step times marked >=).
      \`flotilla train --plan\` (or [parallel] auto = true) trains with the layout ranked first.
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
  flotilla export <checkpoint|run dir> <out dir> --format hf [--merge] [--dtype bf16|fp32] [--max-shard-size 5GB]
      Write a Hugging Face directory transformers loads (GPT2LMHeadModel, LlamaForCausalLM):
      config.json, safetensors (sharded with an index above the size), the run's tokenizer.json
      (with tokenizer_config.json, special_tokens_map.json, chat_template.jinja when beside it).
      A LoRA run's checkpoint needs --merge: its base (train.initFrom) with the adapters merged in,
      stored in the base's dtype unless --dtype says.
  flotilla export <LoRA checkpoint|run dir> <out dir> --format peft
      Write a LoRA run's adapters as a PEFT adapter (adapter_config.json, adapter_model.safetensors)
      that PEFT, transformers and vLLM load on the base; with the tokenizer the run read when
      data.tokenizer names a file or directory (and its chat template).
  flotilla generate <checkpoint|run dir|exported.safetensors|hf dir> [--adapter PEFT_DIR] [--chat] --prompt TEXT [--prompt TEXT ...]
                    [--chat-template model|chatml|FILE] [--tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--ignore-eos] [--out FILE]
      Sample text from a trained model in one process, every prompt in one batch with a key/value
      cache; a continuation stops at the tokenizer's end-of-text unless --ignore-eos (deterministic
      for a seed). A LoRA run's checkpoint samples its base with its adapters; --adapter puts a PEFT
      adapter's on the model given (unmerged). --chat puts each prompt in the chat template (the run's
      data.chatTemplate, a Hugging Face directory's own, or --chat-template) as a user's turn, stops at
      the end of the assistant's turn and prints the reply alone.
  flotilla checkpoint check <checkpoint|run dir> [the same on other hosts ...]
      Verify a checkpoint's files, sizes, checksums and completeness without building a model;
      several directories: one checkpoint saved without shared storage, across the hosts' directories.
  flotilla report RUN [RUN...] [--out FILE]
      Write RUN/report.html: charts of loss, validation loss, learning rate, gradient norm and
      tokens/s against step (several runs overlaid), the resolved config, layout, checkpoints and
      sample. \`flotilla train\` writes it at the end of every run.
  flotilla prepare SOURCES... --tokenizer byte|gpt2|tokenizer.json|HF_DIR --out DIR [--field text] [--workers N] [--skip-bad]
      Tokenize text files, directories, .jsonl and parquet into token shards with document indexes
      and a manifest, in parallel; a re-run skips finished shards. Train on DIR with data.source.
      --format chat|completion|preference [--chat-template model|chatml|FILE] [--train-on assistant|last|all]
      [--strict]: one JSON example a line, with a loss mask (the template renders chat; "model" is the
      --tokenizer directory's); a conversation without an assistant turn is skipped, or with --strict an error.
  flotilla tokenizer train --vocab N FILES... --out tokenizer.json
      Learn a byte-level BPE of N ids from text or .jsonl files ("moby-dick" names the demo corpus).
  flotilla --help | --version

example:
  flotilla train examples/gpt-tiny.toml --nproc 2`;


function version(): string {
  const pkg = JSON.parse(readFileSync(resolve(MAIN, '..', '..', '..', 'package.json'), 'utf8')) as { version: string };
  return pkg.version;
}

/** `train --plan` / [parallel] auto: the flags of the layout the planner ranks first, said on stdout. */
async function chooseLayout(config: string, overrides: readonly string[], nproc: number): Promise<string[]> {
  const { loadConfig } = await import('../config/index.js');
  const { plan, describePlanLayout, changedOverrides } = await import('../plan/plan.js');
  const cfg = loadConfig(config, overrides);
  const r = await plan(cfg, { config, overrides, nproc, nnodes: 1, log: (l) => process.stdout.write(`${l}\n`) });
  const best = r.rows.find((x) => x.fits);
  if (best === undefined) {
    throw new UsageError(`train --plan: ${r.rows.length === 0 ? `no layout of this model runs on ${nproc} rank(s) (see flotilla plan ${config} --nproc ${nproc})` : `no layout fits in ${r.memoryLimitMiB.toFixed(0)} MiB per rank; add ranks, or see flotilla plan ${config} --nproc ${nproc}`}`);
  }
  process.stdout.write(`[plan] training with the layout ranked first of ${r.rows.length}: ${describePlanLayout(best.layout)} (predicted ${best.stepMs.toFixed(0)} ms/step, peak ${best.peakMemoryMiB.toFixed(0)} MiB per rank): ${changedOverrides(cfg, best.layout).join(' ') || 'the config as it is'}\n`);
  return [...best.overrides, '--parallel.auto=false'];
}

async function trainCommand(args: readonly string[]): Promise<number> {
  const a = parseTrainArgs(args);
  const { readLaunchEnv, checkFlotillaEnv } = await import('../distributed/env.js');
  checkFlotillaEnv(); // first: the ranks' addon reads these settings when it loads
  const { checkRunnable, loadConfig } = await import('../config/index.js');
  let cfg = loadConfig(a.config, a.overrides); // every rank and the launching process validate first
  const env = readLaunchEnv();
  // [Note: slurm geometry] One srun task per node: this process is the node's launcher, not a rank.
  const { slurmNodeTask } = await import('../launch/slurm.js');
  const nodeTask = slurmNodeTask(process.env, a.nproc, a.hosts);
  const inWorld = env.source !== 'single' && nodeTask === undefined;
  const hosts = nodeTask !== undefined ? nodeTask.hosts : a.hosts;
  // A requeued Slurm job (SLURM_RESTART_COUNT > 0) resumes from its newest checkpoint by itself.
  if (a.resume === undefined && slurmRestarted()) {
    const { checkpointDirOf } = await import('../train/run_dir.js');
    const { listCheckpoints } = await import('../checkpoint/format.js');
    if (listCheckpoints(checkpointDirOf(cfg)).length > 0) a.resume = 'latest';
  }
  if ((a.plan || cfg.parallel.auto) && !inWorld) {
    // The planner chooses the layout before any rank starts; the ranks get its flags (auto off).
    if (hosts !== undefined) throw new UsageError(`train: ${a.plan ? '--plan' : '[parallel] auto = true'} with --nnodes ${hosts.nnodes}: every host would plan on its own; run \`flotilla plan ${a.config} --nproc ${a.nproc ?? 1} --nnodes ${hosts.nnodes}\` once and give its flags to every host's flotilla train`);
    const chosen = await chooseLayout(a.config, a.overrides, a.nproc ?? 1);
    a.overrides = [...a.overrides, ...chosen];
    cfg = loadConfig(a.config, a.overrides);
  } else if (cfg.parallel.auto && inWorld) {
    throw new UsageError('train: [parallel] auto = true inside a world already started: the planner chooses the layout before the ranks start; run flotilla train through its launcher (--nproc N), or set --parallel.auto=false');
  }
  if (hosts !== undefined && inWorld) throw new UsageError(`train: --nnodes given inside a world already started by ${env.source}; drop --nnodes`);
  // Rank 0 runs on node 0: only there does the run directory (and a checkpoint to resume) have to be.
  // With a list of master addresses node 0 may be a host returning to a job that runs elsewhere now
  // (it comes in as another node): then rank 0 checks, wherever it runs.
  if (!inWorld && (hosts === undefined || (hosts.nodeRank === 0 && !hosts.masterAddr?.includes(',')))) {
    // Before any rank starts: an earlier run's directory is refused once, here (rank 0 checks again).
    // Resuming continues an existing run directory; a checkpoint PATH may also start a new one.
    // The run directory and the checkpoint format load no tensor code: the launcher never loads the addon.
    const { resumeTarget, runDirOf, runDirProblem } = await import('../train/run_dir.js');
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
    await prepareRunData(cfg, a.config); // a .jsonl of examples, prepared once before the ranks start
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
  if (!inWorld) await prepareRunData(cfg, a.config);
  return await trainHere(a, cfg, env.rank);
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
      case 'sbatch':
        return await (await import('./sbatch.js')).sbatchCommand(rest);
      case 'train-series': // what verify starts on each rank (src/cli/train_run.ts); not for users
        return await (await import('./train_run.js')).trainSeriesCommand(rest);
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
        const andAt = rest.indexOf('--and');
        const a = parseTrainArgs(rest.slice(0, Math.min(...[cut, andAt, rest.length].filter((i) => i >= 0))), 'verify');
        if (andAt >= 0 && a.resume !== undefined) throw new UsageError('verify: --and (more layouts) does not go with --resume K; verify one resume at a time');
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
        const { verifyCommand } = await import('./verify.js');
        return await verifyCommand({ config: a.config, steps: a.steps ?? 5, layouts: verifyLayouts(rest) }, MAIN, (l) => process.stdout.write(`${l}\n`));
      }
      case 'schedule':
        return await scheduleCommand(rest);
      case 'plan': {
        if (rest.includes('--help') || rest.includes('-h')) {
          process.stdout.write(`${USAGE}\n`);
          return 0;
        }
        const { planCommand } = await import('./plan.js');
        return await planCommand(rest, (l) => process.stdout.write(`${l}\n`), (l) => process.stderr.write(`${l}\n`));
      }
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
        throw new UsageError(`unknown command ${JSON.stringify(cmd)}; commands: train, verify, run, config, schedule, plan, prepare, tokenizer, export, generate, checkpoint, report, sbatch (see flotilla --help)`);
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

// `flotilla train` on a rank (or in the one process of a single-process run), and a series of such
// runs in one world.
//
// A series (`flotilla train-series FILE`) is what `flotilla verify` starts on every rank: the
// `flotilla train` argument lists FILE holds, trained one after another in one world. Starting a
// world costs each rank a process (loading libtorch is most of a second of CPU) and a rendezvous;
// the layouts of one rank count that a verify compares, or a checkpoint and its resume, pay that
// once. Each run builds its mesh, data, model and optimizer from its own config and frees them
// before the next; only the world's process group is shared, so every run of a series must name
// the same backend. Rank 0 prints `[series] run i/n: ARGS` before each run (unless its log.progress
// is off), so that a series' output can be cut into its runs.
import { readFileSync, writeFileSync } from 'node:fs';
import { resolve } from 'node:path';
import type { FlotillaConfig } from '../config/schema.js';
import { LaunchEnvError } from '../distributed/env.js';
import { ConfigError } from '../config/error.js';
import { UsageError } from './usage.js';
import { parseTrainArgs, type TrainArgs } from './train_args.js';

/**
 * Before any rank starts (in the launching process): an example config's .jsonl sources are checked
 * and prepared into the cache ([Note: example sources] in src/data/example_source.ts). A bad line
 * or template is one ConfigError naming FILE:LINE; nothing a run would read is left behind.
 */
export async function prepareRunData(cfg: FlotillaConfig, configPath: string): Promise<void> {
  if (cfg.data.format === 'text') return;
  const { exampleDataProblems, prepareExampleSources } = await import('../data/example_source.js');
  const { explainPaths } = await import('../config/paths.js');
  const { checkDataConfig } = await import('../data/sources.js');
  // The data's own checks (the sources exist, the directories' sizes and tokenizer), then the examples'.
  const problems = explainPaths(cfg, [...checkDataConfig(cfg.data, cfg.model.vocabSize), ...exampleDataProblems(cfg.data)]);
  if (problems.length > 0) throw new ConfigError(problems, configPath);
  const quiet = cfg.log.progress === 'off';
  try {
    await prepareExampleSources(cfg.data, { print: (l) => { if (!quiet) process.stdout.write(`[data] ${l}\n`); } });
  } catch (e) {
    if ((e as Error).name === 'PrepareError') throw new ConfigError([(e as Error).message], configPath);
    throw e;
  }
}

/** Trains one run here, in a world this process already belongs to (or alone). */
export async function trainHere(a: TrainArgs, cfg: FlotillaConfig, rank: number): Promise<number> {
  // A .jsonl of examples is read from the directory it was prepared into (prepareRunData).
  if (cfg.data.format !== 'text') {
    const { resolveExampleSources } = await import('../data/example_source.js');
    try {
      resolveExampleSources(cfg.data);
    } catch (e) {
      throw new ConfigError([(e as Error).message], a.config);
    }
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
    if (rank === 0 && cfg.log.sampleTokens > 0 && summary.checkpoint !== undefined && summary.runDir !== '') {
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

/** A series file: the argument lists of `flotilla train`, each without the word `train`. */
export interface SeriesFile {
  runs: string[][];
}

/** Writes a series file for `flotilla train-series`. */
export function writeSeries(path: string, runs: string[][]): void {
  writeFileSync(path, `${JSON.stringify({ runs } satisfies SeriesFile)}\n`);
}

/** The marker rank 0 prints before run i (1-based) of n. */
export const seriesMarker = (i: number, n: number): string => `[series] run ${i}/${n}`;

/** `flotilla train-series FILE` on a rank: every run of FILE, in order, in one world; stops at the first failure. */
export async function trainSeriesCommand(args: readonly string[]): Promise<number> {
  if (args.length !== 1) throw new UsageError('train-series: give one series file (flotilla verify writes it)');
  let file: SeriesFile;
  try {
    file = JSON.parse(readFileSync(args[0]!, 'utf8')) as SeriesFile;
  } catch (e) {
    throw new UsageError(`train-series: cannot read ${args[0]}: ${(e as Error).message}`);
  }
  if (!Array.isArray(file.runs) || file.runs.length === 0 || !file.runs.every((r) => Array.isArray(r) && r.every((x) => typeof x === 'string'))) {
    throw new UsageError(`train-series: ${args[0]} must hold {"runs": [[config, args...], ...]} with at least one run`);
  }
  const runs = file.runs.map((r) => parseTrainArgs(r));
  for (const a of runs) {
    if (a.nproc !== undefined || a.hosts !== undefined || a.maxRestarts !== undefined) {
      throw new UsageError('train-series: a run of a series takes no --nproc, --nnodes or --max-restarts (the world is started once for all of them)');
    }
  }
  const { readLaunchEnv, checkFlotillaEnv } = await import('../distributed/env.js');
  checkFlotillaEnv();
  const { loadConfig } = await import('../config/index.js');
  const cfgs = runs.map((a) => loadConfig(a.config, a.overrides));
  if (cfgs.some((c) => c.parallel.auto)) throw new UsageError('train-series: [parallel] auto = true chooses a layout before the ranks start; give each run its layout (--parallel.auto=false)');
  const { initProcessGroup, destroyProcessGroup, resolveBackend } = await import('../distributed/process_group.js');
  // As this rank resolves them: "auto" is "mpi" under mpirun, so it shares a world with "mpi".
  const backends = new Set(cfgs.map((c) => resolveBackend(c.parallel.backend)));
  if (backends.size > 1) throw new UsageError(`train-series: the runs of one world share its backend; got ${cfgs.map((c) => c.parallel.backend).join(', ')}`);
  const env = readLaunchEnv();
  initProcessGroup({ backend: cfgs[0]!.parallel.backend });
  try {
    for (const [i, a] of runs.entries()) {
      if (env.rank === 0 && cfgs[i]!.log.progress !== 'off') process.stdout.write(`${seriesMarker(i + 1, runs.length)}: ${file.runs[i]!.join(' ')}\n`);
      await trainHere(a, cfgs[i]!, env.rank);
    }
  } finally {
    destroyProcessGroup();
  }
  return 0;
}

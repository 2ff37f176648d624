// `flotilla report`: a run directory (or several, overlaid) as one HTML page a person can open,
// written to RUN/report.html. The trainer writes it at the end of every run (watch.ts). Reading is
// tolerant of a killed run; the only file written is the report. Synchronous, so that a process
// that is exiting can still write it.
import { writeFileSync } from 'node:fs';
import { join, relative, resolve } from 'node:path';
import { parseConfig } from '../config/index.js';
import { describeLayout, describeMesh, resolveLayout } from '../parallel/layout.js';
import { renderReport, type RunExtras } from './html.js';
import { modelRules } from '../models/rules.js';
import { modelConfigOf } from '../config/schema.js';
import { loraCounts } from '../nn/lora_targets.js';
import { readRun, ReportError, type RunData } from './run.js';

export { ReportError, readRun, type RunData } from './run.js';

/** The layout in words from the resolved config and world size (undefined when it cannot be worked out). */
function layoutOf(run: RunData): string | undefined {
  if (run.configText === undefined || run.worldSize === undefined) return undefined;
  try {
    const cfg = parseConfig(run.configText, [], join(run.dir, 'config.toml'));
    const l = resolveLayout(cfg.parallel, run.worldSize);
    return `${describeLayout(l)}; ${describeMesh(l)}`;
  } catch {
    return undefined; // e.g. a config from another flotilla version: the config itself is shown
  }
}

/**
 * The run's trainable and frozen parameters in words, from the resolved config (a LoRA run trains
 * its adapters on a frozen base); undefined when they cannot be worked out.
 */
function parametersOf(run: RunData): string | undefined {
  if (run.configText === undefined) return undefined;
  try {
    const cfg = parseConfig(run.configText, [], join(run.dir, 'config.toml'));
    const rules = modelRules(cfg.model.arch), m = modelConfigOf(cfg);
    const total = rules.numParams(m);
    const n = (x: number): string => x.toLocaleString('en-US');
    if (cfg.lora.rank === 0) return `${n(total)} trainable, 0 frozen`;
    const linears = rules.linears?.(m);
    if (!linears) return `LoRA rank ${cfg.lora.rank}; ${n(total)} frozen`;
    const c = loraCounts(linears, cfg.lora, total);
    return `${n(c.trainable)} trainable (LoRA rank ${cfg.lora.rank} on ${c.modules} modules), ${n(c.frozen)} frozen`;
  } catch {
    return undefined;
  }
}

export interface ReportOptions {
  /** Where to write (default: report.html in the first run's directory). */
  out?: string;
  now?: Date;
}

/** Writes the report of one run, or of several overlaid; returns its path. Throws ReportError on bad input. */
export function writeReport(dirs: readonly string[], opts: ReportOptions = {}): string {
  if (dirs.length === 0) throw new ReportError('give at least one run directory, e.g. flotilla report runs/gpt-tiny');
  const runs = dirs.map((d) => readRun(d)); // every directory checked before anything is written
  // Overlaid runs are told apart by name; two runs of the same name by their directories.
  const counts = new Map<string, number>();
  for (const r of runs) counts.set(r.name, (counts.get(r.name) ?? 0) + 1);
  for (const r of runs) if (counts.get(r.name)! > 1) r.name = relative(process.cwd(), r.dir) || r.dir;
  const extras: RunExtras[] = runs.map((r) => {
    const layout = layoutOf(r), params = parametersOf(r);
    return { ...(layout !== undefined ? { layout } : {}), ...(params !== undefined ? { params } : {}) };
  });
  const out = resolve(opts.out ?? join(runs[0]!.dir, 'report.html'));
  writeFileSync(out, renderReport(runs, extras, opts.now ?? new Date()));
  return out;
}

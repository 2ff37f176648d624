// Reading a run directory for the report: what `flotilla train` left there (config.toml,
// metrics.jsonl, checkpoints/step-NNNNNN/, sample.txt), tolerant of a run that was killed mid-write.
// Nothing here writes.
import { existsSync, readFileSync, readdirSync, statSync } from 'node:fs';
import { basename, join, relative, resolve } from 'node:path';
import { parse as parseToml } from 'smol-toml';
import type { StepMetrics } from '../train/metrics.js';

/** A user error about the directories given (one message naming the fix; nothing written). */
export class ReportError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'ReportError';
  }
}

export interface CheckpointInfo {
  step: number;
  /** The checkpoint directory, relative to the run directory. */
  dir: string;
  bytes: number;
  files: number;
}

export interface RunData {
  /** How the run is named in charts and headings. */
  name: string;
  dir: string;
  /** config.toml as written by the trainer (the resolved config), if present. */
  configText?: string;
  config?: Record<string, unknown>;
  /** From the config's header line ("world size N"). */
  worldSize?: number;
  metricsFile: string;
  metrics: StepMetrics[];
  /** What was left out or missing, in words, shown at the top of the report. */
  notes: string[];
  checkpoints: CheckpointInfo[];
  sample?: string;
}

const SAMPLE_LIMIT = 20_000; // characters of sample.txt shown

function sizeOf(path: string): { bytes: number; files: number } {
  const st = statSync(path);
  if (!st.isDirectory()) return { bytes: st.size, files: 1 };
  let bytes = 0;
  let files = 0;
  for (const e of readdirSync(path)) {
    const s = sizeOf(join(path, e));
    bytes += s.bytes;
    files += s.files;
  }
  return { bytes, files };
}

/** metrics.jsonl rows; a line that is not a step's JSON (a killed run's last line) is left out and noted. */
export function parseMetrics(text: string, file: string, notes: string[]): StepMetrics[] {
  const lines = text.split('\n');
  const rows: StepMetrics[] = [];
  let lastIndex = lines.length - 1;
  while (lastIndex > 0 && lines[lastIndex]!.trim() === '') lastIndex--;
  lines.forEach((line, i) => {
    if (line.trim() === '') return;
    let row: unknown;
    try {
      row = JSON.parse(line);
    } catch {
      row = undefined;
    }
    const r = row as Partial<StepMetrics> | undefined;
    if (r !== undefined && r !== null && typeof r === 'object' && typeof r.step === 'number' && typeof r.loss === 'number') {
      rows.push(r as StepMetrics);
    } else if (i === lastIndex && !text.endsWith('\n')) {
      notes.push(`The last line of ${file} (line ${i + 1}) is cut short, as when a run is killed while writing it; the report shows the ${rows.length} complete step(s) before it.`);
    } else {
      notes.push(`Line ${i + 1} of ${file} is not a step's metrics; it is left out.`);
    }
  });
  return rows;
}

/** Reads a run directory; throws ReportError when `dir` is not one. */
export function readRun(dir: string): RunData {
  const abs = resolve(dir);
  if (!existsSync(abs)) throw new ReportError(`${dir} does not exist: pass a run directory (runs/<name>, as \`flotilla train\` prints)`);
  if (!statSync(abs).isDirectory()) throw new ReportError(`${dir} is not a directory: pass a run directory (runs/<name>), not a file in it`);
  const configPath = join(abs, 'config.toml');
  const notes: string[] = [];
  let configText: string | undefined;
  let config: Record<string, unknown> | undefined;
  let worldSize: number | undefined;
  if (existsSync(configPath)) {
    configText = readFileSync(configPath, 'utf8');
    try {
      config = parseToml(configText) as Record<string, unknown>;
    } catch (e) {
      notes.push(`config.toml does not parse (${(e as Error).message.split('\n')[0]}); it is shown as written.`);
    }
    const m = /world size (\d+)/.exec(configText.split('\n').slice(0, 3).join('\n'));
    if (m) worldSize = Number(m[1]);
  }
  const log = config?.log as { metrics?: unknown } | undefined;
  const metricsName = typeof log?.metrics === 'string' && log.metrics !== '' ? log.metrics : 'metrics.jsonl';
  const metricsPath = join(abs, metricsName);
  if (configText === undefined && !existsSync(metricsPath)) {
    throw new ReportError(`${dir} is not a run directory (it has no config.toml and no ${metricsName}): pass a directory \`flotilla train\` wrote, e.g. runs/<name>`);
  }
  let metrics: StepMetrics[] = [];
  if (existsSync(metricsPath)) {
    metrics = parseMetrics(readFileSync(metricsPath, 'utf8'), metricsName, notes);
    if (metrics.length === 0) notes.push(`${metricsName} holds no finished step yet.`);
  } else {
    notes.push(`There is no ${metricsName}: the run ended before its first step${log?.metrics === '' ? ' or was set not to write metrics (log.metrics = "")' : ''}.`);
  }
  const train = config?.train as { name?: unknown } | undefined;
  const name = typeof train?.name === 'string' && train.name !== '' ? train.name : basename(abs);

  const checkpoints: CheckpointInfo[] = [];
  const ckptRoot = join(abs, 'checkpoints');
  if (existsSync(ckptRoot) && statSync(ckptRoot).isDirectory()) {
    for (const e of readdirSync(ckptRoot).sort()) {
      const m = /^step-(\d+)$/.exec(e);
      const path = join(ckptRoot, e);
      if (m === null || !statSync(path).isDirectory()) continue;
      let step = Number(m[1]);
      const meta = join(path, 'meta.json');
      if (existsSync(meta)) {
        try {
          const s = (JSON.parse(readFileSync(meta, 'utf8')) as { step?: unknown }).step;
          if (typeof s === 'number') step = s;
        } catch {
          notes.push(`${relative(abs, meta)} is not JSON (an unfinished checkpoint?).`);
        }
      }
      checkpoints.push({ step, dir: relative(abs, path), ...sizeOf(path) });
    }
  }
  let sample: string | undefined;
  const samplePath = join(abs, 'sample.txt');
  if (existsSync(samplePath)) {
    const s = readFileSync(samplePath, 'utf8');
    sample = s.length > SAMPLE_LIMIT ? `${s.slice(0, SAMPLE_LIMIT)}\n[... ${s.length - SAMPLE_LIMIT} more characters in sample.txt]` : s;
  }
  return {
    name, dir: abs, metricsFile: metricsName, metrics, notes, checkpoints,
    ...(configText !== undefined ? { configText } : {}), ...(config !== undefined ? { config } : {}),
    ...(worldSize !== undefined ? { worldSize } : {}), ...(sample !== undefined ? { sample } : {}),
  };
}

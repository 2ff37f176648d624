// Input paths of a config made absolute, and where each relative one came from (for messages).
import { isAbsolute, resolve } from 'node:path';
import { MOBY_DICK } from '../data/corpus.js';
import type { FlotillaConfig, RawConfig } from './schema.js';

// [Note: config paths] A path a config names to read (the tokenizer, the sources, the validation
// source, the weights to start from, a LoRA adapter to continue) is resolved against the directory
// of the config file that wrote it, so a config and the files beside it work from any directory (an
// installed package's example, `flotilla train /some/where/run.toml`); a path given on the command line is resolved
// against the current directory, as a shell user expects. The resolved config holds them absolute,
// so the run's saved config.toml and its checkpoints still find them on --resume and in
// `flotilla generate` from anywhere. Outputs (train.runDir, checkpoint.dir) stay relative to the
// current directory: a shared config writes its runs where it is run.

/** The input path fields and the values that are names, not paths. */
const INPUT_PATHS: readonly { section: 'data' | 'train' | 'lora'; field: string; names: readonly string[] }[] = [
  { section: 'data', field: 'tokenizer', names: ['byte', 'gpt2'] },
  { section: 'data', field: 'source', names: [MOBY_DICK] },
  { section: 'data', field: 'valSource', names: ['', MOBY_DICK] },
  { section: 'data', field: 'chatTemplate', names: ['', 'model', 'chatml'] },
  { section: 'train', field: 'initFrom', names: [''] },
  { section: 'lora', field: 'adapter', names: [''] },
];

/** A relative input path, for messages about the absolute path it became. */
interface PathOrigin {
  resolved: string;
  /** How it was written and what it is relative to, e.g. `data.tokenizer = "bpe.json" in the config file (relative to its directory)`. */
  how: string;
}

/** Relative input paths of each parsed config, so later checks can say where a missing path came from. */
export const pathOrigins = new WeakMap<FlotillaConfig, PathOrigin[]>();

/** Makes the input paths absolute ([Note: config paths]); returns where the relative ones came from. */
export function resolveInputPaths(cfg: FlotillaConfig, fromCli: RawConfig, fileBase: string | undefined): PathOrigin[] {
  const origins: PathOrigin[] = [];
  // `said` is how the value was written: on the command line, or in the file (or text) as TOML.
  const one = (v: string, names: readonly string[], cli: boolean, said: { cli: string; toml: string }): string => {
    if (names.includes(v) || isAbsolute(v)) return v;
    const resolved = cli || fileBase === undefined ? resolve(v) : resolve(fileBase, v);
    const how = cli ? `${said.cli} (relative to the current directory)`
      : fileBase === undefined ? `${said.toml} (relative to the current directory)`
        : `${said.toml} in the config file (relative to its directory)`;
    origins.push({ resolved, how });
    return resolved;
  };
  for (const { section, field, names } of INPUT_PATHS) {
    const body = cfg[section] as unknown as Record<string, string>;
    const v = body[field]!;
    const key = `${section}.${field}`;
    body[field] = one(v, names, fromCli[section]?.[field] !== undefined, { cli: `--${key}=${v}`, toml: `${key} = ${JSON.stringify(v)}` });
  }
  const cli = fromCli.data?.sources !== undefined;
  cfg.data.sources = cfg.data.sources.map((e) => {
    const said = `the data.sources path ${JSON.stringify(e.path)}`;
    return { path: one(e.path, [MOBY_DICK], cli, { cli: said, toml: said }), weight: e.weight };
  });
  return origins;
}

/** Adds to each problem that names a resolved path the path as written (see [Note: config paths]). */
export function explainPaths(c: FlotillaConfig, problems: string[]): string[] {
  const origins = pathOrigins.get(c) ?? [];
  return problems.map((p) => {
    const o = origins.find((x) => p.includes(x.resolved));
    return o ? `${p} [${o.how}]` : p;
  });
}


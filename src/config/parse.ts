// Reading a config: TOML text and `--section.field=value` overrides (which win) over the schema's
// defaults, each value checked against its field, unknown names answered with a suggestion; and
// writing one back as documented TOML (the run's saved config.toml).
import { readFileSync, existsSync, statSync } from 'node:fs';
import { dirname, isAbsolute, resolve } from 'node:path';
import { parse as parseToml } from 'smol-toml';
import type { SourceEntry } from '../data/sources.js';
import { hfTokenizerDir, tokenizerIdentity } from '../data/tokenizer.js';
import { configSchema, fieldsOf, schemaDefaults, sections, type AnyField, type FlotillaConfig, type RawConfig } from './schema.js';
import { ConfigError } from './error.js';
import { explainPaths, pathOrigins, resolveInputPaths } from './paths.js';
import { validateConfig } from './validate.js';
import { applyInitFromModel, initFromModel, type InitFromModel } from './init_from.js';

function editDistance(a: string, b: string): number {
  const d = Array.from({ length: a.length + 1 }, (_, i) => [i, ...Array<number>(b.length).fill(0)]);
  for (let j = 1; j <= b.length; j++) d[0]![j] = j;
  for (let i = 1; i <= a.length; i++) {
    for (let j = 1; j <= b.length; j++) {
      d[i]![j] = Math.min(d[i - 1]![j]! + 1, d[i]![j - 1]! + 1, d[i - 1]![j - 1]! + (a[i - 1] === b[j - 1] ? 0 : 1));
    }
  }
  return d[a.length]![b.length]!;
}

function suggest(name: string, valid: string[]): string {
  const lower = name.toLowerCase();
  const limit = lower.length <= 4 ? 1 : 2;
  const hit = valid.find((v) => v.toLowerCase() === lower) ?? valid.find((v) => editDistance(v.toLowerCase(), lower) <= limit);
  return hit ? ` (did you mean ${hit}?)` : '';
}

function unknownSection(name: string, how: string): string {
  return `unknown section ${how}${suggest(name, sections)}; valid sections: ${sections.join(', ')}`;
}

function unknownField(section: string, name: string, how: string): string {
  const valid = Object.keys(fieldsOf(section)!);
  return `unknown key ${how}${suggest(name, valid)}; valid keys in [${section}]: ${valid.join(', ')}`;
}

/** `path:weight,path:weight` or a JSON array of { path, weight } (the command-line form of data.sources). */
function parseSourcesText(text: string): { value?: SourceEntry[]; problem?: string } {
  const t = text.trim();
  if (t === '' || t === '[]') return { value: [] };
  if (t.startsWith('[')) {
    try {
      return { value: JSON.parse(t) as SourceEntry[] };
    } catch (e) {
      return { problem: `--data.sources is not a JSON array (${(e as Error).message}); write --data.sources=dirA:0.7,dirB:0.3` };
    }
  }
  const out: SourceEntry[] = [];
  for (const part of t.split(',')) {
    const i = part.lastIndexOf(':');
    const weight = i > 0 ? Number(part.slice(i + 1)) : NaN;
    if (!Number.isFinite(weight)) return { problem: `--data.sources entry ${JSON.stringify(part)} needs a weight: write path:weight (e.g. data/web:0.7)` };
    out.push({ path: part.slice(0, i), weight });
  }
  return { value: out };
}

function describe(v: unknown): string {
  return typeof v === 'string' ? JSON.stringify(v) : typeof v === 'object' ? (Array.isArray(v) ? 'an array' : 'a table') : String(v);
}

/** Checks one value against its field; returns a problem or undefined. */
function checkField(key: string, f: AnyField, v: unknown): string | undefined {
  switch (f.kind) {
    case 'bool':
      if (typeof v !== 'boolean') return `${key} must be true or false, got ${describe(v)}`;
      return undefined;
    case 'sources': {
      const fix = `${key} must be an array of { path = "...", weight = number > 0 }`;
      if (!Array.isArray(v)) return `${fix}, got ${describe(v)}`;
      for (const e of v as unknown[]) {
        const r = e as Record<string, unknown>;
        if (e === null || typeof e !== 'object' || typeof r.path !== 'string' || r.path === '') return `${fix}; an entry has no path`;
        if (typeof r.weight !== 'number' || !(r.weight > 0) || !Number.isFinite(r.weight)) return `${fix}; the weight of ${r.path} is ${describe(r.weight)}`;
        const extra = Object.keys(r).filter((k) => k !== 'path' && k !== 'weight');
        if (extra.length > 0) return `${fix}; unknown key ${extra[0]} in the entry for ${r.path}`;
      }
      return undefined;
    }
    case 'strings':
      if (!Array.isArray(v) || v.some((e) => typeof e !== 'string' || e === '')) return `${key} must be an array of names, e.g. ["q_proj", "v_proj"], got ${describe(v)}`;
      return undefined;
    case 'ints':
      if (!Array.isArray(v) || v.some((e) => typeof e !== 'number' || !Number.isInteger(e) || (f.min !== undefined && e < f.min))) return `${key} must be an array of whole numbers${f.min !== undefined ? ` >= ${f.min}` : ''}, e.g. [0, 3], got ${describe(v)}`;
      return undefined;
    case 'string':
      if (typeof v !== 'string') return `${key} must be a string, got ${describe(v)}`;
      if (f.choices && !f.choices.includes(v)) return `${key} must be one of ${f.choices.map((c) => JSON.stringify(c)).join(', ')}, got ${JSON.stringify(v)}`;
      return undefined;
    case 'int':
    case 'float': {
      if (typeof v !== 'number' || !Number.isFinite(v)) return `${key} must be a finite number, got ${describe(v)}`;
      if (f.kind === 'int' && !Number.isInteger(v)) return `${key} must be an integer, got ${v}`;
      if (f.min !== undefined && v < f.min) return `${key} must be >= ${f.min}, got ${v}`;
      if (f.max !== undefined && v > f.max) return `${key} must be <= ${f.max}, got ${v}`;
      if (f.above !== undefined && !(v > f.above)) return `${key} must be > ${f.above}, got ${v}`;
      if (f.below !== undefined && !(v < f.below)) return `${key} must be < ${f.below}, got ${v}`;
      return undefined;
    }
  }
}

/** Parses a command-line value as the field's type. */
function parseCliValue(key: string, f: AnyField, text: string): { value?: unknown; problem?: string } {
  switch (f.kind) {
    case 'bool':
      if (text === 'true' || text === 'false') return { value: text === 'true' };
      return { problem: `--${key} must be true or false, got ${JSON.stringify(text)}` };
    case 'int':
      if (/^[+-]?\d+$/.test(text)) return { value: Number(text) };
      return { problem: `--${key} must be an integer, got ${JSON.stringify(text)}` };
    case 'float': {
      const n = text.trim() === '' ? NaN : Number(text);
      if (Number.isFinite(n)) return { value: n };
      return { problem: `--${key} must be a number, got ${JSON.stringify(text)}` };
    }
    case 'string':
      return { value: text };
    case 'strings':
      // --lora.targets=q_proj,v_proj (or a JSON array)
      if (text.trim().startsWith('[')) {
        try {
          return { value: JSON.parse(text) as unknown };
        } catch (e) {
          return { problem: `--${key} is not a JSON array (${(e as Error).message}); write --${key}=a,b` };
        }
      }
      return { value: text.split(',').map((x) => x.trim()).filter((x) => x !== '') };
    case 'ints': {
      // --moe.denseLayers=0,3 (or a JSON array; "" = none)
      const parts = text.trim().startsWith('[') ? text.trim().slice(1, -1) : text;
      const items = parts.split(',').map((x) => x.trim()).filter((x) => x !== '');
      if (items.some((x) => !/^[+-]?\d+$/.test(x))) return { problem: `--${key} must be whole numbers separated by commas (e.g. --${key}=0,3), got ${JSON.stringify(text)}` };
      return { value: items.map(Number) };
    }
    case 'sources':
      return parseSourcesText(text);
  }
}

/** Turns `--section.field=value` / `--section.field value` arguments into raw values. */
export function parseOverrides(args: readonly string[]): { raw: RawConfig; problems: string[] } {
  const raw: RawConfig = {};
  const problems: string[] = [];
  for (let i = 0; i < args.length; i++) {
    const arg = args[i]!;
    const m = /^--([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)(?:=(.*))?$/s.exec(arg);
    if (!m) {
      problems.push(`cannot read override ${JSON.stringify(arg)}; write --section.field=value (e.g. --optim.lr=3e-4)`);
      continue;
    }
    const [, section, name] = m as unknown as [string, string, string];
    let text = m[3];
    if (text === undefined) {
      const nextArg = args[i + 1];
      if (nextArg === undefined || nextArg.startsWith('--')) {
        problems.push(`--${section}.${name} needs a value; write --${section}.${name}=value`);
        continue;
      }
      text = nextArg;
      i++;
    }
    const fields = fieldsOf(section);
    if (!fields) {
      problems.push(unknownSection(section, `--${section}.${name}`));
      continue;
    }
    const f = fields[name];
    if (!f) {
      problems.push(unknownField(section, name, `--${section}.${name}`));
      continue;
    }
    const r = parseCliValue(`${section}.${name}`, f, text);
    if (r.problem) problems.push(r.problem);
    else (raw[section] ??= {})[name] = r.value;
  }
  return { raw, problems };
}

/** Checks the shape of a parsed TOML table (known sections and keys only). */
function checkRaw(table: Record<string, unknown>): { raw: RawConfig; problems: string[] } {
  const raw: RawConfig = {};
  const problems: string[] = [];
  for (const [section, body] of Object.entries(table)) {
    if (!fieldsOf(section)) {
      problems.push(unknownSection(section, body !== null && typeof body === 'object' ? `[${section}]` : `"${section}"`));
      continue;
    }
    if (body === null || typeof body !== 'object' || Array.isArray(body)) {
      problems.push(`"${section}" must be a table ([${section}]), got ${describe(body)}`);
      continue;
    }
    raw[section] = {};
    for (const [name, v] of Object.entries(body as Record<string, unknown>)) {
      if (!fieldsOf(section)![name]) problems.push(unknownField(section, name, `${section}.${name}`));
      else raw[section]![name] = v;
    }
  }
  return { raw, problems };
}

/** train.initFrom as the resolver will make it absolute ([Note: config paths]). */
function initFromPath(cfg: RawConfig, fromCli: RawConfig, baseDir: string | undefined): string {
  const v = String(cfg.train!.initFrom);
  return isAbsolute(v) ? v : fromCli.train?.initFrom !== undefined || baseDir === undefined ? resolve(v) : resolve(baseDir, v);
}

/** Reads train.initFrom's model and fills the fields the user did not set; problems go to `problems`. */
function initFromOf(cfg: RawConfig, fromFile: RawConfig, fromCli: RawConfig, baseDir: string | undefined, problems: string[]): InitFromModel | undefined {
  if (typeof cfg.train!.initFrom !== 'string' || cfg.train!.initFrom === '') return undefined;
  const set: RawConfig = {};
  for (const layer of [fromFile, fromCli]) for (const [s, body] of Object.entries(layer)) Object.assign((set[s] ??= {}), body);
  let from: InitFromModel | undefined;
  try {
    from = initFromModel(initFromPath(cfg, fromCli, baseDir));
  } catch (e) {
    problems.push(`train.initFrom: ${(e as Error).message}`);
    return undefined;
  }
  if (from) problems.push(...applyInitFromModel(cfg, set, from));
  return from;
}

/**
 * A Hugging Face directory's tokenizer comes with it when data.tokenizer is left at its default;
 * examples need one, so a directory without tokenizer.json is an error naming the fix.
 */
function initFromTokenizer(cfg: RawConfig, fromFile: RawConfig, fromCli: RawConfig, from: InitFromModel): string[] {
  if (!from.hf || fromFile.data?.tokenizer !== undefined || fromCli.data?.tokenizer !== undefined) return [];
  if (from.tokenizer !== undefined) {
    cfg.data!.tokenizer = from.tokenizer;
    return [];
  }
  if (cfg.data!.format === 'text') return [];
  return [`data.format = ${JSON.stringify(cfg.data!.format)} needs the model's tokenizer, and train.initFrom is ${from.what}, which has no tokenizer.json: put the model's tokenizer.json and tokenizer_config.json in the directory, or set data.tokenizer`];
}

/**
 * Builds a config from TOML text and command-line overrides (which win), over the defaults.
 * `where` names the source in messages (the file path); `baseDir` is the directory relative paths
 * in the text start from (the config file's; without it, the current directory). Throws
 * ConfigError listing every problem.
 */
export function parseConfig(tomlText: string, overrides: readonly string[] = [], where = 'config', baseDir?: string): FlotillaConfig {
  let table: Record<string, unknown>;
  try {
    table = parseToml(tomlText) as Record<string, unknown>;
  } catch (e) {
    throw new ConfigError([`not valid TOML: ${(e as Error).message}`], where);
  }
  const fromFile = checkRaw(table);
  const fromCli = parseOverrides(overrides);
  const problems = [...fromFile.problems, ...fromCli.problems];
  const cfg = schemaDefaults() as unknown as RawConfig;
  for (const layer of [fromFile.raw, fromCli.raw]) {
    for (const [s, body] of Object.entries(layer)) Object.assign(cfg[s]!, body);
  }
  // train.initFrom's model fills [model] ([Note: initFrom model] in init_from.ts), its tokenizer data.tokenizer.
  const from = initFromOf(cfg, fromFile.raw, fromCli.raw, baseDir, problems);
  for (const s of sections) {
    for (const [k, f] of Object.entries(fieldsOf(s)!)) {
      // TOML has no separate float syntax for whole numbers: 1 is accepted where a float is wanted.
      const problem = checkField(`${s}.${k}`, f, cfg[s]![k]);
      if (problem) problems.push(problem);
    }
  }
  if (problems.length === 0 && from !== undefined) problems.push(...initFromTokenizer(cfg, fromFile.raw, fromCli.raw, from));
  if (problems.length === 0) problems.push(...validateConfig(cfg as unknown as FlotillaConfig));
  if (problems.length > 0) throw new ConfigError(problems, where);
  const resolved = cfg as unknown as FlotillaConfig;
  // Also turns the entries of data.sources into plain objects, not TOML tables.
  const origins = resolveInputPaths(resolved, fromCli.raw, baseDir);
  pathOrigins.set(resolved, origins);
  // model.vocabSize = 0 follows data.tokenizer, so the saved config names the size the model has.
  if (resolved.model.vocabSize === 0) {
    const tok = resolved.data.tokenizer;
    const o = origins.find((x) => x.resolved === tok);
    if (o !== undefined && !(existsSync(tok) && (statSync(tok).isFile() || hfTokenizerDir(tok) !== undefined))) {
      const what = existsSync(tok) ? 'a directory without a tokenizer.json' : 'does not exist';
      throw new ConfigError([`${o.how} is ${tok}, which ${what}; correct the path, or use "byte" or "gpt2"`], where);
    }
    try {
      resolved.model.vocabSize = tokenizerIdentity(tok).vocabSize;
    } catch (e) {
      throw new ConfigError(explainPaths(resolved, [`data.tokenizer: ${(e as Error).message}`]), where);
    }
  }
  return resolved;
}

/** Reads a TOML file and applies overrides; a missing file is a ConfigError naming the path. */
export function loadConfig(path: string, overrides: readonly string[] = []): FlotillaConfig {
  if (!existsSync(path)) throw new ConfigError([`config file ${path} does not exist (try examples/gpt-tiny.toml)`]);
  if (statSync(path).isDirectory()) throw new ConfigError([`config file ${path} is a directory; pass a TOML file (e.g. examples/gpt-tiny.toml)`]);
  let text: string;
  try {
    text = readFileSync(path, 'utf8');
  } catch (e) {
    throw new ConfigError([`config file ${path} cannot be read (${(e as NodeJS.ErrnoException).code ?? (e as Error).message})`]);
  }
  return parseConfig(text, overrides, path, dirname(resolve(path)));
}

function tomlValue(v: unknown): string {
  if (typeof v === 'string') return JSON.stringify(v); // JSON string escapes are valid TOML basic-string escapes
  if (Array.isArray(v)) return `[${v.map((e: SourceEntry | string | number) => (typeof e === 'string' ? JSON.stringify(e) : typeof e === 'number' ? String(e) : `{ path = ${JSON.stringify(e.path)}, weight = ${e.weight} }`)).join(', ')}]`;
  return String(v);
}

/** The config as TOML; with docs, each section and field carries its documentation as a comment. */
export function configToToml(c: FlotillaConfig, opts: { docs?: boolean; header?: string } = {}): string {
  const docs = opts.docs ?? true;
  const lines: string[] = [];
  if (opts.header) lines.push(...opts.header.split('\n').map((l) => `# ${l}`), '');
  for (const s of sections) {
    const sec = configSchema[s] as unknown as { doc: string; fields: Record<string, AnyField> };
    if (docs) lines.push(`# ${sec.doc}`);
    lines.push(`[${s}]`);
    for (const [k, f] of Object.entries(sec.fields)) {
      if (docs) lines.push(`# ${f.doc}`);
      lines.push(`${k} = ${tomlValue((c[s] as unknown as Record<string, unknown>)[k])}`);
    }
    lines.push('');
  }
  return lines.join('\n');
}


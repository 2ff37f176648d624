// The planner's cache of what it measured: where it lives and what each entry is keyed by (see
// calibrate.ts's opening note: every entry is keyed by what it depends on, the machine and the code
// that measures among it).
import { createHash } from 'node:crypto';
import { mkdirSync, readFileSync, renameSync, statSync, writeFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { cpus } from 'node:os';
import { join } from 'node:path';
import { planScript } from './measure.js';
import { cacheDir } from '../io/cache_dir.js';

/** The planner's cache directory, or undefined when FLOTILLA_CACHE_DIR=off. */
export function planCacheDir(env: NodeJS.ProcessEnv = process.env): string | undefined {
  return cacheDir('plan', env);
}

export const digest = (x: unknown): string => createHash('sha256').update(JSON.stringify(x)).digest('hex').slice(0, 16);
// The addon's build is part of the machine: its kernels and allocator set what every step costs.
const ADDON = fileURLToPath(new URL('../../native/build/Release/flotilla.node', import.meta.url));
function addonStamp(): string {
  try {
    const s = statSync(ADDON);
    return `${s.size}:${s.mtimeMs}`;
  } catch {
    return '?';
  }
}
export const machine = (): string => `${cpus()[0]?.model ?? '?'} x${cpus().length} addon ${addonStamp()}`;
export function codeOf(name: string): string {
  try {
    return digest(readFileSync(planScript(name), 'utf8'));
  } catch {
    return '?';
  }
}

export function cached<T>(name: string, key: unknown, make: () => Promise<T>): Promise<T> {
  const dir = planCacheDir();
  const file = dir === undefined ? undefined : join(dir, `${name}-${digest(key)}.json`);
  if (file !== undefined) {
    try {
      return Promise.resolve(JSON.parse(readFileSync(file, 'utf8')) as T);
    } catch { /* not measured yet */ }
  }
  return make().then((v) => {
    if (file !== undefined) {
      try {
        mkdirSync(dir!, { recursive: true });
        const tmp = `${file}.${process.pid}.tmp`;
        writeFileSync(tmp, JSON.stringify(v));
        renameSync(tmp, file);
      } catch { /* a cache that cannot be written only costs a measurement next time */ }
    }
    return v;
  });
}

// Where flotilla keeps what it can compute again (tokenized text, the planner's calibrations):
// FLOTILLA_CACHE_DIR (its `sub` folder), else $XDG_CACHE_HOME/flotilla/sub, else
// ~/.cache/flotilla/sub; FLOTILLA_CACHE_DIR=off keeps nothing.
import { homedir } from 'node:os';
import { join } from 'node:path';

/** The cache directory of one kind (`tokens`, `plan`), or undefined when FLOTILLA_CACHE_DIR=off. */
export function cacheDir(sub: string, env: NodeJS.ProcessEnv = process.env): string | undefined {
  const own = env.FLOTILLA_CACHE_DIR?.trim();
  if (own === 'off') return undefined;
  if (own) return join(own, sub);
  const xdg = env.XDG_CACHE_HOME?.trim();
  return join(xdg || join(homedir(), '.cache'), 'flotilla', sub);
}

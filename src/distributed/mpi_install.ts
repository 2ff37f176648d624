// Whether Open MPI can run here: the launcher asks before it starts ranks through mpirun, and a rank
// asks when its backend is "auto". Loads no native addon.
import { accessSync, constants as fsConstants, existsSync } from 'node:fs';
import { delimiter, dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

/** The fix for a machine without Open MPI. */
export const MPI_INSTALL_HINT = 'apt-get install libopenmpi-dev openmpi-bin, then rebuild the addon (bash scripts/ensure.sh)';

/** An executable's path on PATH, or undefined. */
export function onPath(name: string): string | undefined {
  for (const dir of (process.env.PATH ?? '/usr/bin:/bin').split(delimiter)) {
    if (!dir) continue;
    const p = join(dir, name);
    try {
      accessSync(p, fsConstants.X_OK);
      return p;
    } catch {
      // not here
    }
  }
  return undefined;
}

/** True when the MPI backend can run here: the MPI addon is built and mpirun is on PATH. */
export function mpiInstalled(): boolean {
  const addon = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'native', 'build', 'Release', 'flotilla_mpi.node');
  return existsSync(addon) && onPath('mpirun') !== undefined;
}

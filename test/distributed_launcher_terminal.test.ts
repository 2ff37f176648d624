// `flotilla run` on a terminal: rank 0's progress goes to the launcher's terminal under both backends
// (its stdout is the launcher's pipe), so a training run shows a progress bar, not plain lines.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { join } from 'node:path';
import { assertMpiBuilt, REPO_ROOT } from './helpers/world.js';
import { suiteSlots } from './helpers/pool.js';
import { runnableScript } from './helpers/compiled.js';

const FLOTILLA = join(REPO_ROOT, 'bin', 'flotilla.js');
// Ranks start from the compiled script while dist/ is current (test/helpers/compiled.ts).
const SCRIPT = runnableScript(join(REPO_ROOT, 'test', 'helpers', 'ranks', 'terminal.ts'));

/** Runs a command on a fresh pseudo-terminal (util-linux `script`); resolves to what the terminal showed. */
function onTerminal(argv: string[]): Promise<{ code: number | null; screen: string }> {
  const line = argv.map((a) => `'${a.replace(/'/g, `'\\''`)}'`).join(' ');
  const child = spawn('script', ['-qefc', line, '/dev/null'], { cwd: REPO_ROOT, stdio: ['ignore', 'pipe', 'pipe'] });
  let screen = '';
  child.stdout.on('data', (d) => (screen += d));
  child.stderr.on('data', (d) => (screen += d));
  return new Promise((resolve) => child.on('close', (code) => resolve({ code, screen: screen.replace(/\r/g, '') })));
}

for (const backend of ['gloo', 'mpi'] as const) {
  test(`${backend}: on a terminal, rank 0 draws its progress bar on the launcher's terminal`, async () => {
    if (backend === 'mpi') assertMpiBuilt();
    const slot = await suiteSlots.acquire();
    try {
      const { code, screen } = await onTerminal([process.execPath, FLOTILLA, 'run', '--backend', backend, '--nproc', '2', SCRIPT]);
      assert.equal(code, 0, screen);
      assert.match(screen, /^\[rank 0\] MODE 0 bar$/m, screen);
      assert.match(screen, /^BAR-MARK drawn on the terminal$/m, `rank 0's bar was not drawn on the terminal itself:\n${screen}`);
    } finally {
      suiteSlots.release(slot);
    }
  });

  test(`${backend}: without a terminal, rank 0 prints plain lines`, async () => {
    if (backend === 'mpi') assertMpiBuilt();
    const slot = await suiteSlots.acquire();
    try {
      const child = spawn(process.execPath, [FLOTILLA, 'run', '--backend', backend, '--nproc', '2', SCRIPT], { cwd: REPO_ROOT, stdio: ['ignore', 'pipe', 'pipe'], detached: true });
      let out = '';
      child.stdout.on('data', (d) => (out += d));
      child.stderr.on('data', (d) => (out += d));
      const code = await new Promise((r) => child.on('close', r));
      assert.equal(code, 0, out);
      assert.match(out, /^\[rank 0\] MODE 0 plain$/m, out);
      assert.doesNotMatch(out, /BAR-MARK/, out);
    } finally {
      suiteSlots.release(slot);
    }
  });
}

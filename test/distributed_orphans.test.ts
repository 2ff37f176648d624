// A launcher killed with SIGKILL cannot stop its ranks; they must still end, not linger as orphans.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { join } from 'node:path';
import { isAlive } from './helpers/world.js';
import { suiteSlots } from './helpers/pool.js';
import { runnableScript } from './helpers/compiled.js';

// Worlds here time out in seconds: no other file's launch runs beside this file (test/helpers/pool.ts).
await suiteSlots.holdAll();

const root = join(import.meta.dirname, '..');


test('ranks exit when their launcher is killed with SIGKILL', async () => {
  const launcher = spawn(process.execPath, [join(root, 'bin', 'flotilla.js'), 'run', '--nproc', '2', runnableScript(join(root, 'test', 'helpers', 'ranks', 'linger.ts'))], {
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  const pids = await new Promise<number[]>((resolve, reject) => {
    let out = '';
    const timer = setTimeout(() => reject(new Error(`ranks did not start:\n${out}`)), 60_000);
    launcher.stdout.on('data', (d) => {
      out += d;
      const found = [...out.matchAll(/PID \d+ (\d+)/g)].map((m) => Number(m[1]));
      if (found.length === 2) {
        clearTimeout(timer);
        resolve(found);
      }
    });
  });
  assert.ok(pids.every(isAlive));
  launcher.kill('SIGKILL');
  const deadline = Date.now() + 10_000;
  while (Date.now() < deadline && pids.some(isAlive)) await new Promise((r) => setTimeout(r, 100));
  const left = pids.filter(isAlive);
  for (const p of left) process.kill(p, 'SIGKILL');
  assert.deepEqual(left, [], 'ranks outlived their launcher');
});

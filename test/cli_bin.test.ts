// bin/flotilla.js picks the compiled dist/ only while it was built from the current sources: run in
// a scratch root holding a copy of it, a dist/cli/main.js and a src/cli/main.ts that each say which
// one ran, and the checkout's node_modules (for tsx).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { copyFileSync, mkdirSync, mkdtempSync, rmSync, symlinkSync, utimesSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { BIN, ROOT } from './helpers/cli.js';

function scratch(): string {
  const root = mkdtempSync(join(tmpdir(), 'flotilla-bin-'));
  for (const d of ['bin', 'dist/cli', 'src/cli']) mkdirSync(join(root, d), { recursive: true });
  copyFileSync(BIN, join(root, 'bin', 'flotilla.js'));
  writeFileSync(join(root, 'package.json'), '{ "type": "module" }\n');
  symlinkSync(join(ROOT, 'node_modules'), join(root, 'node_modules'));
  const say = (what: string) => `export async function main(args) { console.log('${what}', args.join(' ')); return 0; }\n`;
  writeFileSync(join(root, 'dist', 'cli', 'main.js'), say('dist'));
  writeFileSync(join(root, 'src', 'cli', 'main.ts'), say('sources'));
  return root;
}

const run = (root: string) => spawnSync(process.execPath, [join(root, 'bin', 'flotilla.js'), 'a', 'b'], { encoding: 'utf8' });
const at = (path: string, seconds: number) => utimesSync(path, seconds, seconds);

test('bin/flotilla.js runs dist/ while it is current, and the sources when it is stale or was never built', () => {
  const root = scratch();
  try {
    const src = join(root, 'src', 'cli', 'main.ts'), stamp = join(root, 'dist', '.built');
    const now = Math.floor(Date.now() / 1000);
    assert.equal(run(root).stdout, 'sources a b\n', 'no stamp: never built here');
    writeFileSync(stamp, '');
    at(src, now - 100);
    at(stamp, now - 50);
    assert.equal(run(root).stdout, 'dist a b\n', 'built after the last edit');
    at(src, now - 10);
    assert.equal(run(root).stdout, 'sources a b\n', 'a source edited after the build');
  } finally {
    rmSync(root, { recursive: true, force: true });
  }
});

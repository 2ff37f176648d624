#!/usr/bin/env node
// The `flotilla` command in a checkout. It always runs the current sources: the compiled CLI in
// dist/ when dist/ was built from them (scripts/ensure.sh builds it and stamps dist/.built with the
// time the build started; no file under src/ may be newer), otherwise src/cli/main.ts through tsx.
// The compiled CLI needs no TypeScript loader, in this process or in the ranks it starts: about a
// second of CPU less per process. The installed package runs dist/cli/bin.js (package.json "bin").
import { readdirSync, statSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { join } from 'node:path';

const root = fileURLToPath(new URL('..', import.meta.url));

/** The newest modification time of any file under dir (0 for an empty or missing dir). */
function newest(dir) {
  let t = 0;
  for (const e of readdirSync(dir, { withFileTypes: true })) {
    const p = join(dir, e.name);
    t = Math.max(t, e.isDirectory() ? newest(p) : statSync(p).mtimeMs);
  }
  return t;
}

function distIsCurrent() {
  try {
    return statSync(join(root, 'dist', '.built')).mtimeMs >= newest(join(root, 'src'));
  } catch {
    return false; // no dist/ or no stamp: never built here
  }
}

let main;
if (distIsCurrent()) {
  ({ main } = await import('../dist/cli/main.js'));
} else {
  const { register } = await import('tsx/esm/api');
  register();
  ({ main } = await import('../src/cli/main.ts'));
}
process.exit(await main(process.argv.slice(2)));

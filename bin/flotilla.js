#!/usr/bin/env node
// The `flotilla` command in a checkout: loads the TypeScript CLI (src/cli/main.ts) through tsx, in
// this process, so it always runs the current sources. The installed package runs the compiled
// dist/cli/bin.js instead (package.json "bin").
import { register } from 'tsx/esm/api';

register();
const { main } = await import('../src/cli/main.ts');
process.exit(await main(process.argv.slice(2)));

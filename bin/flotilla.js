#!/usr/bin/env node
// The `flotilla` command: loads the TypeScript CLI (src/cli/main.ts) through tsx, in this process.
import { register } from 'tsx/esm/api';

register();
const { main } = await import('../src/cli/main.ts');
process.exit(await main(process.argv.slice(2)));

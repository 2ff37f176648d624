#!/usr/bin/env node
// The installed package's `flotilla` command (package.json "bin" -> dist/cli/bin.js): the compiled
// CLI under plain node. In a checkout, bin/flotilla.js runs the TypeScript sources through tsx.
import { main } from './main.js';

process.exit(await main(process.argv.slice(2)));

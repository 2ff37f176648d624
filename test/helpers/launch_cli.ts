// `flotilla run` as its own process, for tests that signal the launcher: node --import tsx
// test/helpers/launch_cli.ts --nproc 2 script.ts ...
import { runLauncher } from '../../src/cli/run.js';

process.exitCode = await runLauncher(process.argv.slice(2));

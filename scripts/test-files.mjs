#!/usr/bin/env node
// Prints the test files in the order `npm test` starts them. node --test starts files in the order
// given, two at a time (--test-concurrency=2, one per core of the 2-core test machine): the longest
// files go first, so that none of them starts last and runs on alone while the other core idles;
// the rest follow in name order. LONGEST: the files that took the most CPU time on that machine
// (a file missing from the directory is left out; a new long file may be added here).
import { readdirSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

const LONGEST = [
  'pipeline_train', 'parallel_zero', 'checkpoint_resume', 'llama_layouts', 'checkpoint_faults', 'cli_verify',
  'parallel_ddp', 'tp_gpt', 'pipeline_clip', 'checkpointing_activation_layouts', 'precision_verify',
  'hardening_runtime', 'pipeline_eval', 'cli_train', 'hardening_faults', 'tp_checkpoint', 'precision_zero3',
];

const dir = fileURLToPath(new URL('../test', import.meta.url));
const files = readdirSync(dir).filter((f) => f.endsWith('.test.ts')).sort();
const first = LONGEST.map((n) => `${n}.test.ts`).filter((f) => files.includes(f));
const order = [...first, ...files.filter((f) => !first.includes(f))];
process.stdout.write(`${order.map((f) => `test/${f}`).join('\n')}\n`);

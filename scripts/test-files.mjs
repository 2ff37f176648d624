#!/usr/bin/env node
// Prints the test files in the order `npm test` starts them (scripts/test.ts). node --test starts
// files in the order given, a few at a time: the longest files go first, so that none of them
// starts last and runs on alone while a core idles;
// the rest follow in name order. LONGEST: the files whose processes took the most CPU time on that machine
// (a file missing from the directory is left out; a new long file may be added here).
import { readdirSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

const LONGEST = [
  'pipeline_train', 'checkpoint_resume', 'moe_layouts', 'parallel_zero', 'precision_verify', 'checkpointing_activation_layouts',
  'checkpoint_faults', 'train_hosts', 'tp_gpt', 'memory_zero_rss', 'llama_layouts', 'cp_layouts', 'moe_verify', 'cli_verify',
  'pipeline_clip', 'distributed_launcher', 'parallel_ddp', 'pipeline_eval', 'distributed_collectives', 'hardening_runtime',
  'precision_zero3', 'cli_train', 'hardening_faults', 'tp_checkpoint', 'cp_verify', 'plan_cli', 'plan_memory',
];

const dir = fileURLToPath(new URL('../test', import.meta.url));
const files = readdirSync(dir).filter((f) => f.endsWith('.test.ts')).sort();
const first = LONGEST.map((n) => `${n}.test.ts`).filter((f) => files.includes(f));
const order = [...first, ...files.filter((f) => !first.includes(f))];
process.stdout.write(`${order.map((f) => `test/${f}`).join('\n')}\n`);

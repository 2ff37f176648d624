#!/usr/bin/env node
// Prints the test files in the order `npm test` starts them (scripts/test.ts, which makes node
// --test keep this order: it would otherwise sort the files by name). Three files run at once on the
// 2-core test machine, and the suite is CPU-bound, so the order decides how long the last file runs
// alone:
//   1. LONGEST: the files whose processes took the most CPU time, measured file by file (process
//      accounting over one whole run), most first;
//   2. the files that hold every launch slot while they run (suiteSlots.holdAll in
//      test/helpers/pool.ts: their worlds time out in seconds), longest first, each followed by two files that
//      start no process, which use the cores the waiting file leaves idle (a launching file beside
//      it would only wait for a slot);
//   3. the rest, by name.
// A file missing from the directory is left out; a new long file may be added to LONGEST.
import { readdirSync, readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

const LONGEST = [
  'checkpoint_resume', 'moe_verify', 'pipeline_train', 'cli_verify', 'parallel_zero', 'checkpoint_faults', 'pipeline_clip',
  'tp_gpt', 'memory_zero_rss', 'precision_verify', 'moe_layouts', 'checkpointing_activation_layouts', 'tp_checkpoint',
  'package_install', 'pipeline_eval', 'llama_cli', 'moe_oracle', 'llama_layouts', 'cli_train', 'precision_zero3', 'cp_layouts',
  'parallel_ddp', 'report_browser', 'plan_cli', 'plan_memory',
];
// The files that hold every launch slot, longest first (train_hosts waits out heartbeat timeouts).
const HOLDS_ALL_LONGEST = ['train_hosts', 'hardening_runtime', 'distributed_failure', 'distributed_launcher', 'distributed_collectives'];

const dir = fileURLToPath(new URL('../test', import.meta.url));
const files = readdirSync(dir).filter((f) => f.endsWith('.test.ts')).sort();
const source = (f) => readFileSync(`${dir}/${f}`, 'utf8');
const first = LONGEST.map((n) => `${n}.test.ts`).filter((f) => files.includes(f));
const rest = files.filter((f) => !first.includes(f));
const rank = (f) => (HOLDS_ALL_LONGEST.indexOf(f.replace('.test.ts', '')) + 1) || HOLDS_ALL_LONGEST.length + 1;
const holdsAll = rest.filter((f) => /suiteSlots\.holdAll\(/.test(source(f))).sort((a, b) => rank(a) - rank(b));
// Starts no process of its own: no launch helper, no child_process.
const startsNone = (f) => !/helpers\/(pool|world|cli|launch_cli|ckpt_runs|pipeline_runs|rss|hosts)\.js|node:child_process/.test(source(f));
const quiet = rest.filter((f) => !holdsAll.includes(f) && startsNone(f));
const order = [...first];
for (const f of holdsAll) order.push(f, ...quiet.splice(0, 2));
order.push(...quiet, ...rest.filter((f) => !order.includes(f) && !quiet.includes(f)));
process.stdout.write(`${order.map((f) => `test/${f}`).join('\n')}\n`);

#!/usr/bin/env node
// Prints the test files in the order `npm test` starts them (scripts/test.ts, which makes node
// --test keep this order: it would otherwise sort the files by name). Three files run at once on the
// 2-core test machine, and the suite is CPU-bound, so the order decides how long the last file runs
// alone:
//   1. LONGEST: the files whose processes took the most CPU time, measured file by file (process
//      accounting over one whole run), most first;
//   2. the files that hold every launch slot while they run (suiteSlots.holdAll in
//      test/helpers/pool.ts: their worlds time out in seconds), longest first, each followed by its
//      share of the files that take no launch slot (in-process tests and PyTorch oracles, dealt in
//      turn, longest first), which use the cores the waiting file leaves idle (a launching file
//      beside it would only wait for a slot);
//   3. the rest, longest first (REST_LONGEST; a file not listed after them, by name), so that the
//      last files to end are short ones.
// A file missing from the directory is left out; a new long file may be added to LONGEST.
import { readdirSync, readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

const LONGEST = [
  'checkpoint_faults', 'moe_verify', 'pipeline_train', 'parallel_zero', 'checkpoint_resume', 'memory_zero_rss', 'data_train_hsdp',
  'tp_gpt', 'lora_tp', 'lora_train', 'lora_verify', 'pipeline_clip', 'cli_verify', 'checkpointing_activation_layouts', 'moe_layouts', 'cli_train', 'package_install',
  'plan_cli', 'llama_layouts', 'pipeline_eval', 'llama_cli', 'tp_checkpoint', 'parallel_ddp', 'cp_layouts', 'precision_zero3',
  'report_browser', 'precision_verify', 'plan_memory',
];
// The files that hold every launch slot, longest first (train_hosts waits out heartbeat timeouts).
const HOLDS_ALL_LONGEST = [
  'train_hosts', 'hardening_faults', 'distributed_failure', 'hardening_runtime', 'distributed_collectives', 'distributed_launcher',
  'distributed_mpi', 'distributed_orphans',
];
// Of the files that take no launch slot (in-process tests, PyTorch oracles), the longest, most first.
const FILLERS_LONGEST = [
  'moe_oracle', 'data_rss', 'hardening_files', 'optim_oracle', 'llama_oracle', 'engine_allocator', 'report_input', 'data_tokenizers',
  'data_prepare', 'memory_training', 'pipeline_schedule', 'gpt_oracle', 'train_run_lock', 'hf_gpt2', 'hf_llama', 'hf_mistral', 'hf_qwen3_moe', 'train_trainer',
];

// Of the rest (they take launch slots, and run after the files above), the longest, most first.
const REST_LONGEST = [
  'qwen_layouts', 'families_verify', 'hf_mixtral', 'masked_user_model', 'slurm_preempt', 'slurm_jobs', 'slurm_cluster', 'chat_flow', 'dpo_train', 'dpo_layouts', 'chat_verify', 'example_loader', 'kernels_attention_layouts', 'cp_ring_documents', 'mistral_layouts', 'cp_ring_window', 'lora_moe_export', 'lora_peft', 'lora_bf16_base', 'lora_layouts_more', 'lora_bf16_cli', 'lora_layouts', 'parallel_grads', 'hardening_teardown', 'checkpointing_activation_memory', 'cp_verify', 'parallel_user_model', 'data_train', 'train_tensorboard',
  'distributed_contract', 'config_paths', 'hf_train', 'cli_prepare_direct', 'kernels_fused_layouts', 'tp_layers', 'cp_ring_attention', 'masked_layouts', 'masked_loss', 'hf_init_config', 'hf_qwen', 'data_chat_prepare', 'generate_chat',
];

const dir = fileURLToPath(new URL('../test', import.meta.url));
const files = readdirSync(dir).filter((f) => f.endsWith('.test.ts')).sort();
const source = (f) => readFileSync(`${dir}/${f}`, 'utf8');
const byList = (list) => (a, b) => ((list.indexOf(a.replace('.test.ts', '')) + 1) || list.length + 1) - ((list.indexOf(b.replace('.test.ts', '')) + 1) || list.length + 1);
const first = LONGEST.map((n) => `${n}.test.ts`).filter((f) => files.includes(f));
const rest = files.filter((f) => !first.includes(f));
const holdsAll = rest.filter((f) => /suiteSlots\.holdAll\(/.test(source(f))).sort(byList(HOLDS_ALL_LONGEST));
// Takes no launch slot: no launch helper (PyTorch oracles and other child processes are not launches).
const takesNoSlot = (f) => !/helpers\/(pool|world|cli|launch_cli|ckpt_runs|pipeline_runs|rss|hosts)\.js/.test(source(f)) && !/^await import\(/m.test(source(f));
const fillers = rest.filter((f) => !holdsAll.includes(f) && takesNoSlot(f)).sort(byList(FILLERS_LONGEST));
// Dealt to the waiting files in turn, the longest first, so each has some beside it (with no
// waiting file they join the rest).
const order = [...first];
holdsAll.forEach((f, i) => order.push(f, ...fillers.filter((_, k) => k % holdsAll.length === i)));
order.push(...rest.filter((f) => !order.includes(f)).sort(byList(REST_LONGEST)));
process.stdout.write(`${order.map((f) => `test/${f}`).join('\n')}\n`);

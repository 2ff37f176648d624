// Rules across fields and sections: the layout's (src/parallel/layout.ts), the model's shapes under
// that layout (its rules, src/models/rules.ts), the batch split; checkRunnable adds the world size
// and the data files.
import { checkDataConfig } from '../data/sources.js';
import { exampleDataProblems } from '../data/example_source.js';
import { globalBatchProblem } from '../data/batch_split.js';
import { layoutProblems, dataParallelDegree } from '../parallel/layout.js';
import { modelArchs, modelRules, unknownArch } from '../models/rules.js';
import { optimizerNames, unknownOptimizer } from '../optim/names.js';
import { configSchema, modelConfigOf, type FlotillaConfig } from './schema.js';
import { explainPaths } from './paths.js';
import { chooseLoraTargets, loraTargetProblems } from '../nn/lora_targets.js';
import { peftSettingsProblem, readPeftConfig, type PeftAdapterConfig } from '../checkpoint/peft_config.js';

/** The model's shape problems under the config's layout (none for an unknown arch: validateConfig names that). */
function shapeProblems(c: FlotillaConfig): string[] {
  if (!modelArchs().includes(c.model.arch)) return [];
  const p = c.parallel;
  return modelRules(c.model.arch).shapeProblems(modelConfigOf(c), { seqLen: c.data.seqLen, pp: p.pp, ppVirtualStages: p.ppVirtualStages, tp: p.tp, sequenceParallel: p.sequenceParallel });
}

/** What context parallelism needs of the data and the model ([Note: context parallelism]). */
function contextParallelProblems(c: FlotillaConfig): string[] {
  const cp = c.parallel.cp, p: string[] = [];
  if (cp <= 1) return p;
  if (c.data.seqLen % (2 * cp) !== 0) p.push(`data.seqLen (${c.data.seqLen}) must divide by 2 x parallel.cp = ${2 * cp} (each sequence is cut into ${2 * cp} equal chunks, two per context-parallel rank); choose a seqLen that is a multiple of ${2 * cp}, or another cp`);
  else if (c.parallel.tp > 1 && c.parallel.sequenceParallel && (c.data.seqLen / cp) % c.parallel.tp !== 0) {
    p.push(`a context-parallel rank's ${c.data.seqLen / cp} tokens (data.seqLen / parallel.cp) must divide by parallel.tp = ${c.parallel.tp} under sequenceParallel; choose a seqLen that is a multiple of ${cp * c.parallel.tp}`);
  }
  if (c.model.dropout > 0) p.push(`parallel.cp = ${cp} with model.dropout = ${c.model.dropout}: ring attention has no attention dropout; set model.dropout = 0 or parallel.cp = 1`);
  return p;
}

/**
 * A LoRA run's rules ([Note: LoRA run] in src/train/lora_run.ts): a base to adapt, and targets
 * that name Linears of the model which can hold adapters of this rank (checked on the
 * architecture's list of Linears, without building it).
 */
function loraProblems(c: FlotillaConfig): string[] {
  const l = c.lora, p: string[] = [];
  if (l.rank === 0) return p;
  if (c.train.initFrom === '') p.push('LoRA trains adapters on a frozen base: set train.initFrom to a Hugging Face directory or a checkpoint (lora.rank > 0 with train.initFrom = "")');
  if (l.targets.length === 0) {
    p.push('lora.targets is empty; name the modules to adapt (e.g. ["q_proj", "v_proj"]) or "all-linear"');
    return p;
  }
  if (!modelArchs().includes(c.model.arch)) return p;
  const linears = modelRules(c.model.arch).linears?.(modelConfigOf(c));
  if (!linears) return p;
  const { problems } = loraTargetProblems(linears, { rank: l.rank, targets: l.targets });
  p.push(...problems.map((x) => (x.startsWith('rank') ? `lora.rank: ${x}` : `lora.targets: ${x}`)));
  return p;
}

/**
 * `[lora] adapter`: a PEFT adapter directory whose adapter_config.json this run can continue (r,
 * lora_alpha, use_rslora and the modules its target_modules adapt are lora's). Its tensors are
 * checked against the model by each rank as it reads them (src/checkpoint/peft.ts).
 */
function loraAdapterProblems(c: FlotillaConfig): string[] {
  const l = c.lora;
  if (l.adapter === '') return [];
  let a: PeftAdapterConfig;
  try {
    a = readPeftConfig(l.adapter);
  } catch (e) {
    return [`lora.adapter: ${(e as Error).message}`];
  }
  if (l.rank === 0) {
    return [`lora.adapter = ${JSON.stringify(l.adapter)} continues a LoRA adapter, and lora.rank = 0 (no LoRA): set lora.rank = ${a.rank}, lora.alpha = ${a.alpha}, lora.targets = ${JSON.stringify(a.targets)}${a.rsLora ? ', lora.rsLora = true' : ''} (the adapter's)`];
  }
  const linears = modelArchs().includes(c.model.arch) ? modelRules(c.model.arch).linears?.(modelConfigOf(c)) : undefined;
  const resolve = linears && ((targets: readonly string[]): string[] | undefined => {
    const r = chooseLoraTargets(linears, targets);
    return 'problem' in r ? undefined : linears.filter((x) => r.chosen.has(x.path)).map((x) => x.hf ?? x.path);
  });
  const p = peftSettingsProblem(l.adapter, a, l, resolve);
  return p === undefined ? [] : [p];
}

/**
 * DPO (train.objective = "dpo", src/train/objective.ts) trains on preference pairs, and preference
 * pairs train only DPO for now; its reference with the adapters off needs adapters.
 */
function dpoProblems(c: FlotillaConfig): string[] {
  const p: string[] = [];
  const dpo = c.train.objective === 'dpo';
  if (dpo && c.data.format !== 'preference') p.push(`train.objective = "dpo" trains on preference pairs: set data.format = "preference" (data.source lines {"prompt", "chosen", "rejected"}), or train.objective = "lm" (data.format is "${c.data.format}")`);
  if (!dpo && c.data.format === 'preference') p.push('data.format = "preference" holds preference pairs, which train.objective = "dpo" trains on: set train.objective = "dpo"');
  if (dpo && c.dpo.reference === 'adapters' && c.lora.rank === 0) p.push('dpo.reference = "adapters" compares the policy with its LoRA adapters off, and lora.rank = 0 (no adapters): set lora.rank > 0, or dpo.reference = "copy" (or "auto")');
  return p;
}

/**
 * train.epochs: passes over an example dataset, which then decide the steps (the loader counts the
 * rows, src/data/example_loader.ts), so train.steps stays at its default.
 */
function epochProblems(c: FlotillaConfig): string[] {
  const e = c.train.epochs, p: string[] = [];
  if (e === 0) return p;
  if (c.data.format === 'text') p.push(`train.epochs = ${e} counts passes over an example dataset, and data.format = "text" samples windows of a token stream; set data.format to the examples' kind, or train.epochs = 0 and train.steps`);
  const dflt = configSchema.train.fields.steps.default;
  if (c.train.steps !== dflt) p.push(`train.epochs = ${e} sets the number of steps, and train.steps = ${c.train.steps} is set too; give one of them (leave train.steps at its default ${dflt}, or set train.epochs = 0)`);
  return p;
}

/** Cross-field rules. */
export function validateConfig(c: FlotillaConfig): string[] {
  const p: string[] = [];
  if (!modelArchs().includes(c.model.arch)) p.push(unknownArch(c.model.arch));
  if (!optimizerNames().includes(c.optim.name)) p.push(unknownOptimizer(c.optim.name));
  if (c.optim.minLr > c.optim.lr) p.push(`optim.minLr (${c.optim.minLr}) must be <= optim.lr (${c.optim.lr})`);
  p.push(...layoutProblems(c.parallel));
  p.push(...shapeProblems(c));
  if (c.parallel.ep > 1 && c.moe.experts === 0) p.push(`parallel.ep = ${c.parallel.ep} splits experts, but moe.experts = 0; set moe.experts (a multiple of ${c.parallel.ep}) or parallel.ep = 1`);
  if (c.parallel.ep > 1 && c.moe.experts > 0 && c.moe.experts % c.parallel.ep !== 0) p.push(`moe.experts (${c.moe.experts}) must divide by parallel.ep (${c.parallel.ep}): every expert-parallel rank holds the same number of experts`);
  if (c.moe.experts > 0 && c.parallel.tp > 1 && c.parallel.sequenceParallel) p.push('moe.experts > 0 does not run with parallel.sequenceParallel yet (MoE blocks would route each tensor-parallel rank\'s tokens apart); set parallel.sequenceParallel = false');
  p.push(...contextParallelProblems(c));
  p.push(...loraProblems(c));
  p.push(...dpoProblems(c));
  p.push(...epochProblems(c));
  if (c.data.format !== 'text' && (c.data.tokenizer === 'byte' || c.data.tokenizer === 'gpt2')) {
    p.push(`data.format = ${JSON.stringify(c.data.format)} renders examples with special tokens, which data.tokenizer = ${JSON.stringify(c.data.tokenizer)} does not have; set data.tokenizer to the model's Hugging Face directory (tokenizer.json + tokenizer_config.json) or a tokenizer.json with the template's added tokens`);
  }
  const split = globalBatchProblem({ globalBatch: c.data.globalBatch, microBatches: c.data.microBatches, dp: c.parallel.dp }, 'config');
  if (split) p.push(split);
  if (c.slurm.requeue && c.checkpoint.dir.trim() === '') {
    p.push('slurm.requeue = true resumes the requeued job from the checkpoint its signal saved, and the job may start again on other nodes: set checkpoint.dir to a directory on storage every node sees (e.g. --checkpoint.dir=/shared/ckpt/NAME)');
  }
  return p;
}

/**
 * Checks that a valid config can run on `worldSize` ranks: the data-parallel degree, the split of
 * the global batch, that a data.source file exists, and that a lora.adapter fits the run. The launcher runs it before starting ranks
 * and every rank runs it before touching anything, so these mistakes cost no process and no file.
 */
export function checkRunnable(c: FlotillaConfig, worldSize: number): string[] {
  const p = layoutProblems(c.parallel, worldSize);
  const split = globalBatchProblem({ globalBatch: c.data.globalBatch, microBatches: c.data.microBatches, dp: dataParallelDegree(c.parallel, worldSize) });
  if (split) p.push(split);
  // Again with the vocabulary resolved from the tokenizer (model.vocabSize = 0 when validated).
  p.push(...shapeProblems(c).filter((x) => x.includes('model.vocabSize')));
  // Sources, manifests, the tokenizer and the vocabulary (src/data/sources.ts); no tokenizing.
  p.push(...explainPaths(c, checkDataConfig(c.data, c.model.vocabSize)));
  // The example fields against the sources: the template, and a prepared directory's kind, template and trainOn.
  p.push(...explainPaths(c, exampleDataProblems(c.data)));
  p.push(...explainPaths(c, loraAdapterProblems(c)));
  return p;
}


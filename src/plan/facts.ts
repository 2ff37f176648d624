// The model's sizes by part, read from the model itself: the architecture's spec builds it on
// shapes only (deferInit: no parameter memory, [Note: deferred init]) and its parameters are sorted
// into what comes before the first block (embeddings), each block (dense, and routed experts), and
// what comes after the last (final norm, head); a block's Linears' output widths are summed too. A
// registered architecture of one's own is read the same way, as long as its blocks are named by index
// (`h.3.`, `layers.3.`). With [lora] rank > 0 the adapters are attached first, as the run attaches
// them, and counted by part too: the only trainable parameters of such a run.
import { modelSpec } from '../models/registry.js';
import { modelConfigOf, type FlotillaConfig } from '../config/schema.js';
import { Linear } from '../nn/layers.js';
import { applyLora } from '../nn/lora.js';
import { loraOptionsOf } from '../train/lora_run.js';
import type { ModelFacts } from '../distributed/plan_terms.js';

const BLOCK = /(?:^|\.)(\d+)\./;
const EXPERT = /(?:^|\.)experts\./;

export function modelFacts(cfg: FlotillaConfig): ModelFacts {
  const spec = modelSpec(cfg.model.arch);
  const mc = modelConfigOf(cfg);
  const model = spec.build(mc, { initSeed: 0, deferInit: true });
  // A LoRA run's model is the base with its adapters ([Note: LoRA plan] in src/distributed/plan_terms.ts).
  const lora = cfg.lora.rank > 0;
  if (lora) applyLora(model, loraOptionsOf(cfg, spec, mc));
  const blockParams: number[] = [], blockExpertParams: number[] = [], blockAdapterParams: number[] = [];
  let embedParams = 0, headParams = 0, embedAdapterParams = 0, headAdapterParams = 0, seenBlock = false;
  for (const [name, p] of model.namedParameters()) {
    const n = p.numel();
    const adapter = p.requiresGrad && lora ? n : 0;
    const m = BLOCK.exec(name);
    if (m) {
      const i = Number(m[1]);
      while (blockParams.length <= i) { blockParams.push(0); blockExpertParams.push(0); blockAdapterParams.push(0); }
      if (EXPERT.test(name)) blockExpertParams[i]! += n;
      else blockParams[i]! += n;
      blockAdapterParams[i]! += adapter;
      seenBlock = true;
    } else if (seenBlock) {
      headParams += n;
      headAdapterParams += adapter;
    } else {
      embedParams += n;
      embedAdapterParams += adapter;
    }
  }
  // Per block, its Linears' output widths (routed experts aside).
  const linearOutputs = new Map<number, number>();
  for (const [name, mod] of model.namedModules()) {
    const path = `${name}.`;
    const m = BLOCK.exec(path);
    if (!m || !(mod instanceof Linear) || EXPERT.test(path)) continue;
    const i = Number(m[1]);
    linearOutputs.set(i, (linearOutputs.get(i) ?? 0) + mod.weight.shape[0]!);
  }
  const numParams = embedParams + headParams + blockParams.reduce((a, b) => a + b, 0) + blockExpertParams.reduce((a, b) => a + b, 0);
  return {
    arch: cfg.model.arch, numParams, embedParams, headParams, blockParams, blockExpertParams,
    largestUnitParams: Math.max(0, ...blockParams.map((d, i) => d + blockExpertParams[i]!)),
    blockLinearOutputs: Math.max(0, ...linearOutputs.values()),
    nEmbd: cfg.model.nEmbd, nHead: cfg.model.nHead, vocabSize: cfg.model.vocabSize, topK: cfg.moe.experts > 0 ? cfg.moe.topK : 0,
    ...(lora ? { lora: { baseBytes: cfg.lora.baseDtype === 'bf16' ? 2 : 4, embedAdapterParams, headAdapterParams, blockAdapterParams } as const } : {}),
  };
}

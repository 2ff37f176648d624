// LoRA on the experts of an MoE layer: the Hugging Face form of an expert is its own Linears
// (Mixtral's w1/w2/w3, Qwen3-MoE's gate_proj/up_proj/down_proj), so a LoRA target naming them
// adapts every expert's projection, each with its own A and B.
//
// [Note: LoRA on experts] flotilla holds a projection of G experts as one stack W (G, in, out)
// applied by a batched matmul (GroupedExperts, moe.ts), so its adapters are stacks too: A (G, r, in)
// and B (G, out, r), expert g's being PEFT's lora_A (r, in) and lora_B (out, r) of that expert's
// Linear. The forward adds scale * (x A^T) B^T per expert, two more batched matmuls, to x W; the
// adapter is a child module of the stack (`<experts>.<projection>Lora.loraA` / `.loraB`), so it
// lives in the experts' ZeRO-3 unit and, under expert parallelism, keepExperts gives a rank the
// adapters of its experts (slices of the whole stacks, as for the base). A is drawn whole from
// (seed, its name) -- U(-1/sqrt(in), 1/sqrt(in)) as a Linear's A -- before any split, B = 0, so
// every layout starts from the same adapters and step 0 equals the base exactly. Merged, W gains
// scale * A^T B^T per expert (the transposed (out, in) B A of each Linear).
import { type Tensor, noGrad, zeros } from '../tensor/index.js';
import { Module } from './module.js';
import { Dropout } from './layers.js';
import { castParam } from './precision.js';
import { seedParameter } from './init.js';
import type { ExpertProjection, GroupedDelta, GroupedExperts } from './moe.js';

/** The stack field of each projection by its module name (swiglu: gate, up, down; gelu: fc, proj). */
export const EXPERT_PROJECTIONS: Record<string, ExpertProjection> = { gate: 'w1', up: 'w3', down: 'w2', fc: 'w1', proj: 'w2' };

/** The projection names a stack of this kind has. */
export function expertProjectionNames(e: GroupedExperts): string[] {
  return e.kind === 'swiglu' ? ['gate', 'up', 'down'] : ['fc', 'proj'];
}

export interface ExpertLoraOptions {
  rank: number;
  scale: number;
  alpha: number;
  dropout: number;
}

/** The adapters of one projection of a stack of experts ([Note: LoRA on experts]). */
export class ExpertLora extends Module implements GroupedDelta {
  readonly loraA: Tensor; // (G, r, in)
  readonly loraB: Tensor; // (G, out, r)
  readonly dropout: Dropout;
  enabled = true;
  merged = false;

  constructor(readonly experts: GroupedExperts, readonly name: string, readonly opts: ExpertLoraOptions, init: { A: Tensor; B: Tensor }) {
    super();
    this.loraA = this.registerParameter('loraA', init.A);
    this.loraB = this.registerParameter('loraB', init.B);
    this.dropout = this.registerModule('dropout', new Dropout(opts.dropout));
    this.dropout.training = experts.training;
    (experts as unknown as { registerModule(n: string, m: Module): Module }).registerModule(`${name}Lora`, this);
    experts.adapters[EXPERT_PROJECTIONS[name]!] = this;
  }

  get rank(): number {
    return this.opts.rank;
  }

  /** The base stack this adapter is on (G, in, out). */
  get base(): Tensor {
    return this.experts[EXPERT_PROJECTIONS[this.name]!]!;
  }

  /** scale * (x A^T) B^T per expert: x (G, L, in) -> (G, L, out). */
  delta(x: Tensor): Tensor {
    const a = castParam('linear', this.loraA), b = castParam('linear', this.loraB);
    const d = this.dropout.call(x).bmm(a.transpose(1, 2)).bmm(b.transpose(1, 2));
    return this.opts.scale === 1 ? d : d.mul(this.opts.scale);
  }

  keep(into: GroupedExperts, first: number, count: number): void {
    const slice = (p: Tensor) => noGrad(() => p.narrow(0, first, count).clone());
    const kept = new ExpertLora(into, this.name, this.opts, { A: slice(this.loraA), B: slice(this.loraB) });
    kept.enabled = this.enabled;
    kept.merged = this.merged;
    if (!this.loraA.requiresGrad) kept.loraA.requiresGrad = false;
    if (!this.loraB.requiresGrad) kept.loraB.requiresGrad = false;
  }

  /** scale * A^T B^T (G, in, out) in the base's dtype. */
  private product(): Tensor {
    const w = this.base;
    if (w.storageNbytes() === 0) throw new Error('LoRA: merge needs the full expert stacks; these have no storage here (sharded under ZeRO-3): merge on a whole model');
    const p = this.loraA.to(w.dtype).transpose(1, 2).bmm(this.loraB.to(w.dtype).transpose(1, 2));
    return this.opts.scale === 1 ? p : p.mul(this.opts.scale);
  }

  merge(): void {
    if (this.merged) throw new Error('LoRA: the adapter is already merged; unmerge() it first');
    noGrad(() => this.base.add_(this.product()));
    this.merged = true;
  }

  unmerge(): void {
    if (!this.merged) throw new Error('LoRA: the adapter is not merged');
    noGrad(() => this.base.sub_(this.product()));
    this.merged = false;
  }
}

/** Whether a whole-model parameter name is an expert adapter's (`<experts>.<projection>Lora.loraA` or `.loraB`). */
export function isExpertLoraParameter(name: string): boolean {
  return /Lora\.lora[AB]$/.test(name);
}

/**
 * A's and B's initial values for the adapter parameter `name` of shape `shape` (G, r, in) or
 * (G, out, r): A from (seed, name) when a seed is given, B zero.
 */
export function drawExpertLora(name: string, out: Tensor, initSeed: number | undefined): void {
  noGrad(() => {
    if (name.endsWith('.loraB')) {
      out.zero_();
      return;
    }
    if (!name.endsWith('.loraA') || out.ndim !== 3) throw new Error(`LoRA: ${name} is not an expert adapter parameter`);
    if (initSeed !== undefined) seedParameter(initSeed, name);
    const bound = 1 / Math.sqrt(out.shape[2]!);
    out.uniform_(-bound, bound);
  });
}

/** Attaches adapters of `opts` to projection `name` of the stack at module path `path`. */
export function attachExpertLora(experts: GroupedExperts, path: string, name: string, opts: ExpertLoraOptions, initSeed: number | undefined): ExpertLora {
  const w = experts[EXPERT_PROJECTIONS[name]!]!;
  const [G, In, Out] = w.shape as [number, number, number];
  if (Object.prototype.hasOwnProperty.call(experts.adapters, EXPERT_PROJECTIONS[name]!)) throw new Error(`LoRA: ${path}.${name} already has an adapter; apply LoRA once`);
  const A = zeros([G, opts.rank, In], { dtype: w.dtype }), B = zeros([G, Out, opts.rank], { dtype: w.dtype });
  drawExpertLora(`${path}.${name}Lora.loraA`, A, initSeed);
  drawExpertLora(`${path}.${name}Lora.loraB`, B, initSeed);
  return new ExpertLora(experts, name, opts, { A, B });
}

/** Every expert adapter of a model, by `<experts path>.<projection>`. */
export function expertLoraAdapters(model: Module): [string, ExpertLora][] {
  const out: [string, ExpertLora][] = [];
  for (const [path, m] of model.namedModules()) if (m instanceof ExpertLora) out.push([path.replace(/Lora$/, ''), m]);
  return out;
}

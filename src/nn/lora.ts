// Low-rank adapters (LoRA, Hu et al. 2021, as PEFT defines them): a Linear y = W x + b gains
// y = W x + b + scale * B(A(dropout(x))), A (r, in) and B (out, r) trained, W and b frozen.
//
// [Note: LoRA] An adapter attaches to the Linear in place instead of replacing it in its parent:
// the Linear stays the same object under the same path, with loraA, loraB (and loraDropout) added
// as its children, and only the instance's forward is wrapped (as tensor-parallel styles wrap it).
// So `layers.0.attn.q.weight` is still that name and that tensor, and everything keyed by module
// path or by the Linear object keeps working untouched: the Hugging Face name maps and base
// checkpoints (a base's state is a subset of the adapted model's), ZeRO-3 unit policies (the
// adapters live inside their Linear's unit and are gathered with it) and the parents' own fields
// (`this.q.call(x)` still reaches the wrapped forward). The adapted model's new parameters are
// exactly `<linear>.loraA.weight` (r, in) and `<linear>.loraB.weight` (out, r), PEFT's lora_A and
// lora_B. A and B are Linears themselves, so they read their weights through the precision policy
// (castParam) and a unit holding them is still gathered in bfloat16 under bf16-mixed ZeRO-3.
//
// Initialisation is PEFT's default (init_lora_weights=True): A = kaiming_uniform_(a=sqrt(5)),
// whose bound is gain * sqrt(3 / fan_in) with gain = sqrt(2 / (1 + a^2)) = sqrt(1/3), i.e.
// U(-1/sqrt(in), 1/sqrt(in)) -- the same as a Linear's default weight; B = 0, so an adapted model
// equals its base exactly until B has trained.
import { type Tensor, noGrad, empty, isFloating } from '../tensor/index.js';
import { seedParameter } from './init.js';
import { Module } from './module.js';
import { Dropout, Linear } from './layers.js';
import { chooseLoraTargets, loraRankProblem, type LinearShape } from './lora_targets.js';
import { GroupedExperts } from './moe.js';
import { EXPERT_PROJECTIONS, attachExpertLora, drawExpertLora, expertLoraAdapters, expertProjectionNames, isExpertLoraParameter, type ExpertLora } from './lora_experts.js';

export interface LoraOptions {
  /** The adapters' rank r (> 0, at most the smaller dimension of each target). */
  rank: number;
  /** The scale's numerator: scale = alpha / rank (alpha / sqrt(rank) with rsLora). Default: rank (scale 1). */
  alpha?: number;
  /** Dropout on the adapter's input (PEFT's lora_dropout). Default 0. */
  dropout?: number;
  /** Rank-stabilised scaling, alpha / sqrt(rank) (PEFT's use_rslora). */
  rsLora?: boolean;
}

type Forward = (x: Tensor) => Tensor;

/** The adapter of one Linear ([Note: LoRA]); made by applyLora (or attach). */
export class LoraAdapter {
  readonly A: Linear; // in -> r: weight (r, in)
  readonly B: Linear; // r -> out: weight (out, r)
  readonly dropout: Dropout;
  readonly rank: number;
  readonly alpha: number;
  readonly scale: number;
  /** When false the Linear computes its base alone (how a DPO reference is the same weights). */
  enabled = true;
  private mergedIn = false;
  private readonly baseForward: Forward;

  /** Attaches an adapter to `base` in place (it must not have one already). */
  constructor(readonly base: Linear, opts: LoraOptions) {
    if (adapters.has(base)) throw new Error('LoRA: this Linear already has an adapter');
    checkRank(opts.rank, base, '');
    this.rank = opts.rank;
    this.alpha = opts.alpha ?? opts.rank;
    this.scale = opts.rsLora ? this.alpha / Math.sqrt(this.rank) : this.alpha / this.rank;
    this.A = new Linear(base.inFeatures, this.rank, { bias: false }); // Linear's default init is PEFT's for A
    this.B = new Linear(this.rank, base.outFeatures, { bias: false });
    noGrad(() => this.B.weight.zero_());
    this.dropout = new Dropout(opts.dropout ?? 0);
    const dtype = base.weight.dtype;
    if (this.A.weight.dtype !== dtype) throw new Error(`LoRA: the base weight is ${dtype} but new parameters are ${this.A.weight.dtype}; build the adapters under the same default dtype as the model`);
    const reg = base as unknown as { registerModule(name: string, m: Module): Module };
    reg.registerModule('loraA', this.A);
    reg.registerModule('loraB', this.B);
    reg.registerModule('loraDropout', this.dropout);
    this.dropout.training = base.training;
    const target = base as unknown as { forward: Forward };
    this.baseForward = target.forward.bind(base);
    target.forward = (x: Tensor) => {
      const y = this.baseForward(x);
      if (!this.enabled || this.mergedIn) return y;
      return y.add(this.delta(x));
    };
    adapters.set(base, this);
  }

  /** scale * B(A(dropout(x))): what the adapter adds to the base's output. */
  delta(x: Tensor): Tensor {
    const d = this.B.call(this.A.call(this.dropout.call(x)));
    return this.scale === 1 ? d : d.mul(this.scale);
  }

  /** Whether W holds scale * B A now (merge()). */
  get merged(): boolean {
    return this.mergedIn;
  }

  /** W += scale * B A; the forward then computes the base alone (which now includes the adapter). */
  merge(): void {
    if (this.mergedIn) throw new Error('LoRA: the adapter is already merged; unmerge() it first');
    noGrad(() => this.base.weight.add_(this.product()));
    this.mergedIn = true;
  }

  /** W -= scale * B A: W back to the base within one rounding of each element (not bit for bit). */
  unmerge(): void {
    if (!this.mergedIn) throw new Error('LoRA: the adapter is not merged');
    noGrad(() => this.base.weight.sub_(this.product()));
    this.mergedIn = false;
  }

  /** scale * B A, (out, in), computed in the base weight's dtype. */
  private product(): Tensor {
    const w = this.base.weight;
    if (w.storageNbytes() === 0) throw new Error('LoRA: merge needs the full base weight; this one has no storage here (sharded under ZeRO-3): merge on a whole model');
    const ba = this.B.weight.to(w.dtype).matmul(this.A.weight.to(w.dtype));
    return this.scale === 1 ? ba : ba.mul(this.scale);
  }
}

const adapters = new WeakMap<Linear, LoraAdapter>();

/** Whether a whole-model parameter name is an adapter's (`<linear>.loraA.weight` or `.loraB.weight`). */
export function isLoraParameter(name: string): boolean {
  return /\.lora[AB]\.weight$/.test(name);
}

export { expertLoraAdapters, isExpertLoraParameter, type ExpertLora };

/** The adapter attached to a Linear, if any. */
export function loraAdapterOf(m: Module): LoraAdapter | undefined {
  return m instanceof Linear ? adapters.get(m) : undefined;
}

/** Every adapter in a model, by its Linear's module path. */
export function loraAdapters(model: Module): [string, LoraAdapter][] {
  const out: [string, LoraAdapter][] = [];
  for (const [path, m] of model.namedModules()) {
    const a = loraAdapterOf(m);
    if (a) out.push([path, a]);
  }
  return out;
}

/** Runs fn with every adapter of the model off (the base alone), restoring each one's switch after. */
export function withAdaptersDisabled<T>(model: Module, fn: () => T): T {
  const all: { enabled: boolean }[] = [...loraAdapters(model).map(([, a]) => a), ...expertLoraAdapters(model).map(([, a]) => a)];
  const before = all.map((a) => a.enabled);
  for (const a of all) a.enabled = false;
  try {
    const r = fn();
    if (r instanceof Promise) throw new Error('withAdaptersDisabled() takes a synchronous function');
    return r;
  } finally {
    all.forEach((a, i) => (a.enabled = before[i]!));
  }
}

/** Merges every adapter of the model into its base weight. */
export function mergeLora(model: Module): void {
  for (const [, a] of loraAdapters(model)) a.merge();
  for (const [, a] of expertLoraAdapters(model)) a.merge();
}

/** Takes every merged adapter back out of its base weight. */
export function unmergeLora(model: Module): void {
  for (const [, a] of loraAdapters(model)) if (a.merged) a.unmerge();
  for (const [, a] of expertLoraAdapters(model)) if (a.merged) a.unmerge();
}

function checkRank(rank: number, m: Linear, path: string): void {
  const p = loraRankProblem(rank, { path, inFeatures: m.inFeatures, outFeatures: m.outFeatures });
  if (p !== undefined) throw new Error(`LoRA: ${p}`);
}

export interface ApplyLoraOptions extends LoraOptions {
  /**
   * Which Linears get an adapter: each entry is a module name (the last component of a module
   * path, e.g. "q" or Hugging Face's "q_proj"), a whole module path ("layers.0.attn.q" or
   * "model.layers.0.self_attn.q_proj"), or "all-linear" (every Linear but the output head).
   */
  targets: readonly string[];
  /**
   * Hugging Face module paths by flotilla module path (e.g. "layers.0.attn.q" ->
   * "model.layers.0.self_attn.q_proj"), so targets can use either; hfModuleNames() makes it from a
   * model's name map.
   */
  hfNames?: ReadonlyMap<string, string>;
  /** Draws each A from (initSeed, its parameter name), independent of order and rank. */
  initSeed?: number;
  /** The output head's module path, left out of "all-linear" (default "head"). */
  head?: string;
  /**
   * Storage of the frozen parameters (default: as built). 'bfloat16' halves the base's bytes; it is
   * computed in the run's precision ([Note: bf16 base] in precision.ts). The adapters keep the
   * dtype the model was built in.
   */
  baseDtype?: 'float32' | 'bfloat16';
  /**
   * The module is a part of the whole model (a pipeline stage, under whole-model names): a target
   * that matches none of its Linears is not an error (it names Linears of other stages), and a part
   * none of the targets matches gets no adapter and is frozen whole. Check the targets against the
   * whole model's Linears elsewhere (the config's validation does).
   */
  part?: boolean;
}

/** What applyLora did. */
export interface AppliedLora {
  /** The adapters, by their Linear's module path. */
  adapters: Map<string, LoraAdapter>;
  /** The adapters on experts, by `<experts path>.<projection>` ([Note: LoRA on experts]). */
  expertAdapters: Map<string, ExpertLora>;
  /** The names of the parameters now trainable (the adapters') and of those frozen. */
  trainable: string[];
  frozen: string[];
}

/**
 * Hugging Face module paths by flotilla module path, from a model's tensor name map (the entries of
 * Linear weights: "<path>.weight" -> "<hf path>.weight").
 */
export function hfModuleNames(tensors: readonly { name: string; hf: string; stack?: unknown }[]): Map<string, string> {
  const out = new Map<string, string>();
  for (const t of tensors) {
    if (t.name.endsWith('.weight') && t.hf.endsWith('.weight')) out.set(t.name.slice(0, -7), t.hf.slice(0, -7));
    // An expert's Linear, one slice of a stack: the stack's projection takes its path without the expert's index.
    else if (t.stack !== undefined && t.hf.endsWith('.weight')) out.set(t.name, t.hf.slice(0, -7).replace(/\.experts\.\d+\./, '.experts.'));
  }
  return out;
}

/**
 * Injects adapters around the model's Linears that `targets` names ([Note: LoRA]) and freezes every
 * other parameter of the model (requiresGrad = false), so only the adapters train. A target that
 * matches no Linear, or a rank that a target cannot hold, is an error naming the fix.
 */
export function applyLora(model: Module, opts: ApplyLoraOptions): AppliedLora {
  if (!Number.isInteger(opts.rank) || opts.rank <= 0) throw new Error(`LoRA: rank must be a positive whole number, got ${opts.rank}`);
  const head = opts.head ?? 'head';
  const linears = model.namedModules().filter((e): e is [string, Linear] => e[1] instanceof Linear && e[0] !== '');
  for (const [path, m] of linears) if (adapters.has(m)) throw new Error(`LoRA: ${path} already has an adapter; apply LoRA once`);
  const hf = opts.hfNames ?? new Map<string, string>();
  const shapes: LinearShape[] = linears.map(([path, m]) => ({ path, ...(hf.has(path) ? { hf: hf.get(path)! } : {}), inFeatures: m.inFeatures, outFeatures: m.outFeatures }));
  // Expert projections ([Note: LoRA on experts]): `<experts path>.<gate|up|down|fc|proj>`.
  const stacks: [string, GroupedExperts, string][] = model.namedModules()
    .filter((e): e is [string, GroupedExperts] => e[1] instanceof GroupedExperts)
    .flatMap(([path, e]) => expertProjectionNames(e).map((n): [string, GroupedExperts, string] => [`${path}.${n}`, e, n]));
  for (const [path, e, n] of stacks) {
    const w = e[EXPERT_PROJECTIONS[n]!]!;
    shapes.push({ path, ...(hf.has(path) ? { hf: hf.get(path)! } : {}), inFeatures: w.shape[1]!, outFeatures: w.shape[2]!, experts: e.groups });
  }
  const targets = opts.part ? opts.targets.filter((t) => 'chosen' in chooseLoraTargets(shapes, [t], head)) : opts.targets;
  const r = opts.part && targets.length === 0 ? { chosen: new Set<string>() } : chooseLoraTargets(shapes, targets, head);
  if ('problem' in r) throw new Error(`LoRA: ${r.problem}`);
  const chosen = r.chosen;
  for (const [path, m] of linears) if (chosen.has(path)) checkRank(opts.rank, m, path);
  for (const l of shapes) {
    if (l.experts === undefined || !chosen.has(l.path)) continue;
    const p = loraRankProblem(opts.rank, l);
    if (p !== undefined) throw new Error(`LoRA: ${p}`);
  }

  const made = new Map<string, LoraAdapter>();
  for (const [path, m] of linears) {
    if (!chosen.has(path)) continue;
    const a = noGrad(() => {
      if (opts.initSeed !== undefined) seedParameter(opts.initSeed, `${path}.loraA.weight`);
      return new LoraAdapter(m, opts);
    });
    made.set(path, a);
  }
  const madeExperts = new Map<string, ExpertLora>();
  const alpha = opts.alpha ?? opts.rank;
  const scale = opts.rsLora ? alpha / Math.sqrt(opts.rank) : alpha / opts.rank;
  for (const [path, e, n] of stacks) {
    if (!chosen.has(path)) continue;
    const experts = path.slice(0, path.lastIndexOf('.'));
    madeExperts.set(path, noGrad(() => attachExpertLora(e, experts, n, { rank: opts.rank, alpha, scale, dropout: opts.dropout ?? 0 }, opts.initSeed)));
  }
  const own = new Set<Tensor>();
  for (const a of made.values()) own.add(a.A.weight).add(a.B.weight);
  for (const a of madeExperts.values()) own.add(a.loraA).add(a.loraB);
  const trainable: string[] = [], frozen: string[] = [];
  for (const [name, p] of model.namedParameters()) {
    if (own.has(p)) trainable.push(name);
    else {
      if (p.requiresGrad) p.requiresGrad = false;
      if (opts.baseDtype !== undefined) storeAs(p, opts.baseDtype);
      frozen.push(name);
    }
  }
  return { adapters: made, expertAdapters: madeExperts, trainable, frozen };
}

/**
 * A frozen parameter's storage converted to `dtype`, in place: the same tensor object (the module's
 * field, a tied weight's second owner and the adapter's base all hold it) with new storage. A
 * parameter without storage yet (deferred init) gets none in the new dtype either.
 */
function storeAs(p: Tensor, dtype: 'float32' | 'bfloat16'): void {
  if (p.dtype === dtype || !isFloating(p.dtype)) return;
  if (p.storageNbytes() === 0 && p.numel() > 0) p.replaceData_(empty(p.shape, { dtype }).resizeStorage_(0));
  else p.replaceData_(noGrad(() => p.to(dtype)));
}



/**
 * The initial values applyLora gives the adapter parameter `name` (`<path>.loraA.weight`: drawn
 * from (initSeed, name) as A's Linear draws it; `<path>.loraB.weight`: zero), written into `out`: how
 * adapters of a model built without memory are made where ZeRO-3 makes its shards ([Note: deferred
 * init] in module.ts).
 */
export function drawLoraParameter(name: string, out: Tensor, initSeed: number): void {
  if (isExpertLoraParameter(name)) return drawExpertLora(name, out, initSeed);
  noGrad(() => {
    if (name.endsWith('.loraB.weight')) {
      out.zero_();
      return;
    }
    if (!name.endsWith('.loraA.weight') || out.ndim !== 2) throw new Error(`LoRA: ${name} is not an adapter parameter`);
    seedParameter(initSeed, name);
    const bound = 1 / Math.sqrt(out.shape[1]!); // Linear(in, r)'s default init, PEFT's for A
    out.uniform_(-bound, bound);
  });
}

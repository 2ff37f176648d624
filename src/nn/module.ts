// Module: named parameters, buffers and children, train/eval, and state dicts. Models know nothing
// about ranks; parallelism wraps them from outside (src/parallel).
import { Tensor, keep, noGrad, isGradEnabled, tidy, elementSize } from '../tensor/index.js';

export type Parameter = Tensor;

// [Note: deferred init] A model can be built without giving its parameters any memory, as FSDP2
// users build on the meta device and initialise after fully_shard: inside deferParameters(),
// registerParameter frees each parameter's storage as soon as the layer has made it (one
// parameter exists at full size at a time), and the model sets `deferredInit`, which writes the
// initial values of any parameter by name. A sharding wrapper then materialises one bucket at a
// time and keeps only its shard (ZeRO-3: data_parallel/grad_buffer.ts), so no rank ever holds the whole model;
// any other user calls materialize() first. Calling a module whose parameters have no storage yet
// is an error that names both ways out.
/** How a model built under deferParameters() produces its initial values (see [Note: deferred init]). */
export interface DeferredInit {
  /** Writes the initial values of the parameter `name` (dotted, from this module) into `out`, a tensor of its shape. */
  init(name: string, out: Tensor): void;
}

let deferring = 0;

/** Runs fn (a model's construction) with parameters registered without storage ([Note: deferred init]). */
export function deferParameters<T>(fn: () => T): T {
  deferring++;
  try {
    return fn();
  } finally {
    deferring--;
  }
}

/** Runs before a module's forward (e.g. to gather its sharded parameters). */
export type ForwardPreHook = (module: Module, args: unknown[]) => void;
/** Runs after a module's forward with its output (e.g. to free gathered parameters, or hook the output's gradient). */
export type ForwardHook = (module: Module, args: unknown[], output: unknown) => void;

// [Note: module call path] Parents invoke children through call(), never forward() directly, so
// that forward pre/post hooks see every invocation: this is how parallel wrappers act around a
// unit's forward (FSDP gathers before it and frees after it) without the model knowing.
//
// [Note: forward scope] A forward's intermediates die with the call, as a Python forward's locals
// do: call() releases this process's handles on every tensor made inside that its output does not
// reach. Autograd keeps what backward needs (its saved tensors) and frees each as soon as backward
// has used it, so a backward pass reuses the memory, still in cache, of the activations it has
// consumed. Held until the training step's tidy() ended instead, they made a GPT backward ~10%
// slower than PyTorch's (docs/BENCHMARKS.md, step section). A module that stores a tensor made in
// forward for later (a cache) keep()s it and disposes it itself.
export class Module {
  training = true;
  private readonly params = new Map<string, Tensor>();
  private readonly buffers = new Map<string, Tensor>();
  private readonly children = new Map<string, Module>();
  private readonly preHooks = new Map<number, ForwardPreHook>();
  private readonly postHooks = new Map<number, ForwardHook>();
  private static nextHookId = 0;
  /** Set while the parameters have no storage yet ([Note: deferred init]); cleared once they have it. */
  deferredInit: DeferredInit | undefined;

  /**
   * Runs forward with this module's hooks around it: the one way a module is invoked. The call is a
   * tidy() scope ([Note: forward scope]): tensors made inside that the output does not reach (a
   * tensor, or arrays and plain objects of them) are released when it returns.
   */
  call<A extends unknown[], R>(this: { forward(...a: A): R }, ...args: A): R {
    const self = this as unknown as Module;
    if (self.deferredInit) {
      throw new Error(
        `${self.constructor.name}: its parameters were built without memory (deferred init); wrap it with ZeRO-3 ` +
          '(parallelize with zero = 3, or DataParallel { zero: 3 }), which initialises each rank\'s shard, or call materialize() first',
      );
    }
    return tidy(() => {
      for (const h of self.preHooks.values()) h(self, args);
      const out = this.forward(...args);
      for (const h of self.postHooks.values()) h(self, args, out);
      return out;
    });
  }

  /** Adds a hook that runs before every forward; returns its remover. */
  registerForwardPreHook(fn: ForwardPreHook): () => void {
    const id = Module.nextHookId++;
    this.preHooks.set(id, fn);
    return () => void this.preHooks.delete(id);
  }

  /** Adds a hook that runs after every forward, with the output; returns its remover. */
  registerForwardHook(fn: ForwardHook): () => void {
    const id = Module.nextHookId++;
    this.postHooks.set(id, fn);
    return () => void this.postHooks.delete(id);
  }

  /**
   * Adds a hook that runs when backward reaches this module: once per forward call whose output
   * takes part in a backward pass, as soon as the gradient of that output is computed and before
   * the module's own backward runs (FSDP gathers a unit's parameters here). Returns its remover.
   */
  registerBackwardPreHook(fn: (module: Module) => void): () => void {
    return this.registerForwardHook((m, _args, out) => {
      if (!isGradEnabled()) return;
      let fired = false;
      for (const t of tensorsIn(out)) {
        if (!t.requiresGrad) continue;
        // The hook lives with the output's graph and goes with it.
        t.registerHook(() => {
          if (!fired) {
            fired = true;
            fn(m);
          }
          return undefined;
        });
      }
    });
  }

  /** Registers a trainable leaf tensor; it outlives every tidy() scope. */
  protected registerParameter(name: string, t: Tensor): Tensor {
    keep(t);
    if (!t.requiresGrad) t.requiresGrad = true;
    if (deferring > 0 && t.storageNbytes() > 0) t.resizeStorage_(0); // [Note: deferred init]
    this.params.set(name, t);
    return t;
  }

  /**
   * Gives every parameter built without memory its storage and initial values
   * ([Note: deferred init]); a no-op for a module built the usual way.
   */
  materialize(): this {
    const d = this.deferredInit;
    if (!d) return this;
    noGrad(() => {
      for (const [name, p] of this.namedParameters()) {
        if (p.storageNbytes() > 0 || p.numel() === 0) continue;
        p.resizeStorage_(p.numel() * elementSize(p.dtype));
        d.init(name, p);
      }
    });
    this.deferredInit = undefined;
    return this;
  }

  /** Registers state that is saved but not trained (e.g. a causal mask). */
  protected registerBuffer(name: string, t: Tensor): Tensor {
    keep(t);
    this.buffers.set(name, t);
    return t;
  }

  protected registerModule<M extends Module>(name: string, m: M): M {
    this.children.set(name, m);
    return m;
  }

  namedChildren(): [string, Module][] {
    return [...this.children.entries()];
  }

  /** Every module in the tree, depth first, with dotted names ('' is this module). */
  namedModules(prefix = ''): [string, Module][] {
    const out: [string, Module][] = [[prefix, this]];
    for (const [n, c] of this.children) out.push(...c.namedModules(prefix ? `${prefix}.${n}` : n));
    return out;
  }

  /** Parameters with dotted names, each tensor once (a tied weight appears under its first name). */
  namedParameters(): [string, Tensor][] {
    const seen = new Set<Tensor>();
    const out: [string, Tensor][] = [];
    for (const [prefix, m] of this.namedModules()) {
      for (const [n, p] of m.params) {
        if (seen.has(p)) continue;
        seen.add(p);
        out.push([prefix ? `${prefix}.${n}` : n, p]);
      }
    }
    return out;
  }

  parameters(): Tensor[] {
    return this.namedParameters().map(([, p]) => p);
  }

  namedBuffers(): [string, Tensor][] {
    const out: [string, Tensor][] = [];
    for (const [prefix, m] of this.namedModules()) {
      for (const [n, b] of m.buffers) out.push([prefix ? `${prefix}.${n}` : n, b]);
    }
    return out;
  }

  numParams(): number {
    return this.parameters().reduce((a, p) => a + p.numel(), 0);
  }

  train(on = true): this {
    for (const [, m] of this.namedModules()) m.training = on;
    return this;
  }

  eval(): this {
    return this.train(false);
  }

  /** Every parameter and buffer by dotted name (tied weights appear under each name, as in PyTorch). */
  stateDict(): Record<string, Tensor> {
    const out: Record<string, Tensor> = {};
    for (const [prefix, m] of this.namedModules()) {
      for (const [n, p] of m.params) out[prefix ? `${prefix}.${n}` : n] = p;
      for (const [n, b] of m.buffers) out[prefix ? `${prefix}.${n}` : n] = b;
    }
    return out;
  }

  /** Copies values in place (parameters keep their storage, so views and grad buffers stay valid). */
  loadStateDict(sd: Record<string, Tensor>, opts: { strict?: boolean } = {}): void {
    const strict = opts.strict ?? true;
    const own = this.stateDict();
    const missing = Object.keys(own).filter((k) => !(k in sd));
    const unexpected = Object.keys(sd).filter((k) => !(k in own));
    if (strict && (missing.length > 0 || unexpected.length > 0)) {
      throw new Error(
        `loadStateDict: state does not match this model` +
          (missing.length ? `; missing: ${missing.join(', ')}` : '') +
          (unexpected.length ? `; unexpected: ${unexpected.join(', ')}` : '') +
          ' (load a checkpoint of the same model config, or pass { strict: false })',
      );
    }
    const bad: string[] = [];
    for (const [k, t] of Object.entries(own)) {
      const src = sd[k];
      if (src && src.shape.join('x') !== t.shape.join('x')) bad.push(`${k}: have [${t.shape}], got [${src.shape}]`);
    }
    if (bad.length) throw new Error(`loadStateDict: shape mismatch: ${bad.join('; ')}`);
    noGrad(() => {
      for (const [k, t] of Object.entries(own)) {
        const src = sd[k];
        if (src) t.copy_(src);
      }
    });
  }

  /** Frees every parameter and buffer. */
  dispose(): void {
    for (const [, t] of Object.entries(this.stateDict())) t.dispose();
  }
}

/** The tensors in a forward's output: a tensor, or arrays and objects of them. */
function tensorsIn(out: unknown): Tensor[] {
  if (out instanceof Tensor) return [out];
  if (Array.isArray(out)) return out.flatMap(tensorsIn);
  if (out && typeof out === 'object') return Object.values(out as Record<string, unknown>).flatMap(tensorsIn);
  return [];
}

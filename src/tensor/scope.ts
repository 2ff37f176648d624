// Memory scopes: every tensor created inside tidy() is freed when it returns, except what it returns
// and what keep() marks. The GC finalizer is only a backstop (see native/tensor.cc).
//
// [Note: external memory] V8 learns a tensor's bytes (escaped()) only when the tensor may outlive
// every scope: created outside any scope, kept, or returned out of the outermost one. A step's
// temporaries are freed by their scope and never reported, so they do not make V8 run full
// collections to find garbage that is not there; what the GC backstop may have to free is reported.

export interface Disposable {
  dispose(): void;
  /** The object may now outlive every scope (a tensor reports its native bytes). */
  escaped?(): void;
}

const stack: Set<Disposable>[] = [];

/** Registers a new tensor with the innermost scope; outside scopes it has escaped already. */
export function track(t: Disposable): void {
  if (stack.length > 0) stack[stack.length - 1]!.add(t);
  else t.escaped?.();
}

/** Removes a tensor from every open scope so it outlives them (parameters, buffers, state). */
export function keep<T extends Disposable>(t: T): T {
  for (const s of stack) s.delete(t);
  t.escaped?.();
  return t;
}

function collect(value: unknown, out: Set<unknown>): void {
  if (value === null || value === undefined) return;
  if (Array.isArray(value)) {
    for (const v of value) collect(v, out);
  } else if (typeof value === 'object') {
    if ('dispose' in (value as object) && typeof (value as Disposable).dispose === 'function') out.add(value);
    else if (Object.getPrototypeOf(value) === Object.prototype) for (const v of Object.values(value as object)) collect(v, out);
  }
}

/**
 * Runs fn in a scope. Tensors created inside are disposed on return, except those reachable from the
 * return value (arrays and plain objects are searched), which move to the enclosing scope.
 */
export function tidy<T>(fn: () => T): T {
  const scope = new Set<Disposable>();
  stack.push(scope);
  let result: T;
  try {
    result = fn();
  } catch (e) {
    stack.pop();
    for (const t of scope) t.dispose();
    throw e;
  }
  stack.pop();
  if (result instanceof Promise) throw new Error('tidy() takes a synchronous function; await outside the scope');
  const kept = new Set<unknown>();
  collect(result, kept);
  for (const t of scope) {
    if (kept.has(t)) track(t);
    else t.dispose();
  }
  return result;
}

/** Number of scopes currently open (for tests). */
export function scopeDepth(): number {
  return stack.length;
}

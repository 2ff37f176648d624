// A setting of one of a few named values that code deep in a model reads without it being passed
// down (the activation-checkpoint mode, the kernels): the trainer opens it around each step, a
// nested scope wins, and outside every scope it is the default.

export interface AmbientChoice<C extends string> {
  /** Runs fn with the setting at `value` (refused, naming the choices, if it is not one of them). */
  with<T>(value: C, fn: () => T): T;
  /** The value in effect. */
  current(): C;
}

/** field: the config field's name, for the refusal. */
export function ambientChoice<C extends string>(field: string, choices: readonly C[], fallback: C): AmbientChoice<C> {
  const stack: C[] = [];
  return {
    with<T>(value: C, fn: () => T): T {
      if (!choices.includes(value)) throw new Error(`${field} "${value}" is not one of ${choices.map((m) => `"${m}"`).join(', ')}`);
      stack.push(value);
      try {
        return fn();
      } finally {
        stack.pop();
      }
    },
    current: () => stack[stack.length - 1] ?? fallback,
  };
}

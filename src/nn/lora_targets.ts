// Which Linears a LoRA `targets` list names, on names and shapes alone. applyLora (lora.ts) chooses
// its Linears here, and the config's validation checks a run's [lora] section against the Linears
// a model's rules list (ModelRules.linears, src/models/spec.ts) before any rank starts, so both
// say the same thing and the launcher needs no tensor library for it.

/** One Linear of a model: its module path, its Hugging Face module path when it has one, its shape. */
export interface LinearShape {
  path: string;
  hf?: string;
  inFeatures: number;
  outFeatures: number;
  /** A projection of this many experts held as one stack (an MoE layer's; [Note: LoRA on experts]): named, not in "all-linear". */
  experts?: number;
}

const last = (path: string): string => path.slice(path.lastIndexOf('.') + 1);

/**
 * The module paths `targets` names among `linears` (each entry a module name, the last component of
 * a flotilla or Hugging Face path, a whole path, or "all-linear": every Linear but the head), or the
 * problem when a target names none or there are no targets.
 */
export function chooseLoraTargets(linears: readonly LinearShape[], targets: readonly string[], head = 'head'): { chosen: Set<string> } | { problem: string } {
  if (targets.length === 0) return { problem: 'no targets; name the modules to adapt (e.g. ["q_proj", "v_proj"]) or "all-linear"' };
  const namesOf = (l: LinearShape): string[] => (l.hf === undefined ? [l.path] : [l.path, l.hf]);
  const chosen = new Set<string>();
  for (const target of targets) {
    const hits = linears.filter((l) => (target === 'all-linear' ? l.path !== head && l.experts === undefined : namesOf(l).some((n) => n === target || last(n) === target)));
    if (hits.length === 0) {
      const names = [...new Set(linears.flatMap((l) => namesOf(l).map(last)))].sort();
      return { problem: `target "${target}" matches no Linear of this model; its Linears are named ${names.map((n) => `"${n}"`).join(', ')} (or use "all-linear")` };
    }
    for (const l of hits) chosen.add(l.path);
  }
  return { chosen };
}

/** Why a Linear cannot hold adapters of this rank (undefined when it can); a dimension of 0 is not known yet. */
export function loraRankProblem(rank: number, l: LinearShape): string | undefined {
  if (!Number.isInteger(rank) || rank <= 0) return `rank must be a positive whole number, got ${rank}`;
  const most = Math.min(l.inFeatures, l.outFeatures);
  if (most === 0 || rank <= most) return undefined;
  return `rank ${rank} is larger than the smaller dimension of ${l.path || 'the target'} (${l.outFeatures} x ${l.inFeatures}); use a rank of at most ${most}`;
}

/** Every problem of adapters of `rank` on `targets` of these Linears, and the chosen paths. */
export function loraTargetProblems(linears: readonly LinearShape[], opts: { rank: number; targets: readonly string[]; head?: string }): { chosen: Set<string>; problems: string[] } {
  const r = chooseLoraTargets(linears, opts.targets, opts.head);
  if ('problem' in r) return { chosen: new Set(), problems: [r.problem] };
  const problems: string[] = [];
  for (const l of linears) {
    if (!r.chosen.has(l.path)) continue;
    const p = loraRankProblem(opts.rank, l);
    if (p !== undefined) {
      problems.push(p);
      break; // one rank message is enough: the fix is the same for every target
    }
  }
  return { chosen: r.chosen, problems };
}

/** Parameters the adapters of `rank` on these Linears add: r x (in + out) each (per expert of a stack). */
export function loraParamCount(linears: readonly LinearShape[], chosen: ReadonlySet<string>, rank: number): number {
  return linears.reduce((a, l) => a + (chosen.has(l.path) ? (l.experts ?? 1) * rank * (l.inFeatures + l.outFeatures) : 0), 0);
}

/** A LoRA model's parameters: how many Linears are adapted, the adapters' parameters, the frozen base's. */
export interface LoraCounts {
  modules: number;
  trainable: number;
  frozen: number;
}

/** The counts of adapters of `rank` on `targets` of these Linears, over a base of `frozen` parameters. */
export function loraCounts(linears: readonly LinearShape[], opts: { rank: number; targets: readonly string[] }, frozen: number): LoraCounts {
  const { chosen } = loraTargetProblems(linears, opts);
  return { modules: chosen.size, trainable: loraParamCount(linears, chosen, opts.rank), frozen };
}

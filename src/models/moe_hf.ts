// What the Hugging Face forms of MoE models share (mixtral_hf.ts, qwen3_moe_hf.ts): one router Linear
// and one Linear a projection a expert, each a slice of flotilla's grouped expert stacks
// (GroupedExperts in src/nn/moe.ts: (E, C, H) gate/up, (E, H, C) down), transposed.
import type { HfTensor } from './spec.js';

/** The HF names of an MoE block's tensors, below its prefix: the router and expert j's projections. */
export interface ExpertNames {
  router: string;
  gate(j: number): string;
  up(j: number): string;
  down(j: number): string;
}

/** Layer `layer`'s router and experts as HF tensors: flotilla prefix `layers.L.mlp.`, HF prefix `prefix`. */
export function expertTensors(layer: number | string, prefix: string, n: ExpertNames, E: number, C: number, H: number): HfTensor[] {
  const f = `layers.${layer}.mlp.`;
  const out: HfTensor[] = [{ name: `${f}router`, hf: `${prefix}${n.router}`, shape: [E, C] }];
  for (let j = 0; j < E; j++) {
    const stack = { index: j, count: E };
    out.push(
      { name: `${f}experts.gate`, hf: `${prefix}${n.gate(j)}`, shape: [H, C], transpose: true, stack },
      { name: `${f}experts.up`, hf: `${prefix}${n.up(j)}`, shape: [H, C], transpose: true, stack },
      { name: `${f}experts.down`, hf: `${prefix}${n.down(j)}`, shape: [C, H], transpose: true, stack },
    );
  }
  return out;
}

// In-place initialisers (no autograd recording).
import { Tensor, manualSeed, noGrad } from '../tensor/index.js';

export function normal_(t: Tensor, mean = 0, std = 1): Tensor {
  return noGrad(() => t.normal_(mean, std));
}
export function zeros_(t: Tensor): Tensor {
  return noGrad(() => t.zero_());
}
export function ones_(t: Tensor): Tensor {
  return noGrad(() => t.fill_(1));
}

/**
 * Seeds the generator for drawing the parameter `name` of a model seeded with `seed`: each parameter's
 * values depend on the seed and its own name only, so every layout (and every rank building a part)
 * draws the same whole-model values.
 */
export function seedParameter(seed: number, name: string): void {
  manualSeed(((seed >>> 0) + fnv1a(name)) % 2 ** 32);
}

/** 32-bit FNV-1a of a string. */
function fnv1a(s: string): number {
  let h = 0x811c9dc5;
  for (let i = 0; i < s.length; i++) {
    h ^= s.charCodeAt(i);
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  return h;
}

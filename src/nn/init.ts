// In-place initialisers (no autograd recording).
import { Tensor, noGrad } from '../tensor/index.js';

export function normal_(t: Tensor, mean = 0, std = 1): Tensor {
  return noGrad(() => t.normal_(mean, std));
}
export function zeros_(t: Tensor): Tensor {
  return noGrad(() => t.zero_());
}
export function ones_(t: Tensor): Tensor {
  return noGrad(() => t.fill_(1));
}

// Public tensor API.
export { Tensor, type Shape, type TensorOrScalar } from './tensor.js';
export * from './creation.js';
export { noGrad, isGradEnabled, backward, grad } from './autograd.js';
export { tidy, keep, scopeDepth } from './scope.js';
export { type DType, isFloating, elementSize } from './dtype.js';
import { native } from './native.js';

/** Live native tensor handles (tests use it to catch leaks). */
export function liveTensors(): number {
  return native.liveTensors();
}
/** Intra-op threads for this process (set one per rank when ranks share cores). */
export function setNumThreads(n: number): void {
  native.setNumThreads(n);
}
export function getNumThreads(): number {
  return native.getNumThreads();
}
export function torchVersion(): string {
  return native.version().torch;
}

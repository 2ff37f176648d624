// Public tensor API.
export { Tensor, type Shape, type TensorOrScalar } from './tensor.js';
export * from './creation.js';
export { noGrad, isGradEnabled, backward, grad } from './autograd.js';
export { tidy, keep, scopeDepth } from './scope.js';
export { type DType, isFloating, elementSize } from './dtype.js';
import { native } from './native.js';
export { releaseFreedMemory, releaseIdleMemory, tensorCacheStats } from './native.js';

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
/**
 * The BLAS under libtorch's CPU matmuls and the kernels it picked, for a run's first lines, e.g.
 * "OpenBLAS 0.3.21 Cooperlake kernels". OpenBLAS picks by CPU when it loads unless OPENBLAS_CORETYPE
 * pins a kernel set; matmuls are most of a step on CPU, so a pin is worth seeing (pinning Haswell's
 * AVX2 kernels on an AVX-512 machine made a GPT step about 1.6x slower in docs/BENCHMARKS.md).
 */
export function describeBlas(): string {
  const info = native.blasInfo();
  if (info === undefined) return 'BLAS not OpenBLAS';
  const version = /OpenBLAS\s+(\S+)/.exec(info.config)?.[1];
  const pinned = process.env.OPENBLAS_CORETYPE?.trim() ? ' (pinned by OPENBLAS_CORETYPE)' : '';
  return `OpenBLAS${version ? ` ${version}` : ''} ${info.core} kernels${pinned}`;
}
export { defineFunction, type FunctionCtx, type FunctionDef } from './function.js';
export { bf16Support, cpuFlags, type Bf16Support } from './cpu_features.js';

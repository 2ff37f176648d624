// What the CPU offers libtorch 1.13's bfloat16 kernels, read from /proc/cpuinfo's flags (Linux; an
// unreadable file reads as a CPU with neither feature).
// - native: avx512_bf16 or amx_bf16, instructions that compute in bfloat16. Without them every bf16
//   op converts to float32 and back around each step: bf16 layouts ran about 15x slower than float32
//   on an AVX2 EPYC, so the planner prices them from a short probe (src/plan/calibrate_compute.ts).
// - oneDnnGemm: avx512bw, avx512vl and avx512dq, what libtorch requires to send bf16 matmuls to
//   oneDNN (float32 accumulation). Without them its fallback gemm rounds the accumulator to bfloat16
//   after every term when neither operand is transposed, so a bf16 matmul's error grows with its
//   inner dimension and depends on the operands' layout.
import { readFileSync } from 'node:fs';

export interface Bf16Support {
  native: boolean;
  oneDnnGemm: boolean;
}

/** The flags of the first processor in a /proc/cpuinfo text (every core lists the same ones). */
export function cpuFlags(cpuinfo?: string): Set<string> {
  let text = cpuinfo;
  if (text === undefined) {
    try {
      text = readFileSync('/proc/cpuinfo', 'utf8');
    } catch {
      text = '';
    }
  }
  const line = /^flags\s*:(.*)$/m.exec(text);
  return new Set(line ? line[1]!.trim().split(/\s+/) : []);
}

export function bf16Support(flags: ReadonlySet<string> = cpuFlags()): Bf16Support {
  return {
    native: flags.has('avx512_bf16') || flags.has('amx_bf16'),
    oneDnnGemm: flags.has('avx512bw') && flags.has('avx512vl') && flags.has('avx512dq'),
  };
}

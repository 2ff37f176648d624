// Runs a PyTorch oracle script (test/oracle/<script>.py) on tensors from a test: inputs go out as a
// safetensors file, the script computes the same thing in PyTorch, and its results come back the same
// way. The oracle is /usr/bin/python3 with torch (override with FLOTILLA_PYTHON).
import { spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Tensor } from '../../src/tensor/index.js';
import { saveSafetensors, loadSafetensorsWithMetadata } from '../../src/checkpoint/safetensors.js';

export const ORACLE_PYTHON = process.env.FLOTILLA_PYTHON ?? '/usr/bin/python3';
const HERE = dirname(fileURLToPath(import.meta.url));
const PY_ENV = { ...process.env, OMP_NUM_THREADS: '1', MKL_NUM_THREADS: '1', PYTHONDONTWRITEBYTECODE: '1' };

let available: string | undefined | null = null;

/** undefined when the oracle can run, else the reason it cannot (tests skip with it). */
export function oracleMissing(): string | undefined {
  if (available === null) {
    const r = spawnSync(ORACLE_PYTHON, ['-c', 'import torch, sys; sys.stdout.write(torch.__version__)'], { encoding: 'utf8', env: PY_ENV });
    available = r.status === 0 ? undefined : `PyTorch oracle unavailable (${ORACLE_PYTHON} -c "import torch" failed: ${(r.stderr || String(r.error)).trim().split('\n').pop()})`;
  }
  return available;
}

/** The oracle's torch version (for benchmark reports). */
export function oracleTorchVersion(): string {
  const r = spawnSync(ORACLE_PYTHON, ['-c', 'import torch, sys; sys.stdout.write(torch.__version__)'], { encoding: 'utf8', env: PY_ENV });
  if (r.status !== 0) throw new Error(oracleMissing() ?? 'oracle failed');
  return r.stdout;
}

export interface OracleResult {
  tensors: Record<string, Tensor>;
  metadata: Record<string, string>;
}

/**
 * Runs `python3 test/oracle/<script>.py in.safetensors out.safetensors '<json args>'` and returns what it
 * wrote. Throws with the script's stderr when it fails.
 */
export function runOracle(script: string, inputs: Record<string, Tensor>, args: unknown = {}): OracleResult {
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-oracle-'));
  try {
    const inPath = join(dir, 'in.safetensors');
    const outPath = join(dir, 'out.safetensors');
    saveSafetensors(inPath, inputs);
    const r = spawnSync(ORACLE_PYTHON, [join(HERE, `${script}.py`), inPath, outPath, JSON.stringify(args)], {
      encoding: 'utf8', env: PY_ENV, cwd: HERE, maxBuffer: 64 << 20,
    });
    if (r.status !== 0) {
      throw new Error(`oracle ${script}.py failed (exit ${r.status}${r.signal ? `, ${r.signal}` : ''}):\n${r.stderr || r.error}`);
    }
    return loadSafetensorsWithMetadata(outPath);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

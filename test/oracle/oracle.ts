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

/**
 * Why oracle tests are skipped: only when FLOTILLA_SKIP_ORACLE=1 says so. scripts/setup.sh installs
 * python3-torch, so a missing or broken oracle is a failure (runOracle names it), never a silent pass.
 */
export function oracleMissing(): string | undefined {
  return process.env.FLOTILLA_SKIP_ORACLE === '1' ? 'FLOTILLA_SKIP_ORACLE=1' : undefined;
}

function oracleProblem(): string | undefined {
  if (available === null) {
    const r = spawnSync(ORACLE_PYTHON, ['-c', 'import torch, sys; sys.stdout.write(torch.__version__)'], { encoding: 'utf8', env: PY_ENV });
    available = r.status === 0 ? undefined : `PyTorch oracle unavailable (${ORACLE_PYTHON} -c "import torch" failed: ${(r.stderr || String(r.error)).trim().split('\n').pop()}); run scripts/setup.sh as root (installs python3-torch)`;
  }
  return available;
}

/** The oracle's torch version (for benchmark reports). */
export function oracleTorchVersion(): string {
  const r = spawnSync(ORACLE_PYTHON, ['-c', 'import torch, sys; sys.stdout.write(torch.__version__)'], { encoding: 'utf8', env: PY_ENV });
  if (r.status !== 0) throw new Error(oracleProblem() ?? 'oracle failed');
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
      const problem = oracleProblem();
      if (problem) throw new Error(problem);
      throw new Error(`oracle ${script}.py failed (exit ${r.status}${r.signal ? `, ${r.signal}` : ''}):\n${r.stderr || r.error}`);
    }
    return loadSafetensorsWithMetadata(outPath);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

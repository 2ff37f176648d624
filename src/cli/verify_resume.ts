// `flotilla verify CONFIG --nproc N --resume K [--steps S] [--then --nproc M --section.field=value ...]`:
// trains S steps under the config's layout, saving a checkpoint at step K, then resumes that
// checkpoint (under the same layout, or the one after --then) and trains steps K+1..S again. The
// resumed steps must equal the straight ones: bit for bit when the layout is unchanged, within the
// stated tolerance when it changes. It is how a user convinces themselves a resume is exact.
import { existsSync, mkdtempSync, readFileSync, readdirSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { loadConfig, checkRunnable, ConfigError } from '../config/index.js';

/** Relative tolerances when the layout changes (float32 sums in another order). */
export const RESUME_TOLERANCE = { loss: 1e-5, gradNorm: 1e-5, params: 1e-4 };

export interface VerifyResumeArgs {
  config: string;
  nproc: number;
  steps: number;
  resumeAt: number;
  overrides: string[];
  /** The resumed run's layout: its rank count and overrides (undefined: the same layout). */
  then?: { nproc: number; overrides: string[] };
}

interface StepRecord {
  steps: { step: number; loss: number; gradNorm: number }[];
}

/** Both runs train `steps` steps: train.epochs, which would set them, is 0 (as in verify.ts's runOverrides). */
function common(dir: string, steps: number): string[] {
  return [`--train.steps=${steps}`, '--train.epochs=0', '--train.evalEvery=0', '--train.evalBatches=1', '--log.progress=off', '--log.metrics=', `--train.runDir=${dir}`];
}

export async function verifyResumeCommand(a: VerifyResumeArgs, mainScript: string, print: (l: string) => void): Promise<number> {
  if (!(Number.isInteger(a.resumeAt) && a.resumeAt >= 1 && a.resumeAt < a.steps)) {
    throw new ConfigError([`verify --resume K needs 1 <= K < --steps (${a.steps}), got ${a.resumeAt}`]);
  }
  const cfg = loadConfig(a.config, a.overrides);
  const p1 = checkRunnable(cfg, a.nproc);
  if (p1.length > 0) throw new ConfigError(p1, a.config);
  const thenOverrides = a.then?.overrides ?? [];
  const thenNproc = a.then?.nproc ?? a.nproc;
  const thenCfg = loadConfig(a.config, [...a.overrides, ...thenOverrides]);
  const p2 = checkRunnable(thenCfg, thenNproc);
  if (p2.length > 0) throw new ConfigError(p2, `${a.config} (after --then)`);
  const sameLayout = a.then === undefined;
  // A .jsonl of examples is prepared before any rank starts, as `flotilla train` does.
  const { prepareRunData } = await import('./train_run.js');
  await prepareRunData(cfg, a.config);
  if (JSON.stringify(thenCfg.data) !== JSON.stringify(cfg.data)) await prepareRunData(thenCfg, a.config);
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-verify-resume-'));
  try {
    const { runLauncher } = await import('./run.js');
    process.env.FLOTILLA_REPORT = '0'; // the runs' directories are compared, then deleted: no report.html
    const straight = join(dir, 'straight');
    const resumed = join(dir, 'resumed');
    print(`verify: ${a.steps} step(s) of ${a.config} on ${a.nproc} rank(s), saving at step ${a.resumeAt}; then steps ${a.resumeAt + 1}..${a.steps} again from that checkpoint ` +
      (sameLayout ? 'under the same layout (expected: bit-identical)' : `on ${thenNproc} rank(s) with ${thenOverrides.join(' ') || 'the same overrides'} (tolerance: loss ${RESUME_TOLERANCE.loss}, parameters ${RESUME_TOLERANCE.params}, relative)`));
    if (cfg.train.epochs > 0) print(`verify: train.epochs=${cfg.train.epochs} set to 0 for both runs: they train --steps ${a.steps}, the first rows of the epochs`);
    const backend = cfg.parallel.backend;
    const ckpt = join(dir, 'run-straight', 'checkpoints', `step-${String(a.resumeAt).padStart(6, '0')}`);
    const straightRun = [a.config, ...a.overrides, ...common(join(dir, 'run-straight'), a.steps), `--checkpoint.every=${a.resumeAt}`, `--checkpoint.keep=${a.steps}`, '--record', straight];
    const resumedRun = [a.config, ...a.overrides, ...thenOverrides, ...common(join(dir, 'run-resumed'), a.steps), '--checkpoint.every=0', '--record', resumed, `--resume=${ckpt}`];
    if (thenNproc === a.nproc) {
      // One world for both runs (src/cli/train_run.ts): the resume reads only the checkpoint on disk.
      const { writeSeries } = await import('./train_run.js');
      const series = join(dir, 'series.json');
      writeSeries(series, [straightRun, resumedRun]);
      const code = await runLauncher(['--nproc', String(a.nproc), '--backend', backend, mainScript, 'train-series', series]);
      if (code !== 0) {
        print(`FAIL: the ${existsSync(join(straight, 'rank0.json')) ? 'resumed' : 'straight'} run exited with status ${code}`);
        return 1;
      }
    } else {
      let code = await runLauncher(['--nproc', String(a.nproc), '--backend', backend, mainScript, 'train', ...straightRun]);
      if (code !== 0) {
        print(`FAIL: the straight run exited with status ${code}`);
        return 1;
      }
      code = await runLauncher(['--nproc', String(thenNproc), '--backend', backend, mainScript, 'train', ...resumedRun]);
      if (code !== 0) {
        print(`FAIL: the resumed run exited with status ${code}`);
        return 1;
      }
    }
    return await compare(straight, resumed, a.resumeAt, sameLayout, print);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

async function compare(straightDir: string, resumedDir: string, from: number, exact: boolean, print: (l: string) => void): Promise<number> {
  const { loadSafetensors } = await import('../checkpoint/safetensors.js');
  const { tidy } = await import('../tensor/index.js');
  const ranksOf = (d: string) => readdirSync(d).filter((f) => /^rank\d+\.json$/.test(f)).map((f) => JSON.parse(readFileSync(join(d, f), 'utf8')) as StepRecord);
  const ref = ranksOf(straightDir)[0]!.steps.filter((s) => s.step > from);
  const got = ranksOf(resumedDir);
  const rel = (x: number, y: number) => Math.abs(x - y) / Math.max(Math.abs(y), 1e-12);
  let ok = true;
  print('step  loss (straight)  max |Δloss| rel  grad norm (straight)  max |Δnorm| rel');
  for (const s of ref) {
    const rows = got.map((r) => r.steps.find((x) => x.step === s.step));
    if (rows.some((r) => r === undefined)) {
      print(`FAIL: a resumed rank did not train step ${s.step}`);
      return 1;
    }
    const dl = Math.max(...rows.map((r) => rel(r!.loss, s.loss)));
    const dn = Math.max(...rows.map((r) => rel(r!.gradNorm, s.gradNorm)));
    if (exact ? dl !== 0 || dn !== 0 : !(dl <= RESUME_TOLERANCE.loss && dn <= RESUME_TOLERANCE.gradNorm)) ok = false;
    print(`${String(s.step).padStart(4)}  ${s.loss.toFixed(6).padStart(15)}  ${dl.toExponential(2).padStart(15)}  ${s.gradNorm.toFixed(6).padStart(20)}  ${dn.toExponential(2).padStart(15)}`);
  }
  // Final parameters: the straight run's (merged over its ranks) against every resumed rank's own.
  const full = new Map<string, ReturnType<typeof loadSafetensors>[string]>();
  for (const f of readdirSync(straightDir).filter((n) => n.endsWith('.safetensors'))) {
    for (const [n, t] of Object.entries(loadSafetensors(join(straightDir, f)))) if (!full.has(n)) full.set(n, t);
  }
  let worst = 0;
  let where = 'every tensor equal';
  for (const f of readdirSync(resumedDir).filter((n) => n.endsWith('.safetensors'))) {
    if (!existsSync(join(resumedDir, f))) continue;
    for (const [n, t] of Object.entries(loadSafetensors(join(resumedDir, f)))) {
      const b = full.get(n);
      if (!b) {
        print(`FAIL: the resumed run holds '${n}', which the straight run does not`);
        return 1;
      }
      const d = tidy(() => {
        const b64 = b.to('float64');
        return Math.sqrt(t.to('float64').sub(b64).pow(2).sum().item() / Math.max(b64.pow(2).sum().item(), 1e-24));
      });
      if (d > worst) [worst, where] = [d, `${f.replace('.safetensors', '')}, ${n}`];
    }
  }
  if (exact ? worst !== 0 : !(worst <= RESUME_TOLERANCE.params)) ok = false;
  print(`max parameter difference ||Δθ|| / ||θ||: ${worst.toExponential(2)} (${where})`);
  print(`${ok ? 'PASS' : 'FAIL'} (${exact ? 'same layout: bit-identical expected' : `tolerance: loss ${RESUME_TOLERANCE.loss}, grad norm ${RESUME_TOLERANCE.gradNorm}, parameters ${RESUME_TOLERANCE.params}, relative`})`);
  return ok ? 0 : 1;
}

// Hardening of what flotilla reads and writes: safetensors names and header limits, temporary files
// of interrupted saves, the run directory of an earlier run, and user errors in the config path and
// the FLOTILLA_* variables (one line, no stack trace, exit 2).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import {
  MAX_TENSORS, decodeSafetensors, encodeSafetensors, loadSafetensorsWithMetadata, readSafetensorsHeader, saveSafetensors, saveSafetensorsAsync,
} from '../src/checkpoint/safetensors.js';
import { ConfigError, parseConfig } from '../src/config/index.js';
import { prepareRunDir, runDirProblem } from '../src/train/run_dir.js';
import { train } from '../src/train/trainer.js';
import * as T from '../src/tensor/index.js';
import { runnableScript } from './helpers/compiled.js';

const ROOT = resolve(import.meta.dirname, '..');
const BIN = join(ROOT, 'bin', 'flotilla.js');
const dir = mkdtempSync(join(tmpdir(), 'flotilla-files-'));

function flotilla(args: string[], opts: { env?: Record<string, string | undefined>; cwd?: string } = {}): Promise<{ code: number | null; out: string; err: string }> {
  return new Promise((res) => {
    const child = spawn(process.execPath, [BIN, ...args], { cwd: opts.cwd ?? ROOT, env: { ...process.env, ...opts.env } });
    let out = '';
    let err = '';
    child.stdout.on('data', (d) => (out += d));
    child.stderr.on('data', (d) => (err += d));
    child.on('close', (code) => res({ code, out, err }));
  });
}

/** One line on stderr, no stack frames, exit code 2. */
function assertOneLine(r: { code: number | null; out: string; err: string }, pattern: RegExp): void {
  const lines = r.err.trim().split('\n');
  assert.equal(r.code, 2, `exit code ${r.code}; stderr:\n${r.err}`);
  assert.equal(lines.length, 1, `expected one line, got:\n${r.err}`);
  assert.doesNotMatch(r.err, /^\s+at /m);
  assert.match(lines[0]!, pattern);
}

test('safetensors: any name round-trips as an own key, __proto__ and other Object.prototype names included', () => {
  const names = ['__proto__', 'constructor', 'toString', 'hasOwnProperty', '__metadata__x', 'ünï/çødé.weight'];
  const tensors: Record<string, T.Tensor> = {};
  names.forEach((n, i) => Object.defineProperty(tensors, n, { value: T.full([2], i + 1), enumerable: true }));
  const path = join(dir, 'names.safetensors');
  saveSafetensors(path, tensors, { ['__proto__']: 'meta-proto', note: 'n' });
  const back = loadSafetensorsWithMetadata(path);
  assert.deepEqual(Object.entries(back.metadata), [['__proto__', 'meta-proto'], ['note', 'n']]);
  assert.deepEqual(Object.keys(back.tensors), names);
  assert.equal(Object.getPrototypeOf(back.tensors), Object.prototype, 'a name must never become the prototype');
  names.forEach((n, i) => {
    const t = Object.getOwnPropertyDescriptor(back.tensors, n)?.value as T.Tensor;
    assert.ok(t instanceof T.Tensor, `'${n}' was lost`);
    assert.deepEqual(t.toNumbers(), [i + 1, i + 1]);
  });
  assert.deepEqual(Object.keys(readSafetensorsHeader(path).tensors), names);
  // decode of the in-memory form agrees
  const mem = decodeSafetensors(Buffer.concat(encodeSafetensors(tensors)));
  assert.deepEqual(Object.keys(mem.tensors), names);
});

function headerOnly(json: string): Buffer {
  const body = Buffer.from(json);
  const pad = Math.ceil(body.length / 8) * 8;
  const out = Buffer.alloc(8 + pad, 0x20);
  out.writeBigUInt64LE(BigInt(pad), 0);
  body.copy(out, 8);
  return out;
}

test('safetensors: the header cap bounds the number of entries, not only bytes', () => {
  // MAX_TENSORS + 1 empty tensors: a small file (a few MB) the parser would otherwise expand entry by entry.
  const parts: string[] = [];
  for (let i = 0; i <= MAX_TENSORS; i++) parts.push(`"t${i}":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}`);
  const bytes = headerOnly(`{${parts.join(',')}}`);
  assert.throws(() => decodeSafetensors(bytes, 'many.safetensors'), /holds more than 100000 entries/);
  const path = join(dir, 'many.safetensors');
  writeFileSync(path, bytes);
  assert.throws(() => readSafetensorsHeader(path), /holds more than 100000 entries/);
  // One entry whose shape is a huge list: refused by the count of values.
  const shape = new Array(2_000_000).fill(1).join(',');
  assert.throws(() => decodeSafetensors(headerOnly(`{"x":{"dtype":"F32","shape":[${shape}],"data_offsets":[0,4]}}`)), /JSON values/);
  // Commas inside names do not count.
  const named = decodeSafetensors(headerOnly(`{"${','.repeat(3_000_000)}":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}`));
  assert.equal(Object.keys(named.tensors)[0]!.length, 3_000_000);
});

test('safetensors: temporary files of interrupted saves are removed by the next save; live writers are left alone', async () => {
  const sub = join(dir, 'tmpfiles');
  mkdirSync(sub);
  const path = join(sub, 'model.safetensors');
  let deadPid = 4_000_000;
  while ((() => {
    try {
      process.kill(deadPid, 0);
      return true;
    } catch {
      return false;
    }
  })()) deadPid++;
  const stale = [`.model.safetensors.${deadPid}.0badc0de.tmp`, `.model.safetensors.${process.pid}.12345678.tmp`];
  const live = `.model.safetensors.${process.ppid}.abcdef01.tmp`; // a save another live process may be running
  const other = `.other.safetensors.${deadPid}.0badc0de.tmp`; // belongs to another file
  for (const f of [...stale, live, other]) writeFileSync(join(sub, f), 'partial');
  saveSafetensors(path, { w: T.full([3], 1) });
  assert.deepEqual(readdirSync(sub).sort(), [live, other, 'model.safetensors'].sort());
  writeFileSync(join(sub, stale[0]!), 'partial');
  await saveSafetensorsAsync(path, { w: T.full([3], 2) });
  assert.deepEqual(readdirSync(sub).sort(), [live, other, 'model.safetensors'].sort());
});

test('a new run refuses an earlier run\'s directory, naming --train.name (and resuming once checkpoints exist)', async () => {
  const cwd = mkdtempSync(join(dir, 'cwd-'));
  const cfg = parseConfig('', ['--train.name=exp', '--model.nLayer=1', '--model.nHead=2', '--model.nEmbd=16', '--model.blockSize=16', '--data.seqLen=16', '--data.globalBatch=2']);
  const prev = process.cwd();
  process.chdir(cwd);
  try {
    assert.equal(runDirProblem(cfg), undefined);
    assert.equal(prepareRunDir(cfg), 'runs/exp');
    assert.equal(runDirProblem(cfg), undefined, 'an empty directory may be used');
    writeFileSync(join(cwd, 'runs', 'exp', 'config.toml'), '# earlier run\n');
    assert.match(runDirProblem(cfg)!, /already holds an earlier run \(--train\.name=exp\); pick another --train\.name/);
    await assert.rejects(train(cfg, { print: () => undefined }), (e: Error) => e instanceof ConfigError && /--train\.name/.test(e.message));
    writeFileSync(join(cwd, 'runs', 'exp', 'step-10.safetensors'), '');
    assert.match(runDirProblem(cfg)!, /holds checkpoints of an earlier run: resume that run from them, pick another --train\.name/);
    assert.equal(runDirProblem(cfg, { resume: true }), undefined);
    const other = parseConfig('', ['--train.name=fresh']);
    assert.match(runDirProblem(other, { resume: true })!, /cannot resume: the run directory runs\/fresh does not exist/);
  } finally {
    process.chdir(prev);
  }
  // The command refuses before any rank starts, in one line.
  const config = join(cwd, 'exp.toml');
  writeFileSync(config, '[train]\nname = "exp"\n');
  const r = await flotilla(['train', config, '--nproc', '2'], { cwd });
  assertOneLine(r, /runs\/exp holds checkpoints of an earlier run: .*--train\.name/);
});

test('a config path that is a directory: one line, no stack trace', async () => {
  assertOneLine(await flotilla(['train', dir]), /config file .* is a directory; pass a TOML file/);
  assertOneLine(await flotilla(['config', dir]), /is a directory/);
});

test('invalid FLOTILLA_* values: one line from the command, before any rank starts', async () => {
  const bad: [Record<string, string>, RegExp][] = [
    [{ FLOTILLA_TIMEOUT_MS: 'soon' }, /FLOTILLA_TIMEOUT_MS="soon" is not a positive integer/],
    [{ FLOTILLA_NUM_THREADS: '0' }, /FLOTILLA_NUM_THREADS="0" is not a positive integer/],
    [{ FLOTILLA_KILL_GRACE_MS: '5s' }, /FLOTILLA_KILL_GRACE_MS="5s" is not a non-negative integer/],
    [{ FLOTILLA_GLOO_IFACE: 'nosuch0' }, /FLOTILLA_GLOO_IFACE="nosuch0" is not a network interface of this host/],
    [{ FLOTILLA_JOB_SECRET: 'short' }, /FLOTILLA_JOB_SECRET is 5 characters long/],
    [{ FLOTILLA_MALLOC: 'jemalloc' }, /FLOTILLA_MALLOC must be "cache", "tuned", "lean" or "default", not "jemalloc"/],
  ];
  const script = runnableScript(join(ROOT, 'test', 'helpers', 'ranks', 'hardening.ts'));
  for (const [env, re] of bad) {
    assertOneLine(await flotilla(['run', '--nproc', '2', script, 'join'], { env }), re);
    assertOneLine(await flotilla(['train', join(ROOT, 'examples', 'gpt-tiny.toml'), '--nproc', '2', `--train.runDir=${join(dir, 'never')}`], { env }), re);
  }
  assert.ok(!existsSync(join(dir, 'never')));
});

// [log] tensorboard: a 2-rank MoE run writes TensorBoard event files, then resumes from its first
// checkpoint into a new file. The files are read back here with a reader of this test's own (the
// TFRecord framing with both CRCs, the Event and Summary protobufs decoded by hand): every scalar at
// its step equals metrics.jsonl's, no step appears twice, and the config is a text-plugin summary.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { hostname, tmpdir } from 'node:os';
import { join } from 'node:path';
import { flotillaSeries } from './helpers/cli.js';
import { tinyGptToml } from './fixtures/tiny_gpt.js';
import { readMetrics, type StepMetrics } from '../src/train/metrics.js';

const work = mkdtempSync(join(tmpdir(), 'flotilla-tb-'));

// CRC32C bit by bit (the Castagnoli polynomial, reflected), masked as TFRecord masks it.
function crc32c(b: Uint8Array): number {
  let c = ~0 >>> 0;
  for (const x of b) {
    c ^= x;
    for (let k = 0; k < 8; k++) c = (c >>> 1) ^ (0x82f63b78 & -(c & 1));
  }
  return ~c >>> 0;
}
const masked = (b: Uint8Array): number => {
  const c = crc32c(b);
  return (((c >>> 15) | (c << 17)) + 0xa282ead8) >>> 0;
};

/** The TFRecords of a file; every length and both CRCs checked, nothing left over. */
function readRecords(buf: Buffer, file: string): Buffer[] {
  const out: Buffer[] = [];
  let at = 0;
  while (at < buf.length) {
    const len = Number(buf.readBigUInt64LE(at));
    assert.equal(buf.readUInt32LE(at + 8), masked(buf.subarray(at, at + 8)), `${file}@${at}: length CRC`);
    const data = buf.subarray(at + 12, at + 12 + len);
    assert.equal(buf.readUInt32LE(at + 12 + len), masked(data), `${file}@${at}: data CRC`);
    out.push(data);
    at += 16 + len;
  }
  assert.equal(at, buf.length, `${file}: a record cut short`);
  return out;
}

type Field = { no: number; wire: number; v: bigint | Buffer };
/** The fields of one protobuf message (varint, 64-bit, length-delimited and 32-bit wire types). */
function fields(b: Buffer): Field[] {
  const out: Field[] = [];
  let at = 0;
  const varint = (): bigint => {
    let r = 0n, s = 0n;
    for (;;) {
      const x = b[at++]!;
      r |= BigInt(x & 0x7f) << s;
      s += 7n;
      if (x < 0x80) return r;
    }
  };
  while (at < b.length) {
    const key = Number(varint()), no = key >> 3, wire = key & 7;
    if (wire === 0) out.push({ no, wire, v: varint() });
    else if (wire === 1) { out.push({ no, wire, v: b.subarray(at, at + 8) }); at += 8; }
    else if (wire === 5) { out.push({ no, wire, v: b.subarray(at, at + 4) }); at += 4; }
    else if (wire === 2) { const n = Number(varint()); out.push({ no, wire, v: b.subarray(at, at + n) }); at += n; }
    else throw new Error(`wire type ${wire}`);
  }
  return out;
}
const one = (fs: Field[], no: number) => fs.find((f) => f.no === no)?.v;

interface Decoded { step: number; fileVersion?: string; scalars: Map<string, number>; texts: Map<string, { plugin: string; dtype: number; text: string }> }
/** An Event: step (2), file_version (3), summary (5) of Values: tag (1), simple_value (2), tensor (8), metadata (9). */
function decodeEvent(b: Buffer): Decoded {
  const ev = fields(b);
  const d: Decoded = { step: Number((one(ev, 2) as bigint | undefined) ?? 0n), scalars: new Map(), texts: new Map() };
  assert.ok(one(ev, 1) instanceof Buffer && (one(ev, 1) as Buffer).readDoubleLE(0) > 1.7e9, 'wall_time in seconds');
  const fv = one(ev, 3);
  if (fv) d.fileVersion = (fv as Buffer).toString('utf8');
  const summary = one(ev, 5) as Buffer | undefined;
  for (const v of summary ? fields(summary).filter((f) => f.no === 1) : []) {
    const vf = fields(v.v as Buffer);
    const tag = (one(vf, 1) as Buffer).toString('utf8');
    const simple = one(vf, 2) as Buffer | undefined;
    if (simple) d.scalars.set(tag, simple.readFloatLE(0));
    const tensor = one(vf, 8) as Buffer | undefined;
    if (tensor) {
      const tf = fields(tensor), meta = fields(one(vf, 9) as Buffer);
      d.texts.set(tag, {
        plugin: (one(fields(one(meta, 1) as Buffer), 1) as Buffer).toString('utf8'), dtype: Number(one(tf, 1)),
        text: (one(tf, 8) as Buffer).toString('utf8'),
      });
    }
  }
  return d;
}

/** The scalars a metrics row should give, by tag (float32, as simple_value holds them). */
function expected(m: StepMetrics): Map<string, number> {
  const e = new Map<string, number>([['train/loss', m.loss], ['train/lr', m.lr], ['perf/tokens_per_sec', m.tokensPerSec]]);
  if (m.valLoss !== undefined) e.set('val/loss', m.valLoss);
  for (const [tag, v] of [['train/grad_norm', m.gradNorm], ['memory/rss_mib', m.rssMiB], ['moe/aux_loss', m.auxLoss], ['perf/tflops', m.tflops], ['perf/mfu', m.mfu]] as const) {
    if (v !== undefined) e.set(tag, v);
  }
  for (const [name, counts] of Object.entries(m.expertTokens ?? {})) {
    const layer = name.split('.')[1], total = counts.reduce((a, b) => a + b, 0);
    counts.forEach((c, i) => e.set(`moe/layer${layer}/expert${i}_load`, c / total));
  }
  return new Map([...e].map(([k, v]) => [k, Math.fround(v)]));
}

test('tensorboard: 2 ranks, MoE, resumed: event files framed and CRC-checked, every scalar at its step equals metrics.jsonl', async () => {
  assert.equal(crc32c(Buffer.from('123456789')), 0xe3069283, 'CRC-32C\'s check value');
  const config = join(work, 'tb.toml');
  writeFileSync(config, tinyGptToml({
    model: { nLayer: 2 }, moe: { experts: 4, topK: 2 },
    train: { steps: 6, evalEvery: 3, evalBatches: 1 }, checkpoint: { every: 3 },
    log: { progress: 'plain', every: 1, tensorboard: true, peakTflops: 0.5 },
  }));
  const dir = join(work, 'run');
  const r = await flotillaSeries(2, [
    [config, `--train.runDir=${dir}`],
    // Again from step 3: steps 4-6 trained again, their first events dropped, written into a new file.
    // Without [log] peakTflops: rank 0 probes the peak and tells rank 1.
    [config, `--train.runDir=${dir}`, `--resume=${join(dir, 'checkpoints', 'step-000003')}`, '--log.peakTflops=0'],
  ]);
  assert.equal(r.code, 0, `${r.out}\n${r.err}`);

  const tb = join(dir, 'tb');
  const files = readdirSync(tb).sort();
  assert.equal(files.length, 2, files.join(', '));
  for (const f of files) assert.match(f, new RegExp(`^events\\.out\\.tfevents\\.\\d{10}\\.${hostname().replace(/\./g, '\\.')}$`));
  const seen = new Map<string, number>(); // tag@step -> value
  const texts: Decoded['texts'][] = [];
  const stepsOf: number[][] = [];
  for (const f of files) {
    const events = readRecords(readFileSync(join(tb, f)), f).map(decodeEvent);
    assert.equal(events[0]!.fileVersion, 'brain.Event:2', `${f}: the first event names the file version`);
    stepsOf.push([...new Set(events.filter((e) => e.scalars.size > 0).map((e) => e.step))]);
    for (const e of events) {
      if (e.texts.size > 0) texts.push(e.texts);
      for (const [tag, v] of e.scalars) {
        assert.ok(!seen.has(`${tag}@${e.step}`), `${tag} at step ${e.step} written twice`);
        seen.set(`${tag}@${e.step}`, v);
      }
    }
  }
  assert.deepEqual(stepsOf, [[1, 2, 3], [4, 5, 6]], 'the first file keeps steps 1-3, the resumed run writes 4-6');

  const rows = readMetrics(join(dir, 'metrics.jsonl'));
  assert.deepEqual(rows.map((m) => m.step), [1, 2, 3, 4, 5, 6]);
  // MFU: the config's model FLOPs per token (hand count: 2 blocks of qkv 32x96 and output 32x32, the
  // router 32x4 and 2 of 4 experts 32x128 + 128x32; the head 32 x vocab; attention 12 x 2 x 32 x 32),
  // times each rank's share of the tokens/s, over the 0.5 TFLOP/s given.
  const vocab = Number(/^vocabSize = (\d+)$/m.exec(readFileSync(join(dir, 'config.toml'), 'utf8'))![1]);
  const perToken = 6 * (2 * (32 * 96 + 32 * 32 + 32 * 4 + 2 * (32 * 128 + 128 * 32)) + 32 * vocab) + 12 * 2 * 32 * 32;
  // The probe's, or the suite's cache of it (another file's run may have probed first).
  const measured = Number(/\[mfu\] .* peak ([\d.e+-]+) TFLOP\/s per rank, (?:measured \(768x768 float32 GEMMs\)(?:, cached in | under load average )|\/.*\/mfu\/peak-.*float32\.json$)/m.exec(r.out)?.[1]);
  assert.ok(measured > 0, r.out);
  for (const m of rows) {
    assert.equal(m.flopsPerToken, perToken);
    assert.ok(Math.abs(m.tflops! - (perToken * m.tokensPerSec) / 2 / 1e12) <= 1e-12 * m.tflops!, JSON.stringify(m));
    // The resumed steps over the measured peak (printed to 3 digits).
    const peak = m.step <= 3 ? 0.5 : m.tflops! / m.mfu!;
    assert.ok(Math.abs(m.mfu! - m.tflops! / peak) <= 1e-12 * m.mfu!, JSON.stringify(m));
    if (m.step > 3) assert.ok(Math.abs(peak - measured) <= 5e-3 * peak, `peak ${peak} printed as ${measured}`);
  }
  assert.match(r.out, /^(?:\[rank 0\] )?step 2\/6 \| loss [\d.]+ \| val - \| lr [\d.e+-]+ \| [\d,]+ tok\/s \| MFU \d+\.\d+% \| gnorm /m);
  assert.match(r.out, /\[mfu\] .* model FLOPs per token .* peak 0\.500 TFLOP\/s per rank, \[log\] peakTflops/);

  let count = 0;
  for (const m of rows) {
    const want = expected(m);
    assert.ok(want.has('val/loss') === (m.step % 3 === 0) && want.has('moe/layer1/expert3_load') && want.has('memory/rss_mib'), JSON.stringify(m));
    for (const [tag, v] of want) assert.equal(seen.get(`${tag}@${m.step}`), v, `${tag} at step ${m.step}`);
    count += want.size;
  }
  assert.equal(seen.size, count, 'no scalar beyond metrics.jsonl\'s');

  // The config, once per run, as the text plugin's string tensor (DT_STRING = 7).
  assert.equal(texts.length, 2);
  for (const t of texts) {
    const c = t.get('config')!;
    assert.equal(c.plugin, 'text');
    assert.equal(c.dtype, 7);
    assert.match(c.text, /^```toml\n# Resolved config[^]*\[moe\]\n[^[]*\nexperts = 4\n[^]*\ntensorboard = true\n[^]*```$/);
  }
});

// Resident memory does not grow with the corpus (its checksums verified at start included): a 2 GB (10^9 + tokens) prepared dataset and a
// 32 MiB one, read through the trainer's data path for the same number of batches, leave the same
// peak resident set (VmHWM), measured from outside the reading process through /proc/PID/status.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { createHash } from 'node:crypto';
import { closeSync, mkdirSync, mkdtempSync, openSync, readFileSync, rmSync, writeFileSync, writeSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { REPO_ROOT } from './helpers/world.js';
import { tokenizerIdentity } from '../src/data/tokenizer.js';
import { FORMAT, FORMAT_VERSION, type Manifest } from '../src/data/prepared.js';

const root = mkdtempSync(join(tmpdir(), 'flotilla-rss-'));

/** A prepared byte-token dataset of `shards` shards (unequal sizes) totalling about `tokens` tokens, written in 64 MiB blocks. */
function makeDataset(name: string, tokens: number, shards: number): string {
  const dir = join(root, name);
  mkdirSync(dir);
  const block = Buffer.alloc(64 << 20);
  const u16 = new Uint16Array(block.buffer, block.byteOffset, block.byteLength / 2);
  for (let i = 0; i < u16.length; i++) u16[i] = (i * 2654435761) >>> 24; // bytes 0..255, no runs
  const weights = Array.from({ length: shards }, (_, i) => i + 1);
  const wsum = weights.reduce((a, b) => a + b, 0);
  const tok = tokenizerIdentity('byte');
  const m: Manifest = {
    format: FORMAT, version: FORMAT_VERSION, tokenizer: { spec: 'byte', name: 'byte', vocabSize: 256, eot: 0, identity: tok.identity },
    dtype: 'uint16', tokens: 0, documents: 0, skipped: 0, key: name, field: 'text', sources: [], shards: [], created: new Date().toISOString(),
  };
  weights.forEach((w, s) => {
    const n = Math.floor((tokens * w) / wsum);
    const fd = openSync(join(dir, `shard_${s}.bin`), 'w');
    const h = createHash('sha256');
    for (let left = n * 2; left > 0; left -= block.length) {
      const part = block.subarray(0, Math.min(left, block.length));
      writeSync(fd, part);
      h.update(part);
    }
    closeSync(fd);
    const idx = Buffer.alloc(16);
    idx.writeBigUInt64LE(BigInt(n), 8);
    writeFileSync(join(dir, `shard_${s}.idx`), idx);
    m.shards.push({
      bin: `shard_${s}.bin`, idx: `shard_${s}.idx`, tokens: n, documents: 1, maxTokenId: 255, binSha256: h.digest('hex'),
      idxSha256: createHash('sha256').update(idx).digest('hex'), key: '-', inputs: [], skipped: 0,
    });
    m.tokens += n;
    m.documents += 1;
  });
  writeFileSync(join(dir, 'manifest.json'), JSON.stringify(m));
  return dir;
}

function status(pid: number): { hwmKb: number; rssKb: number } {
  const s = readFileSync(`/proc/${pid}/status`, 'utf8');
  const kb = (k: string) => Number(new RegExp(`^${k}:\\s+(\\d+) kB`, 'm').exec(s)![1]);
  return { hwmKb: kb('VmHWM'), rssKb: kb('VmRSS') };
}

/** Reads `batches` batches in a child; returns its peak and current resident set once it has. */
function measure(source: string, batches: number): Promise<{ hwmKb: number; rssKb: number; tokens: number }> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, ['--import', 'tsx', 'test/fixtures/data_rss_child.ts', source, String(batches)], { cwd: REPO_ROOT, stdio: ['pipe', 'pipe', 'inherit'] });
    let out = '';
    child.stdout.on('data', (d: Buffer) => {
      out += d.toString();
      const m = /READY (\{.*\})/.exec(out);
      if (m) {
        const s = status(child.pid!);
        child.stdin.end();
        resolve({ ...s, tokens: (JSON.parse(m[1]!) as { tokens: number }).tokens });
      }
    });
    child.on('exit', (code) => { if (!/READY/.test(out)) reject(new Error(`child exited ${code}: ${out}`)); });
  });
}

test('peak resident memory is flat from a 16M-token to a 1G-token corpus', { timeout: 300_000 }, async (t) => {
  try {
    const small = makeDataset('small', 16 << 20, 3);
    const big = makeDataset('big', 1_050_000_000, 5); // 2.1 GB of uint16 tokens
    const a = await measure(small, 300);
    const b = await measure(big, 300);
    assert.ok(b.tokens > 1_000_000_000, `big corpus has ${b.tokens} tokens`);
    const growMb = (b.hwmKb - a.hwmKb) / 1024;
    t.diagnostic(`VmHWM ${(a.hwmKb / 1024).toFixed(1)} MiB at ${a.tokens} tokens, ${(b.hwmKb / 1024).toFixed(1)} MiB at ${b.tokens} tokens`);
    // 64x the corpus (2 GB more) may cost a few MiB of noise, not a fraction of the corpus.
    assert.ok(growMb < 24, `VmHWM ${a.hwmKb} kB -> ${b.hwmKb} kB (+${growMb.toFixed(1)} MiB) for ${a.tokens} -> ${b.tokens} tokens`);
    assert.ok(b.rssKb < 400 * 1024, `VmRSS ${b.rssKb} kB`);
  } finally {
    rmSync(root, { recursive: true, force: true });
  }
});

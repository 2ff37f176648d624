// Resident memory does not grow with the corpus (its checksums verified at start included): a 2 GB (10^9 + tokens) prepared dataset and a
// 32 MiB one, read through the trainer's data path for the same number of batches, leave the same
// peak resident set (VmHWM), measured from outside the reading process through /proc/PID/status.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { makeDataset, measure } from './fixtures/data_rss.js';

const root = mkdtempSync(join(tmpdir(), 'flotilla-rss-'));

test('peak resident memory is flat from a 16M-token to a 1G-token corpus', { timeout: 300_000 }, async (t) => {
  try {
    const small = makeDataset(root, 'small', 16 << 20, 3);
    const big = makeDataset(root, 'big', 1_050_000_000, 5); // 2.1 GB of uint16 tokens
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

// The CLI run as `node --import tsx src/cli/main.ts ...` (its file executed directly, not imported by
// bin/flotilla.js): commands that load other CLI modules must finish and report, never wait forever
// (exit 13 is Node's "unsettled top-level await").
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { ROOT } from './helpers/cli.js';

const MAIN = join(ROOT, 'src', 'cli', 'main.ts');
const direct = (args: string[]) => spawnSync(process.execPath, ['--import', 'tsx', MAIN, ...args], { cwd: ROOT, encoding: 'utf8', timeout: 120_000 });

test('src/cli/main.ts run directly: prepare tokenizes with a worker thread and exits 0', () => {
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-direct-'));
  try {
    const corpus = join(dir, 'corpus.jsonl');
    writeFileSync(corpus, ['whale', 'sea', 'ship'].map((t) => JSON.stringify({ text: `the ${t}` })).join('\n') + '\n');
    const out = join(dir, 'd');
    const r = direct(['prepare', corpus, '--tokenizer', 'byte', '--out', out, '--workers', '1', '--no-progress']);
    assert.equal(r.status, 0, `${r.stdout}\n${r.stderr}`);
    assert.match(r.stderr, /3 document\(s\), 1 shard\(s\)/);
    assert.ok(existsSync(join(out, 'manifest.json')));
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test('src/cli/main.ts run directly: usage errors of every command module print one line and exit 2', () => {
  for (const [args, re] of [
    [['prepare'], /^flotilla: prepare: no sources given/],
    [['tokenizer', 'learn'], /^flotilla: tokenizer: unknown subcommand "learn"/],
    [['export', 'x'], /^flotilla: export: usage: flotilla export/],
    [['generate', 'ckpt'], /^flotilla: generate: usage: flotilla generate/],
    [['report'], /^flotilla report: give the run directory/],
  ] as const) {
    const r = direct([...args]);
    assert.equal(r.status, 2, `${args.join(' ')}: ${r.stdout}\n${r.stderr}`);
    assert.match(r.stderr, re, args.join(' '));
  }
});

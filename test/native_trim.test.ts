// The addon's copy of libtorch_cpu (scripts/trim-libtorch.cjs): where the installed libtorch_cpu names
// libraries it never calls (Debian's names OpenCV and FFmpeg), the build must leave a copy without them
// that the addon really loads; losing it (a RUNPATH dropped from binding.gyp, patchelf gone) would not
// fail any other test, only make every process start 0.3 s slower.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { copyFileSync, existsSync, mkdtempSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { REPO_ROOT } from './helpers/world.js';

const release = join(REPO_ROOT, 'native', 'build', 'Release');
const addon = join(release, 'flotilla.node');
const record = JSON.parse(readFileSync(join(release, 'libtorch_cpu.trimmed.json'), 'utf8')) as { from?: string; copy?: string; dropped?: string[]; note?: string };
const needed = (file: string): string[] => [...execFileSync('readelf', ['-d', file], { encoding: 'utf8' }).matchAll(/\(NEEDED\)\s+Shared library: \[(.+)\]/g)].map((m) => m[1]!);

test('the addon loads its copy of libtorch_cpu, which names none of the libraries the original names but never calls', (t) => {
  assert.ok(record.from !== undefined && existsSync(record.from), JSON.stringify(record));
  const original = needed(record.from);
  if (!original.some((n) => n.startsWith('libopencv_core'))) {
    t.skip(`${record.from} names no OpenCV library (a lean libtorch): nothing to drop, so no copy is made`);
    return;
  }
  assert.ok(record.copy !== undefined && existsSync(record.copy), `no trimmed copy was made: ${JSON.stringify(record)}`);
  const dropped = record.dropped ?? [];
  assert.ok(dropped.includes('libopencv_core.so.406') || dropped.some((n) => n.startsWith('libopencv_core')), dropped.join(' '));
  assert.deepEqual(needed(record.copy), original.filter((n) => !dropped.includes(n)));
  const maps = execFileSync(process.execPath, ['-e', `require(${JSON.stringify(addon)}); process.stdout.write(require('fs').readFileSync('/proc/self/maps', 'utf8'))`], { encoding: 'utf8' });
  const mapped = new Set(maps.split('\n').map((l) => l.split(/\s+/)[5] ?? '').filter((f) => f.startsWith('/')));
  assert.deepEqual([...mapped].filter((f) => f.includes('/libtorch_cpu.so')), [record.copy], 'the copy is the only libtorch_cpu mapped');
  // Another library may still need one of the dropped (libnuma, zstd); OpenCV and FFmpeg, which bring
  // Qt, GStreamer and GDAL, nothing else does. A soname (libopencv_core.so.406) and its file
  // (libopencv_core.so.4.6.0) share the part up to ".so".
  for (const lib of dropped.filter((n) => /^lib(opencv_|av|sw)/.test(n))) {
    const stem = `/${lib.slice(0, lib.indexOf('.so') + 3)}`;
    assert.ok(![...mapped].some((f) => f.includes(stem)), `${lib} is not loaded`);
  }
  assert.ok(mapped.size < 100, `${mapped.size} files mapped (287 libraries with the original)`);
});

test('--if-stale makes the copy again when the libtorch_cpu it was made from changed (an upgrade in place), and only then', (t) => {
  if (record.copy === undefined) {
    t.skip(`nothing is trimmed on this machine: ${record.note ?? 'the build recorded no copy'}`);
    return;
  }
  // A build directory of its own: the addon alone, whose RUNPATH ($ORIGIN) is that directory.
  const dir = mkdtempSync(join(tmpdir(), 'flotilla-trim-'));
  const trim = (...args: string[]): void => void execFileSync(process.execPath, [join(REPO_ROOT, 'scripts', 'trim-libtorch.cjs'), ...args, dir], { encoding: 'utf8' });
  const recordHere = join(dir, 'libtorch_cpu.trimmed.json');
  try {
    copyFileSync(addon, join(dir, 'flotilla.node'));
    trim();
    const made = JSON.parse(readFileSync(recordHere, 'utf8')) as { copy: string; size: number };
    assert.equal(made.copy, join(dir, basename(record.copy)));
    const first = statSync(made.copy).mtimeMs;
    trim('--if-stale');
    assert.equal(statSync(made.copy).mtimeMs, first, 'a current copy is left as it is');
    writeFileSync(recordHere, JSON.stringify({ ...made, size: made.size + 1 })); // as if libtorch_cpu had been replaced
    trim('--if-stale');
    assert.notEqual(statSync(made.copy).mtimeMs, first, 'the copy is made again');
    assert.equal((JSON.parse(readFileSync(recordHere, 'utf8')) as { size: number }).size, made.size);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

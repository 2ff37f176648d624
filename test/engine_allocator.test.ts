// The allocator settings a flotilla process runs with ([Note: allocator tuning] in src/tensor/allocator.ts):
// freed tensor memory stays with the process for the next step instead of going back to the OS.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { join } from 'node:path';
import { allocatorChoice, MALLOC_OPTIONS } from '../src/tensor/allocator.js';

const ROOT = join(import.meta.dirname, '..');

test('allocatorChoice: tuned by default; a user\'s malloc settings or FLOTILLA_MALLOC=default leave glibc alone; a bad value is refused', () => {
  assert.deepEqual(allocatorChoice({}), { tuned: true });
  assert.deepEqual(allocatorChoice({ FLOTILLA_MALLOC: 'default' }), { tuned: false, why: 'FLOTILLA_MALLOC=default' });
  assert.deepEqual(allocatorChoice({ MALLOC_TRIM_THRESHOLD_: '0' }), { tuned: false, why: 'MALLOC_TRIM_THRESHOLD_ set' });
  assert.deepEqual(allocatorChoice({ GLIBC_TUNABLES: 'glibc.malloc.mmap_threshold=4096' }), { tuned: false, why: 'glibc.malloc tunables set' });
  assert.deepEqual(allocatorChoice({ GLIBC_TUNABLES: 'glibc.cpu.hwcaps=-AVX512F' }), { tuned: true });
  assert.deepEqual(allocatorChoice({ FLOTILLA_MALLOC: 'lean' }), { tuned: true, lean: true });
  assert.throws(() => allocatorChoice({ FLOTILLA_MALLOC: 'jemalloc' }), /FLOTILLA_MALLOC must be "tuned", "lean" or "default", not "jemalloc"/);
});

// A fresh process allocates a 16 MiB tensor, frees it, and reports where the tensor's memory was (inside
// the [heap] mapping of /proc/self/maps, or in a mapping of its own) and how the heap and the resident
// size moved when it was freed. Where the block lies is asked of the tensor itself: how much the heap
// grows depends on how much free room its top already had, which differs from machine to machine.
const PROBE = `
import { readFileSync } from 'node:fs';
import { zeros } from './src/tensor/index.js';
const heapRanges = () => readFileSync('/proc/self/maps', 'utf8').split('\\n').filter((l) => l.endsWith('[heap]'))
  .map((l) => l.split(' ')[0].split('-').map((x) => BigInt('0x' + x)));
const heap = () => heapRanges().reduce((n, [a, b]) => n + Number(b - a), 0);
const rss = () => Number(readFileSync('/proc/self/statm', 'utf8').split(' ')[1]) * 4096;
const t = zeros([4 * 2 ** 20]);
const p = t.dataPtr(), end = p + BigInt(16 * 2 ** 20);
const inHeap = heapRanges().some(([a, b]) => a <= p && end <= b);
const h1 = heap(), r1 = rss();
t.dispose();
const h2 = heap(), r2 = rss();
console.log(JSON.stringify({ inHeap, shrank: h1 - h2, rssDrop: r1 - r2 }));
`;

function probe(env: Record<string, string>): { inHeap: boolean; shrank: number; rssDrop: number } {
  // The probe starts from an environment without malloc settings of its own, whatever this one has.
  const base = Object.fromEntries(Object.entries(process.env).filter(([k]) => !/^MALLOC_\w+_$|^GLIBC_TUNABLES$|^FLOTILLA_MALLOC$/.test(k)));
  const r = spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', PROBE], {
    cwd: ROOT, encoding: 'utf8', env: { ...base, ...env },
  });
  assert.equal(r.status, 0, r.stderr);
  return JSON.parse(r.stdout.trim().split('\n').pop()!);
}

test('tuned: a 16 MiB tensor comes from the heap and its memory stays with the process after it is freed; glibc\'s defaults map and unmap it', () => {
  const MiB = 2 ** 20;
  assert.ok(16 * MiB < MALLOC_OPTIONS.mmapThreshold && 16 * MiB < MALLOC_OPTIONS.trimThreshold);
  const tuned = probe({});
  assert.ok(tuned.inHeap, 'tuned: the 16 MiB tensor was not inside the [heap] mapping (expected: served from the heap)');
  assert.ok(tuned.shrank < 4 * MiB, `tuned: the heap shrank by ${tuned.shrank} bytes when the tensor was freed`);
  assert.ok(tuned.rssDrop < 4 * MiB, `tuned: freeing the tensor returned ${tuned.rssDrop} resident bytes to the OS`);
  const glibc = probe({ FLOTILLA_MALLOC: 'default' });
  assert.ok(!glibc.inHeap, 'glibc defaults: the 16 MiB tensor was inside [heap] (expected a mapping of its own)');
  assert.ok(glibc.rssDrop >= 15 * MiB, `glibc defaults: freeing returned only ${glibc.rssDrop} resident bytes`);
});

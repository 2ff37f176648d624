// The allocator settings a flotilla process runs with ([Note: allocator tuning] in src/tensor/allocator.ts,
// [Note: tensor cache] in native/tensor_cache.cc): freed tensor memory stays with the process for the
// next step instead of going back to the OS, in the tensor cache by default or in malloc's heap.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { join } from 'node:path';
import { allocatorChoice, MALLOC_OPTIONS, TENSOR_CACHE, withoutAllocatorSettings } from '../src/tensor/allocator.js';

const ROOT = join(import.meta.dirname, '..');
const MiB = 2 ** 20;

test('allocatorChoice: the tensor cache by default; tuned and lean on request; a user\'s malloc settings or FLOTILLA_MALLOC=default leave glibc alone; a bad value is refused', () => {
  assert.deepEqual(allocatorChoice({}), { mode: 'cache' });
  assert.deepEqual(allocatorChoice({ FLOTILLA_MALLOC: 'tuned' }), { mode: 'tuned' });
  assert.deepEqual(allocatorChoice({ FLOTILLA_MALLOC: 'lean' }), { mode: 'lean' });
  assert.deepEqual(allocatorChoice({ FLOTILLA_MALLOC: 'default' }), { mode: 'default', why: 'FLOTILLA_MALLOC=default' });
  assert.deepEqual(allocatorChoice({ MALLOC_TRIM_THRESHOLD_: '0' }), { mode: 'default', why: 'MALLOC_TRIM_THRESHOLD_ set' });
  assert.deepEqual(allocatorChoice({ GLIBC_TUNABLES: 'glibc.malloc.mmap_threshold=4096' }), { mode: 'default', why: 'glibc.malloc tunables set' });
  assert.deepEqual(allocatorChoice({ GLIBC_TUNABLES: 'glibc.cpu.hwcaps=-AVX512F' }), { mode: 'cache' });
  assert.throws(() => allocatorChoice({ FLOTILLA_MALLOC: 'jemalloc' }), /FLOTILLA_MALLOC must be "cache", "tuned", "lean" or "default", not "jemalloc"/);
});

// A fresh process allocates a 16 MiB tensor, frees it, and reports where the tensor's memory was (inside
// the [heap] mapping of /proc/self/maps, or in a mapping of its own) and how the heap and the resident
// size moved when it was freed. Where the block lies is asked of the tensor itself: how much the heap
// grows depends on how much free room its top already had, which differs from machine to machine.
// The probes import the sources by a path relative to the repository (they run there through tsx).
const SRC = './src';
const PROBE = `
import { readFileSync } from 'node:fs';
import { zeros } from '${SRC}/tensor/index.js';
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
const stillMapped = readFileSync('/proc/self/maps', 'utf8').split('\\n').filter(Boolean)
  .map((l) => l.split(' ')[0].split('-').map((x) => BigInt('0x' + x))).some(([a, b]) => a <= p && end <= b);
console.log(JSON.stringify({ inHeap, stillMapped, shrank: h1 - h2, rssDrop: r1 - r2 }));
`;

function probe(env: Record<string, string>): { inHeap: boolean; stillMapped: boolean; shrank: number; rssDrop: number } {
  // The probe starts from an environment without malloc settings of its own, whatever this one has.
  const base = withoutAllocatorSettings(process.env);
  const r = spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', PROBE], {
    cwd: ROOT, encoding: 'utf8', env: { ...base, ...env },
  });
  assert.equal(r.status, 0, r.stderr);
  return JSON.parse(r.stdout.trim().split('\n').pop()!);
}

test('tuned: a 16 MiB tensor comes from the heap and its memory stays with the process after it is freed; glibc\'s defaults map and unmap it', () => {
  assert.ok(16 * MiB < MALLOC_OPTIONS.mmapThreshold && 16 * MiB < MALLOC_OPTIONS.trimThreshold);
  const tuned = probe({ FLOTILLA_MALLOC: 'tuned' });
  // Served by malloc's arena, not a mapping of its own: its pages stay mapped when it is freed. (The arena
  // is the [heap] unless something was mapped just above the program break, which glibc then works
  // around with mappings of its own for the arena: seen once in many runs, so where it lies is not asserted.)
  assert.ok(tuned.stillMapped, `tuned: the 16 MiB tensor's memory was unmapped when it was freed (expected: kept by malloc's heap; inside [heap]: ${tuned.inHeap})`);
  assert.ok(tuned.shrank < 4 * MiB, `tuned: the heap shrank by ${tuned.shrank} bytes when the tensor was freed`);
  assert.ok(tuned.rssDrop < 4 * MiB, `tuned: freeing the tensor returned ${tuned.rssDrop} resident bytes to the OS`);
  const glibc = probe({ FLOTILLA_MALLOC: 'default' });
  assert.ok(!glibc.inHeap && !glibc.stillMapped, `glibc defaults: the 16 MiB tensor was ${glibc.inHeap ? 'inside [heap]' : 'still mapped after it was freed'} (expected a mapping of its own, unmapped when freed)`);
  assert.ok(glibc.rssDrop >= 15 * MiB, `glibc defaults: freeing returned only ${glibc.rssDrop} resident bytes`);
});

// The tensor cache in a fresh process: where blocks come from, that a freed block serves the next
// request of its size class at the same address without new resident memory, that blocks beyond the
// cap are unmapped oldest first, that releaseIdleMemory returns the blocks nothing took since its
// previous call, that a larger kept block taken by a smaller request is cut to the request's class,
// and that releaseFreedMemory hands the cache back.
const CACHE_PROBE = `
import { readFileSync } from 'node:fs';
import { zeros, releaseFreedMemory, releaseIdleMemory } from '${SRC}/tensor/index.js';
import { native, tensorCacheStats } from '${SRC}/tensor/native.js';
const MiB = 2 ** 20;
const rss = () => Number(readFileSync('/proc/self/statm', 'utf8').split(' ')[1]) * 4096;
const inHeap = (p) => readFileSync('/proc/self/maps', 'utf8').split('\\n').filter((l) => l.endsWith('[heap]'))
  .map((l) => l.split(' ')[0].split('-').map((x) => BigInt('0x' + x))).some(([a, b]) => a <= p && p < b);
const out = {};
const a = zeros([4 * MiB]);                       // 16 MiB, touched
const pa = a.dataPtr();
out.bigInHeap = inHeap(pa);
const s0 = tensorCacheStats();
const small = zeros([1024]);                      // 4 KiB: malloc's
out.smallInHeap = inHeap(small.dataPtr());
const s0b = tensorCacheStats();
out.smallFromMalloc = s0b.liveBytes === s0.liveBytes && s0b.misses === s0.misses && s0b.hits === s0.hits;
small.dispose();
const r1 = rss();
a.dispose();
out.rssDropOnFree = r1 - rss();
const s1 = tensorCacheStats();
const b = zeros([4 * MiB - 100]);                 // the same size class
out.sameAddress = b.dataPtr() === pa;
out.rssGrowOnReuse = rss() - r1;
const s2 = tensorCacheStats();
out.hit = s2.hits - s1.hits;
out.cachedWhileUsed = s2.cachedBytes;
b.dispose();
// A 40 MiB cap: freed blocks of distinct classes beyond it are unmapped oldest first.
native.setTensorCache(256 * 1024, 40 * MiB);
const xs = [zeros([5 * MiB]), zeros([6 * MiB]), zeros([7 * MiB])];
const s3 = tensorCacheStats();
for (const x of xs) x.dispose();
const s4 = tensorCacheStats();
out.evicted = s4.evictions - s3.evictions;
out.cachedAtCap = s4.cachedBytes;
// A request with no kept block of its class takes the smallest kept block up to twice its size.
const big = zeros([7 * MiB - 1000]);              // class 28 MiB: the 28 MiB block kept above
out.bestFit = tensorCacheStats().cachedBytes === 0;
big.dispose();
// trimTensorCache: a block freed before the previous call and not taken since goes back; one taken
// and freed again since stays.
native.setTensorCache(256 * 1024, 1024 * MiB);
const idle = zeros([MiB]), reused = zeros([2 * MiB]);
idle.dispose(); reused.dispose();
releaseIdleMemory();                              // marks: both were freed before this call
const again = zeros([2 * MiB]);                   // takes the 8 MiB block back...
const againPtr = again.dataPtr();
again.dispose();                                  // ...and frees it after the mark
const keptBefore = tensorCacheStats().cachedBytes;
out.trimmed = releaseIdleMemory();
out.keptAfterTrim = tensorCacheStats().cachedBytes;
out.keptBeforeTrim = keptBefore;
// A request that takes a larger kept block gets it cut to its own class, the tail unmapped.
const r3 = rss();
const cut = zeros([1.25 * MiB]);                  // class 5 MiB: the 8 MiB block, every page of it resident
out.cutSameAddress = cut.dataPtr() === againPtr;
out.rssDropOnCut = r3 - rss();
out.liveAfterCut = tensorCacheStats().liveBytes;
cut.dispose();
out.keptAfterCut = tensorCacheStats().cachedBytes;
const r2 = rss();
out.released = releaseFreedMemory();
out.rssDropOnRelease = r2 - rss();
out.cachedAfterRelease = tensorCacheStats().cachedBytes;
out.on = tensorCacheStats().on;
console.log(JSON.stringify(out));
`;

test('cache: a 16 MiB tensor has a mapping of its own, kept when freed and reused by the next request of its class; the cap unmaps the oldest; releaseIdleMemory gives back what a step left unused; a smaller request cuts a larger block to its class; releaseFreedMemory gives back all of it', () => {
  assert.ok(16 * MiB >= TENSOR_CACHE.minBytes && 3 * 28 * MiB < TENSOR_CACHE.capBytes);
  const base = withoutAllocatorSettings(process.env);
  const r = spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', CACHE_PROBE], { cwd: ROOT, encoding: 'utf8', env: base });
  assert.equal(r.status, 0, r.stderr);
  const o = JSON.parse(r.stdout.trim().split('\n').pop()!);
  assert.equal(o.on, true, 'the cache is on by default');
  assert.equal(o.bigInHeap, false, 'the 16 MiB tensor was inside the [heap] mapping (expected a mapping of its own)');
  // Below minBytes the cache hands the request to malloc: it neither maps nor counts the block. Where
  // malloc puts it is not asserted: its main arena is the [heap] until something is mapped just above
  // the program break, and then it continues in mappings of its own (seen under load).
  assert.equal(o.smallFromMalloc, true, `a 4 KiB tensor should come from malloc, not the tensor cache (inside [heap]: ${o.smallInHeap})`);
  assert.ok(o.rssDropOnFree < MiB, `freeing the tensor returned ${o.rssDropOnFree} resident bytes (expected it kept)`);
  assert.equal(o.sameAddress, true, 'the next request of the same class did not get the freed block');
  assert.equal(o.hit, 1);
  assert.equal(o.cachedWhileUsed, 0);
  assert.ok(o.rssGrowOnReuse < MiB, `reusing the block added ${o.rssGrowOnReuse} resident bytes`);
  // Under a 40 MiB cap, with b's 16 MiB block kept: freeing 20, 24 and 28 MiB in that order unmaps
  // 16 and 20 (60 MiB held), then 24 (52): 28 stays.
  assert.equal(o.evicted, 3);
  assert.equal(o.cachedAtCap, 28 * MiB);
  assert.equal(o.bestFit, true, 'a 28 MiB-class request did not take the kept 28 MiB block');
  // Kept before the second call: 28 MiB (freed before the first call), 4 MiB (idle), 8 MiB (reused).
  assert.equal(o.keptBeforeTrim, 40 * MiB);
  assert.equal(o.trimmed, 32 * MiB, 'the blocks left unused since the previous call should go back, the reused one stay');
  assert.equal(o.keptAfterTrim, 8 * MiB);
  // The 5 MiB-class request took the 8 MiB block and unmapped its last 3 MiB: resident memory no
  // tensor uses is not kept live behind a smaller one (the optimizer state made in a first step).
  assert.equal(o.cutSameAddress, true, 'a 5 MiB-class request did not take the kept 8 MiB block');
  assert.ok(o.rssDropOnCut >= 2.5 * MiB, `cutting the 8 MiB block to 5 MiB returned only ${o.rssDropOnCut} resident bytes`);
  assert.equal(o.liveAfterCut, 5 * MiB);
  assert.equal(o.keptAfterCut, 5 * MiB);
  assert.equal(o.released, true);
  assert.ok(o.rssDropOnRelease >= 4.5 * MiB, `releaseFreedMemory returned only ${o.rssDropOnRelease} resident bytes`);
  assert.equal(o.cachedAfterRelease, 0);
});

#!/usr/bin/env node
// Debian's libtorch_cpu.so was linked without --as-needed: it names OpenCV, FFmpeg, ZeroMQ, LevelDB,
// LMDB and OpenCL as NEEDED (caffe2's image, video and database operators) but uses no symbol of
// theirs, and they pull about 250 more libraries (Qt, GStreamer, GDAL) into every process that loads
// the addon: 287 libraries in all, about a third of a second of CPU per rank start in relocations and
// constructors. This writes a copy of the libtorch_cpu the addon links to beside the addon, minus the
// NEEDED entries that define none of its undefined symbols (what --as-needed would have dropped); the
// addon's RUNPATH ($ORIGIN, binding.gyp) makes the loader take the copy. A libtorch with nothing to
// drop (the official builds) gets no copy, and nothing here changes what any symbol resolves to.
//
// DIR/libtorch_cpu.trimmed.json records what was done, and the size and time of the library the copy
// was made from, so that an upgraded libtorch is noticed (dpkg keeps a package's file times, so a newer
// library need not be a newer file).
//
//   node scripts/trim-libtorch.cjs DIR             DIR holds flotilla.node (native/build/Release)
//   node scripts/trim-libtorch.cjs --if-stale DIR  the same, unless the record says it is done for this libtorch
'use strict';
const fs = require('fs');
const path = require('path');
const { spawnSync } = require('child_process');

const say = (line) => process.stderr.write(`flotilla: ${line}\n`);

function run(cmd, args) {
  const r = spawnSync(cmd, args, { encoding: 'utf8', maxBuffer: 1 << 30 });
  if (r.error) throw r.error;
  if (r.status !== 0) throw new Error(`${cmd} ${args.join(' ')}: ${r.stderr.trim()}`);
  return r.stdout;
}

/** soname -> path of the libraries the loader finds for file (ldd). */
function resolved(file) {
  const map = new Map();
  for (const m of run('ldd', [file]).matchAll(/^\s*(\S+) => (\/\S+)/gm)) map.set(m[1], m[2]);
  return map;
}

/** An ELF64 file's dynamic section: the libraries it names (NEEDED) and its dynamic symbols, read
 * straight from .dynamic/.dynsym (readelf takes seconds over libtorch's). */
function dynamic(file) {
  const fd = fs.openSync(file, 'r');
  const read = (offset, size) => {
    const b = Buffer.alloc(size);
    fs.readSync(fd, b, 0, size, offset);
    return b;
  };
  try {
    const h = read(0, 64);
    if (h.readUInt32BE(0) !== 0x7f454c46 || h[4] !== 2 || h[5] !== 1) throw new Error(`${file} is not a little-endian ELF64 file`);
    const shoff = Number(h.readBigUInt64LE(0x28));
    const shentsize = h.readUInt16LE(0x3a);
    const shnum = h.readUInt16LE(0x3c);
    const sh = read(shoff, shentsize * shnum);
    const section = (i) => ({
      type: sh.readUInt32LE(i * shentsize + 4),
      offset: Number(sh.readBigUInt64LE(i * shentsize + 0x18)),
      size: Number(sh.readBigUInt64LE(i * shentsize + 0x20)),
      link: sh.readUInt32LE(i * shentsize + 0x28),
    });
    const all = Array.from({ length: shnum }, (_, i) => section(i));
    const strings = (s) => read(s.offset, s.size);
    const str = (tab, at) => tab.toString('latin1', at, tab.indexOf(0, at));
    const result = { needed: [], undefined: new Set(), defined: new Set() };
    for (const s of all) {
      if (s.type === 6) { // SHT_DYNAMIC: 16-byte (tag, value) pairs; DT_NEEDED = 1
        const tab = strings(all[s.link]);
        const d = read(s.offset, s.size);
        for (let o = 0; o + 16 <= d.length; o += 16) {
          const tag = d.readBigInt64LE(o);
          if (tag === 0n) break;
          if (tag === 1n) result.needed.push(str(tab, Number(d.readBigUInt64LE(o + 8))));
        }
      } else if (s.type === 11) { // SHT_DYNSYM: 24-byte symbols (name, info, other, shndx, ...)
        const tab = strings(all[s.link]);
        const d = read(s.offset, s.size);
        for (let o = 24; o + 24 <= d.length; o += 24) { // entry 0 is the null symbol
          const name = str(tab, d.readUInt32LE(o));
          if (name === '') continue;
          if (d.readUInt16LE(o + 6) === 0) result.undefined.add(name); // SHN_UNDEF
          else if (d[o + 4] >> 4 !== 0) result.defined.add(name); // not STB_LOCAL
        }
      }
    }
    return result;
  } finally {
    fs.closeSync(fd);
  }
}

const RECORD = 'libtorch_cpu.trimmed.json';
const identity = (file) => {
  const st = fs.statSync(file);
  return { size: st.size, mtimeMs: st.mtimeMs };
};

/** Whether DIR's record says the trim was done (or found nothing to do) for the libtorch_cpu installed now. */
function current(dir) {
  try {
    const r = JSON.parse(fs.readFileSync(path.join(dir, RECORD), 'utf8'));
    if (r.from === undefined) return true; // no libtorch_cpu among the addon's libraries
    const now = identity(r.from);
    return now.size === r.size && now.mtimeMs === r.mtimeMs && (r.copy === undefined || fs.existsSync(r.copy));
  } catch {
    return false;
  }
}

function trim(dir) {
  const addon = path.join(dir, 'flotilla.node');
  // An earlier copy goes first, so that ldd names the library the build linked against.
  for (const f of fs.readdirSync(dir)) if (/^libtorch_cpu\.so/.test(f)) fs.rmSync(path.join(dir, f));
  const soname = dynamic(addon).needed.find((n) => /^libtorch_cpu\.so/.test(n));
  const lib = soname && resolved(addon).get(soname);
  const stamp = (what) => fs.writeFileSync(path.join(dir, RECORD), `${JSON.stringify({ ...(lib ? { from: lib, ...identity(lib) } : {}), ...what }, null, 1)}\n`);
  if (!lib) return stamp({ note: 'no libtorch_cpu among the addon\'s libraries' });
  const deps = resolved(lib);
  const { needed, undefined: uses } = dynamic(lib);
  const unused = needed.filter((n) => {
    const p = deps.get(n);
    if (!p) return false; // the loader itself, or not found: leave it as it is
    for (const s of dynamic(p).defined) if (uses.has(s)) return false;
    return true;
  });
  if (unused.length === 0) return stamp({ note: 'every library it names is used' });
  if (spawnSync('patchelf', ['--version']).status !== 0) {
    say(`patchelf is not installed: every process loads the ${unused.length} libraries ${lib} names but does not use (scripts/setup.sh installs patchelf)`);
    return stamp({ note: 'not trimmed: patchelf was not installed', unused });
  }
  const copy = path.join(dir, soname);
  const tmp = `${copy}.tmp`;
  fs.copyFileSync(lib, tmp);
  run('patchelf', [...unused.flatMap((n) => ['--remove-needed', n]), tmp]);
  fs.renameSync(tmp, copy);
  // The copy must load (and be the one loaded); otherwise the addon goes on with the original.
  const check = spawnSync(process.execPath, ['-e', `require(${JSON.stringify(path.resolve(addon))}); process.stdout.write(require('fs').readFileSync('/proc/self/maps', 'utf8'))`], { encoding: 'utf8' });
  if (check.status !== 0 || !check.stdout.includes(path.resolve(copy))) {
    fs.rmSync(copy);
    say(`the addon does not load with ${lib} trimmed of ${unused.join(' ')}; it uses the original\n${check.stderr}`);
    return stamp({ note: 'not trimmed: the trimmed copy did not load', unused });
  }
  stamp({ copy: path.resolve(copy), dropped: unused });
}

try {
  const args = process.argv.slice(2);
  const ifStale = args[0] === '--if-stale';
  const dir = ifStale ? args[1] : args[0];
  if (!dir) throw new Error('usage: trim-libtorch.cjs [--if-stale] DIR (the directory that holds flotilla.node)');
  if (!(ifStale && current(dir))) trim(dir);
} catch (e) {
  say(`could not trim libtorch_cpu (${e.message}); the addon uses it as installed`);
}

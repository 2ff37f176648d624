// Benchmark: what loading the addon costs a process (every rank, every test process pays it), with
// the build's copy of libtorch_cpu without the libraries it never calls (scripts/trim-libtorch.cjs)
// against the libtorch_cpu as installed, which LD_LIBRARY_PATH puts ahead of the addon's RUNPATH.
// Each sample is a fresh `node` that loads the addon and reports its own CPU time since it started,
// its wall time to that point and the files it has mapped; the two kinds alternate. The PyTorch
// peer is `python3 -c "import torch"`, measured the same way.
//
//   node --import tsx bench/startup.ts [--rounds 8] [--no-write]
import { spawnSync } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { parseArgs } from 'node:util';
import { median, writeSection } from './report.js';

const ROOT = join(import.meta.dirname, '..');
const RELEASE = join(ROOT, 'native', 'build', 'Release');
const ADDON = join(RELEASE, 'flotilla.node');

interface Sample { cpu: number; wall: number; files: number }

// The child measures itself: CPU since the process began, wall from its start time in /proc.
const NODE_CHILD = `
const t0 = performance.timeOrigin;
require(${JSON.stringify(ADDON)});
const c = process.cpuUsage();
const files = new Set(require('fs').readFileSync('/proc/self/maps', 'utf8').split('\\n').map((l) => l.split(/\\s+/)[5]).filter((f) => f && f.startsWith('/')));
console.log(JSON.stringify({ cpu: (c.user + c.system) / 1e6, wall: (Date.now() - t0) / 1e3, files: files.size }));`;
const PY_CHILD = `
import time, os, json, resource
import torch
# the process's start (field 22 of /proc/self/stat, in clock ticks since boot)
t0 = float(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19]) / os.sysconf('SC_CLK_TCK')
r = resource.getrusage(resource.RUSAGE_SELF)
files = {l.split()[5] for l in open('/proc/self/maps') if len(l.split()) > 5 and l.split()[5].startswith('/')}
print(json.dumps({'cpu': r.ru_utime + r.ru_stime, 'wall': time.clock_gettime(time.CLOCK_BOOTTIME) - t0, 'files': len(files)}))`;

function sample(cmd: string, args: string[], env: NodeJS.ProcessEnv = process.env): Sample {
  const r = spawnSync(cmd, args, { encoding: 'utf8', env });
  if (r.status !== 0) throw new Error(`${cmd} failed: ${r.stderr}`);
  return JSON.parse(r.stdout.trim().split('\n').pop()!) as Sample;
}

function main(): void {
  const { values: a } = parseArgs({ options: { rounds: { type: 'string', default: '8' }, 'no-write': { type: 'boolean', default: false } } });
  const rounds = Number(a.rounds);
  const record = JSON.parse(readFileSync(join(RELEASE, 'libtorch_cpu.trimmed.json'), 'utf8')) as { from?: string; copy?: string; dropped?: string[] };
  if (record.copy === undefined || record.from === undefined) throw new Error(`no trimmed copy here (${JSON.stringify(record)}): nothing to compare`);
  const kinds: [string, () => Sample][] = [
    ['flotilla addon, trimmed libtorch_cpu (as built)', () => sample(process.execPath, ['-e', NODE_CHILD])],
    ['flotilla addon, libtorch_cpu as installed', () => sample(process.execPath, ['-e', NODE_CHILD], { ...process.env, LD_LIBRARY_PATH: dirname(record.from!) })],
    ['PyTorch: python3 -c "import torch"', () => sample('/usr/bin/python3', ['-c', PY_CHILD])],
  ];
  for (const [, f] of kinds) f(); // one untimed sample each: the files in the page cache
  const got = new Map<string, Sample[]>(kinds.map(([k]) => [k, []]));
  for (let r = 0; r < rounds; r++) for (const [k, f] of r % 2 ? [...kinds].reverse() : kinds) got.get(k)!.push(f());
  const rows = kinds.map(([k]) => {
    const xs = got.get(k)!;
    return `| ${k} | ${median(xs.map((x) => x.cpu)).toFixed(2)} s | ${median(xs.map((x) => x.wall)).toFixed(2)} s | ${median(xs.map((x) => x.files))} |`;
  });
  const table = ['| process | CPU time to loaded | wall time to loaded | files mapped |', '|---|---:|---:|---:|', ...rows].join('\n');
  console.log(table);
  if (!a['no-write']) {
    writeSection('startup', [
      '## Process start: loading the addon',
      '',
      'Every rank and every test process loads the addon before any work. Debian\'s libtorch_cpu names ' +
        `${record.dropped?.length ?? 0} libraries it never calls (OpenCV, FFmpeg, ZeroMQ, LevelDB...), which bring about 250 more; the addon build keeps a copy without them ` +
        '(scripts/trim-libtorch.cjs) that the addon\'s RUNPATH finds first. Each row is the median over fresh processes, alternating, of the CPU time ' +
        'the process used from its start until the addon (or torch) was loaded, the wall time to that point, and the files it had mapped then. ' +
        'The installed libtorch_cpu is loaded by putting its directory on LD_LIBRARY_PATH.',
      '',
      `Reproduce: \`node --import tsx bench/startup.ts --rounds ${rounds}\`.`,
      '',
      table,
    ].join('\n'));
  }
}

main();

#!/usr/bin/env node
// Locates Open MPI for the optional flotilla_mpi addon (native/mpi.cc). The addon is built only
// where mpi.h is found, so a machine without MPI still builds and runs the Gloo backend.
//   node scripts/find-mpi.cjs has       1 when Open MPI's headers are installed, else 0
//   node scripts/find-mpi.cjs include   include dirs
//   node scripts/find-mpi.cjs libs      link flags
//   node scripts/find-mpi.cjs           one line saying what was found
'use strict';
const fs = require('fs');
const path = require('path');
const { execFileSync } = require('child_process');

function fromWrapper() {
  // mpicc knows its own flags (works for any Open MPI prefix on PATH).
  try {
    const inc = execFileSync('mpicc', ['--showme:incdirs'], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'ignore'] }).trim().split(/\s+/).filter(Boolean);
    const libDirs = execFileSync('mpicc', ['--showme:libdirs'], { encoding: 'utf8', stdio: ['ignore', 'pipe', 'ignore'] }).trim().split(/\s+/).filter(Boolean);
    if (inc.some((d) => fs.existsSync(path.join(d, 'mpi.h')))) return { kind: 'mpicc', includes: inc, libDirs };
  } catch {
    // no mpicc on PATH
  }
  return undefined;
}

function locate() {
  const w = fromWrapper();
  if (w) return w;
  const deb = '/usr/lib/x86_64-linux-gnu/openmpi';
  for (const root of [deb, '/usr/lib/aarch64-linux-gnu/openmpi', '/usr/lib64/openmpi', '/usr/local']) {
    if (fs.existsSync(path.join(root, 'include', 'mpi.h'))) {
      return { kind: root, includes: [path.join(root, 'include')], libDirs: [path.join(root, 'lib')] };
    }
  }
  return undefined;
}

const found = locate();
const what = process.argv[2];
if (what === 'has') process.stdout.write(found ? '1' : '0');
else if (what === 'include') process.stdout.write(found ? found.includes.join(' ') : '');
else if (what === 'libs') {
  if (found) process.stdout.write([...found.libDirs.flatMap((d) => [`-L${d}`, `-Wl,-rpath,${d}`]), '-lmpi'].join(' '));
} else process.stdout.write(found ? `Open MPI (${found.kind})\n` : 'no Open MPI (apt-get install libopenmpi-dev openmpi-bin)\n');

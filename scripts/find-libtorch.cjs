#!/usr/bin/env node
// Locates libtorch for the addon build: $LIBTORCH (an unzipped libtorch with include/ and lib/),
// else the Debian system packages (libtorch-dev, libgloo-dev). Prints include dirs or link flags.
'use strict';
const fs = require('fs');
const path = require('path');

function locate() {
  const root = process.env.LIBTORCH;
  if (root) {
    const inc = path.join(root, 'include');
    const lib = path.join(root, 'lib');
    if (!fs.existsSync(path.join(inc, 'torch'))) {
      throw new Error(`LIBTORCH=${root} has no include/torch; point LIBTORCH at an unzipped libtorch`);
    }
    return { kind: `LIBTORCH=${root}`, includes: [inc, path.join(inc, 'torch/csrc/api/include')], libDir: lib };
  }
  const sysInc = '/usr/include/torch/csrc/api/include';
  if (fs.existsSync(sysInc)) {
    return { kind: 'system (Debian libtorch-dev)', includes: [sysInc], libDir: null };
  }
  throw new Error('libtorch not found: run `bash scripts/setup.sh` as root (installs libtorch-dev), or set LIBTORCH=/path/to/libtorch');
}

try {
  const found = locate();
  const what = process.argv[2];
  if (what === 'include') {
    process.stdout.write(found.includes.join(' '));
  } else if (what === 'libs') {
    const flags = [];
    if (found.libDir) flags.push(`-L${found.libDir}`, `-Wl,-rpath,${found.libDir}`);
    flags.push('-ltorch', '-ltorch_cpu', '-lc10', '-lgloo');
    process.stdout.write(flags.join(' '));
  } else {
    process.stdout.write(`${found.kind}\n`);
  }
} catch (e) {
  process.stderr.write(`flotilla: ${e.message}\n`);
  process.exit(1);
}

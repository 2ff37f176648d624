#!/usr/bin/env node
// Says whether node_modules matches package.json and package-lock.json, without npm (fast, offline).
// Prints one reason and exits: 0 up to date, 1 install needed (lockfile is usable: `npm ci`),
// 2 package.json and the lockfile disagree (`npm install` updates the lockfile).
'use strict';
const fs = require('fs');
const path = require('path');

const root = path.resolve(__dirname, '..');
const readJson = (p) => JSON.parse(fs.readFileSync(p, 'utf8'));
const pkg = readJson(path.join(root, 'package.json'));
const lockPath = path.join(root, 'package-lock.json');

function done(code, why) {
  process.stdout.write(`${why}\n`);
  process.exit(code);
}

if (!fs.existsSync(path.join(root, 'node_modules'))) {
  done(fs.existsSync(lockPath) ? 1 : 2, 'node_modules is missing');
}
if (!fs.existsSync(lockPath)) done(2, 'package-lock.json is missing');

const lock = readJson(lockPath);
const top = (lock.packages && lock.packages['']) || {};
for (const field of ['dependencies', 'devDependencies', 'optionalDependencies']) {
  const want = pkg[field] || {};
  const have = top[field] || {};
  const keys = new Set([...Object.keys(want), ...Object.keys(have)]);
  for (const k of keys) {
    if (want[k] !== have[k]) done(2, `package.json ${field}.${k} (${want[k]}) differs from package-lock.json (${have[k]})`);
  }
}

// Every locked package must be installed at its locked version; optional ones (other platforms'
// binaries) may be absent.
for (const [where, entry] of Object.entries(lock.packages || {})) {
  if (where === '' || entry.link) continue;
  const manifest = path.join(root, where, 'package.json');
  let installed;
  try {
    installed = readJson(manifest).version;
  } catch {
    if (entry.optional || entry.devOptional) continue;
    done(1, `${where} is not installed`);
  }
  if (entry.version && installed !== entry.version) {
    done(1, `${where} is ${installed}, package-lock.json wants ${entry.version}`);
  }
}
done(0, 'node_modules is up to date');

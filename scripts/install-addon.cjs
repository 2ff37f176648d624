#!/usr/bin/env node
// The package's `install` step: makes sure an installed flotilla has a native addon that loads.
//
// The package ships the addon built where the tarball was packed (native/build/Release/*.node, with
// native/build/libtorch.txt naming the libtorch it was built against). It is used when it loads here
// and was built against the libtorch this machine has; otherwise the addon is built from native/
// with node-gyp. Without libtorch the build cannot run: the message names the fix, as `npm start`'s does.
//
// In a checkout (npm install / npm ci run inside the repository itself) it does nothing:
// scripts/ensure.sh builds the addon there and keeps track of when to rebuild it.
//
//   node scripts/install-addon.cjs           as above
//   node scripts/install-addon.cjs --build   rebuild the addon whatever is there
'use strict';
const fs = require('fs');
const path = require('path');
const { spawnSync } = require('child_process');

const root = path.resolve(__dirname, '..');
const release = path.join(root, 'native', 'build', 'Release');
const addon = path.join(release, 'flotilla.node');
const stamp = path.join(root, 'native', 'build', 'libtorch.txt');
const say = (line) => process.stderr.write(`flotilla: ${line}\n`);

function isCheckout() {
  // npm sets INIT_CWD to where `npm install` was typed; a dependency installs somewhere below it.
  const initCwd = process.env.INIT_CWD;
  if (initCwd !== undefined && path.resolve(initCwd) === root) return true;
  return fs.existsSync(path.join(root, '.git')) || fs.existsSync(path.join(root, 'scripts', 'ensure.sh'));
}

/** Where this machine's libtorch headers are (what the stamp records), or an error message. */
function findLibtorch() {
  const r = spawnSync(process.execPath, [path.join(__dirname, 'find-libtorch.cjs'), 'include'], { encoding: 'utf8' });
  return r.status === 0 ? { include: r.stdout } : { error: (r.stderr || '').trim().replace(/^flotilla: /, '') };
}

/** Loads the addon in a child process (a failing dlopen must not take this one down). */
function loads(file) {
  const r = spawnSync(process.execPath, ['-e', `require(${JSON.stringify(file)})`], { encoding: 'utf8' });
  return r.status === 0 ? { ok: true } : { ok: false, why: (r.stderr || '').split('\n').find((l) => /Error/.test(l)) || `exit ${r.status}` };
}

function nodeGyp() {
  // npm passes its own node-gyp to lifecycle scripts; a checkout has it in node_modules.
  const fromNpm = process.env.npm_config_node_gyp;
  if (fromNpm && fs.existsSync(fromNpm)) return [process.execPath, [fromNpm]];
  try {
    return [process.execPath, [require.resolve('node-gyp/bin/node-gyp.js', { paths: [root] })]];
  } catch {
    // Run by hand in an installed package: the node-gyp that npm itself bundles.
    const bundled = path.resolve(process.execPath, '..', '..', 'lib', 'node_modules', 'npm', 'node_modules', 'node-gyp', 'bin', 'node-gyp.js');
    return fs.existsSync(bundled) ? [process.execPath, [bundled]] : ['node-gyp', []];
  }
}

function build(libtorch) {
  say(`building the native addon against libtorch from ${libtorch.include.split(' ')[0]} (a minute or two)`);
  const [cmd, pre] = nodeGyp();
  const args = [...pre, 'rebuild', '--directory', path.join(root, 'native'), '-j', '2'];
  // Node's own headers beside the running node (Debian, NodeSource) spare node-gyp a download.
  const prefix = path.resolve(process.execPath, '..', '..');
  if (fs.existsSync(path.join(prefix, 'include', 'node', 'node_api.h'))) args.push(`--nodedir=${prefix}`);
  const r = spawnSync(cmd, args, { cwd: root, stdio: ['ignore', 'pipe', 'pipe'], encoding: 'utf8' });
  if (r.status !== 0) {
    process.stderr.write(`${(r.stdout || '').split('\n').slice(-40).join('\n')}\n${(r.stderr || '').split('\n').slice(-40).join('\n')}\n`);
    say(`building the native addon failed (see above); the build needs a C++17 compiler, make and python3 (bash ${path.join(root, 'scripts', 'setup.sh')} as root installs them on Debian)`);
    process.exit(1);
  }
  fs.writeFileSync(stamp, libtorch.include);
  const check = loads(addon);
  if (!check.ok) {
    say(`the addon was built but does not load: ${check.why}`);
    process.exit(1);
  }
  say(`native addon built: ${addon}`);
}

function main() {
  const force = process.argv.includes('--build');
  if (!force && isCheckout()) return;
  const libtorch = findLibtorch();
  if (!force && fs.existsSync(addon)) {
    const builtFor = fs.existsSync(stamp) ? fs.readFileSync(stamp, 'utf8') : undefined;
    const check = loads(addon);
    // A prebuilt addon fits when it loads and was built against this libtorch (or libtorch's
    // headers are absent, so nothing here could build another one anyway).
    if (check.ok && (libtorch.error !== undefined || builtFor === libtorch.include)) {
      say(`using the prebuilt native addon${builtFor ? ` (built against libtorch from ${builtFor.split(' ')[0]})` : ''}`);
      // The build does this as its last step (native/binding.gyp); the package does not ship the copy.
      spawnSync(process.execPath, [path.join(__dirname, 'trim-libtorch.cjs'), release], { stdio: 'inherit' });
      return;
    }
    say(check.ok ? 'the prebuilt addon was built against another libtorch; rebuilding' : `the prebuilt addon does not load here (${check.why}); rebuilding`);
  }
  if (libtorch.error !== undefined) {
    say(libtorch.error.replace('`bash scripts/setup.sh`', `\`bash ${path.join(root, 'scripts', 'setup.sh')}\``));
    say(`then build the addon: node ${path.join(root, 'scripts', 'install-addon.cjs')} --build`);
    process.exit(1);
  }
  build(libtorch);
}

main();

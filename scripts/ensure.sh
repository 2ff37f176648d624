#!/usr/bin/env bash
# Makes a checkout ready to run: what `npm start` and `npm test` do first. Each step runs only when
# needed and prints one line when it does; when everything is in place it prints nothing.
#   1. system packages (scripts/setup.sh) when any is missing
#   2. npm ci (npm install without a usable lockfile) when node_modules is missing or stale
#   3. the native addon when native/build/Release/flotilla.node is missing or older than its sources
#   4. dist/ (src/ compiled, which bin/flotilla.js runs when it is current) when src/ changed since
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "flotilla: node and npm are needed (Node 20 or newer)" >&2
  exit 1
fi
node_major=$(node -p 'process.versions.node.split(".")[0]')
if [[ "$node_major" -lt 20 ]]; then
  echo "flotilla: Node $(node --version) is too old; install Node 20 or newer" >&2
  exit 1
fi

if ! bash scripts/setup.sh --check; then
  echo "ensure: installing system packages (scripts/setup.sh)"
  bash scripts/setup.sh
fi

# Runs a command quietly; on failure shows the end of its output and a line naming it.
quietly() {
  local log
  log=$(mktemp)
  if ! "$@" >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    rm -f "$log"
    echo "flotilla: '$*' failed (see above)" >&2
    exit 1
  fi
  rm -f "$log"
}

set +e
why=$(node scripts/check-deps.cjs)
deps=$?
set -e
if [[ $deps -eq 1 ]]; then
  echo "ensure: npm ci ($why)"
  quietly npm ci --include=dev --no-audit --no-fund
elif [[ $deps -eq 2 ]]; then
  echo "ensure: npm install ($why)"
  quietly npm install --include=dev --no-audit --no-fund
elif [[ $deps -ne 0 ]]; then
  echo "flotilla: scripts/check-deps.cjs failed: $why" >&2
  exit 1
fi

addon=native/build/Release/flotilla.node
stamp=native/build/libtorch.txt # which libtorch the addon was built against
libtorch=$(node scripts/find-libtorch.cjs include 2>/dev/null || true)
rebuild=""
if [[ ! -f $addon ]]; then
  rebuild="$addon is missing"
elif [[ "$(cat "$stamp" 2>/dev/null)" != "$libtorch" ]]; then
  rebuild="libtorch changed"
else
  newer=$(find native -maxdepth 1 \( -name '*.cc' -o -name '*.h' -o -name binding.gyp \) -newer "$addon" -print -quit)
  [[ -z "$newer" ]] || rebuild="$newer changed"
fi
# The Open MPI addon is built where Open MPI is installed: rebuild when it was installed after the
# last build (or mpi.cc changed since).
mpi_addon=native/build/Release/flotilla_mpi.node
if [[ -z "$rebuild" && "$(node scripts/find-mpi.cjs has)" == 1 ]]; then
  if [[ ! -f $mpi_addon ]]; then
    rebuild="Open MPI is installed but $mpi_addon is missing"
  elif [[ native/mpi.cc -nt $mpi_addon ]]; then
    rebuild="native/mpi.cc changed"
  fi
fi
if [[ -n "$rebuild" ]]; then
  echo "ensure: building the native addon ($rebuild) against libtorch from $(node scripts/find-libtorch.cjs)"
  # Use the headers of the node that runs us when they are installed beside it (Debian, NodeSource),
  # so node-gyp needs no download.
  gyp_args=()
  prefix=$(node -p 'require("path").resolve(process.execPath, "..", "..")')
  if [[ -f "$prefix/include/node/node_api.h" ]]; then gyp_args+=("--nodedir=$prefix"); fi
  quietly npx --no-install node-gyp rebuild --directory native -j 2 "${gyp_args[@]}"
  printf '%s' "$libtorch" > "$stamp"
else
  # The addon's copy of libtorch_cpu (scripts/trim-libtorch.cjs) is made again when libtorch was upgraded.
  node scripts/trim-libtorch.cjs --if-stale native/build/Release
fi

# dist/.built carries the time the build started: bin/flotilla.js runs dist/ only while no file under
# src/ is newer. A build that fails (a type error) leaves no stamp, and the CLI runs the sources.
if [[ ! -f dist/.built || -n "$(find src tsconfig.json tsconfig.build.json -newer dist/.built -print -quit)" ]]; then
  echo "ensure: compiling src/ to dist/ (tsc -p tsconfig.build.json)"
  mkdir -p dist
  rm -f dist/.built
  touch dist/.building
  log=$(mktemp)
  if npx --no-install tsc -p tsconfig.build.json >"$log" 2>&1; then
    mv dist/.building dist/.built
  else
    rm -f dist/.building
    head -n 20 "$log" >&2
    echo "ensure: src/ does not compile (above); bin/flotilla.js runs the sources through tsx" >&2
  fi
  rm -f "$log"
fi

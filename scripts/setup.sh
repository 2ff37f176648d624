#!/usr/bin/env bash
# Installs the Debian system packages flotilla needs: libtorch + gloo for the native addon, a C++
# toolchain and python3 for node-gyp, PyTorch (python3-torch) as the test oracle, and OpenBLAS.
#
# Why OpenBLAS: Debian's libtorch does its matrix products through whatever libblas.so.3 the system
# selects, and with only the reference BLAS (libblas3) a 1024^3 float32 matmul runs at ~2 GFLOP/s on
# one thread, about 10x slower than OpenBLAS. The OpenMP build (libopenblas0-openmp) becomes the
# libblas.so.3 alternative and follows torch's intra-op thread count, so ranks sharing cores do not
# oversubscribe them.
#
# Why Open MPI: the second collectives backend (native/mpi.cc, built as its own addon only where
# mpi.h exists). Within a host it all-reduces over shared memory several times faster than Gloo over
# loopback TCP; `npm start` uses it when it is installed.
#
# Why iproute2: `flotilla run --backend mpi` runs mpirun in a network namespace with only loopback (its
# out-of-band listener binds every interface otherwise) and brings that loopback up with `ip`; the
# route to MASTER_ADDR (`ip route get`) picks Gloo's interface across hosts; the two-host test builds
# its namespaces with it.
#
# Why patchelf: Debian's libtorch_cpu names OpenCV, FFmpeg and more as libraries it needs without using
# any of them, and they bring about 250 libraries into every rank; the addon build keeps a copy of it
# without those names (scripts/trim-libtorch.cjs), which loads in 0.55 s of CPU instead of 0.85.
#
# Why Slurm (slurmctld, slurmd, slurm-client) and munge: the Slurm tests start a real cluster of their
# own (test/helpers/slurm.ts: its own munged, slurmctld and slurmd with a generated slurm.conf in a
# temporary directory) and submit batch jobs to it. The packages' services are neither started nor
# left enabled here: a policy-rc.d refuses the start during the install, and on a systemd machine
# they are disabled afterwards, so nothing runs until a test starts it.
#
# Why chromium: the tests open the run report (RUN/report.html) in headless Chromium and check what
# it draws (test/report_browser.test.ts); flotilla itself never needs a browser.
#
#   bash scripts/setup.sh           install what is missing (as root), or say what to run (not root)
#   bash scripts/setup.sh --check   exit 0 when nothing is missing, 1 otherwise; prints nothing
#
# LIBTORCH=/path/to/unzipped/libtorch replaces libtorch-dev (gloo and python3-torch are still needed).
set -euo pipefail

check_only=0
case "${1:-}" in
  --check) check_only=1 ;;
  '') ;;
  *) echo "usage: bash scripts/setup.sh [--check]" >&2; exit 2 ;;
esac

packages=(build-essential g++ make python3 libgloo-dev python3-torch libopenblas0-openmp libopenmpi-dev openmpi-bin iproute2 patchelf chromium python3-jinja2
  slurmctld slurmd slurm-client munge)
if [[ -n "${LIBTORCH:-}" ]]; then
  if [[ ! -d "$LIBTORCH/include/torch" ]]; then
    echo "flotilla setup: LIBTORCH=$LIBTORCH has no include/torch; point LIBTORCH at an unzipped libtorch or unset it" >&2
    exit 1
  fi
else
  packages+=(libtorch-dev)
fi

if ! command -v dpkg-query >/dev/null 2>&1; then
  # Not Debian: nothing here can check or install; the addon build names what it cannot find.
  if [[ $check_only -eq 1 ]]; then exit 0; fi
  echo "flotilla setup: this script knows Debian only (no dpkg-query). Install libtorch (or set LIBTORCH), gloo," >&2
  echo "a C++17 toolchain, make, python3 and PyTorch for python3 by hand." >&2
  exit 1
fi

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done

if [[ ${#missing[@]} -eq 0 ]]; then exit 0; fi
if [[ $check_only -eq 1 ]]; then exit 1; fi

install_line="apt-get install -y ${missing[*]}"
if [[ $(id -u) -ne 0 ]]; then
  echo "flotilla setup: missing system packages: ${missing[*]}" >&2
  echo "run as root:  apt-get update && $install_line" >&2
  exit 1
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
echo "setup: apt-get update"
if ! DEBIAN_FRONTEND=noninteractive apt-get update >"$log" 2>&1; then
  cat "$log" >&2
  echo "flotilla setup: apt-get update failed (see above)" >&2
  exit 1
fi
# Services installed here (munge, slurmd, slurmctld) must not start: a policy-rc.d that refuses every
# start while apt runs, unless the machine already has one.
policy=/usr/sbin/policy-rc.d
own_policy=0
if [[ ! -e $policy ]]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy"
  chmod 755 "$policy"
  own_policy=1
  trap 'rm -f "$log" "$policy"' EXIT
fi
echo "setup: $install_line"
if ! DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}" >"$log" 2>&1; then
  tail -n 40 "$log" >&2
  echo "flotilla setup: '$install_line' failed (see above)" >&2
  exit 1
fi
if [[ $own_policy -eq 1 ]]; then rm -f "$policy"; fi
# Under systemd the packages enable their units for the next boot; the tests start their own daemons.
if [[ -d /run/systemd/system ]]; then
  systemctl disable --now munge slurmd slurmctld >/dev/null 2>&1 || true
fi

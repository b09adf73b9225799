#!/usr/bin/env bash
# The GPU checks of issue 18 in one pass, for a machine with an NVIDIA GPU that may have no
# network: build the native core, run the CUDA tests (tests/test_cuda.py), run the GPU benchmark
# (scripts/bench/gpu.py), look for RDMA (verbs) devices. Logs and the benchmark's JSON go to $OUT.
# Each step has its own time limit and the next one runs whatever happened; a summary comes last.
#
#   OUT=/tmp/out scripts/device-check.sh              # on the GPU machine (about 6-8 minutes)
#   scripts/device-check.sh --dry-run                 # anywhere: everything but CUDA and bench
#
# The tree this script lives in is what gets built and tested (it may be a copy of the repo).
# Environment:
#   PYTHON             interpreter with torch (default python3)
#   TC_CARRY           what the machine lacks: whl/*.whl, installed with --no-deps into
#                      /tmp/tc-site (put first on PYTHONPATH), and include/xxhash.h
#   TC_BENCH_SIZE_GIB  model size for the benchmark (default 12), TC_BENCH_SMALL_GIB (1.5)
#   TC_STEP_LIMITS     "build test bench" limits in seconds (default "150 200 300")
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT="${OUT:-/tmp/tc-device-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
CARRY="${TC_CARRY:-$ROOT/.devcarry}"
SITE=/tmp/tc-site
BUILD=/tmp/tc-native-build
read -r LIMIT_BUILD LIMIT_TEST LIMIT_BENCH <<<"${TC_STEP_LIMITS:-150 200 300}"
T0=$(date +%s)
SUMMARY=()

log() { echo "[$(($(date +%s) - T0))s] $*" | tee -a "$OUT/steps.log"; }

step() { # name limit_s command : output to $OUT/name.log, status to the summary
  local name=$1 limit=$2 command=$3
  log "$name: start (limit ${limit}s)"
  local t=$(date +%s)
  timeout --kill-after=15 "$limit" bash -c "$command" >>"$OUT/$name.log" 2>&1
  local rc=$?
  local line
  line="$name: rc=$rc in $(($(date +%s) - t))s"
  [ $rc = 124 ] || [ $rc = 137 ] && line="$line (TIME LIMIT)"
  log "$line"
  SUMMARY+=("$line")
  return $rc
}

environment() {
  echo "== date"; date -u
  echo "== uname"; uname -a
  echo "== cpus / memory"; nproc; free -g
  echo "== nvidia-smi"
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current --format=csv 2>&1
  nvidia-smi topo -m 2>&1 | head -20
  echo "== python"; command -v "$PY"; "$PY" -V
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" 2>&1
  "$PY" -m pip list 2>/dev/null | grep -i -E "^(torch|grpcio|protobuf|nanobind|scikit.build|typer|click|safetensors|transformers|numpy|pytest|hypothesis|psutil|xxhash) " || true
  echo "== shared-memory huge pages"; cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>&1
  echo "== compilers"; command -v g++ c++ cmake ninja nvcc 2>&1; g++ --version 2>&1 | head -1
  echo "== python headers"; "$PY" -c "import sysconfig, os; p = sysconfig.get_paths()['include']; print(p, os.path.exists(os.path.join(p, 'Python.h')))"
  echo "== RDMA (verbs)"
  if command -v ibv_devices >/dev/null; then ibv_devices 2>&1; ibv_devinfo 2>&1 | head -40; else echo "ibv_devices: not installed"; fi
  echo "/sys/class/infiniband:"; ls -la /sys/class/infiniband 2>&1
  ls /dev/infiniband 2>&1
  "$PY" -c "import pyverbs; print('pyverbs', pyverbs.__file__)" 2>&1 | tail -1
  command -v lspci >/dev/null && lspci 2>/dev/null | grep -i -E "mellanox|infiniband|ethernet|nvidia" || echo "lspci: not installed"
  ls /sys/class/net 2>&1
}

deps() {
  if [ $DRY = 1 ]; then
    echo "dry run: not installing $(ls "$CARRY"/whl/*.whl 2>/dev/null | wc -l) carried wheels"
    return 0
  fi
  if ls "$CARRY"/whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$CARRY"/whl/*.whl
  fi
}

build() { # the native core, straight with CMake, into this tree's tensorcast/ package
  local include="$CARRY/include"
  [ -f "$include/xxhash.h" ] || include=/usr/include
  rm -rf "$BUILD"
  local generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  cmake -S native -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$(command -v "$PY")" -DXXHASH_INCLUDE_DIR="$include" \
    -DTC_BUILD_TESTS=ON &&
    cmake --build "$BUILD" -j "$(nproc)" &&
    cp "$BUILD"/_native*.so tensorcast/ &&
    "$PY" -c "import tensorcast._native as n, tensorcast.transport.cuda; print('native ok', n.__file__)" &&
    (cd "$BUILD" && ctest --output-on-failure -R "tc_(core|frame|pages)_tests")
}

cuda_tests() { # on a machine without CUDA the GPU tests skip, saying why
  rm -rf /tmp/tc-pytest
  "$PY" -m pytest tests/test_cuda.py -v -rs -p no:cacheprovider --basetemp=/tmp/tc-pytest \
    --timeout 90
}

bench() { # the model files on a disk, not tmpfs: dropping the page cache must mean something
  local base
  for base in /var/tmp /root /tmp; do
    [ -d "$base" ] && [ "$(stat -f -c %T "$base")" != tmpfs ] && break
  done
  "$PY" scripts/bench/gpu.py --size-gib "${TC_BENCH_SIZE_GIB:-12}" \
    --small-gib "${TC_BENCH_SMALL_GIB:-1.5}" --workdir "$base/tc-gpu-bench" \
    --out "$OUT/gpu-bench.json"
}

collect_logs() { # worker and store logs of the tests and the bench, one archive
  tar -czf "$OUT/service-logs.tar.gz" --ignore-failed-read \
    $(find /tmp/tc-pytest /var/tmp/tc-gpu-bench /root/tc-gpu-bench /tmp/tc-gpu-bench \
      -name "*.log" 2>/dev/null | head -200) \
    2>/dev/null || true
}

export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export ROOT DRY OUT PY CARRY SITE BUILD
export -f deps build cuda_tests bench
log "device check of $ROOT (dry run: $DRY), out $OUT"
environment >"$OUT/env.log" 2>&1
grep -A3 "RDMA" "$OUT/env.log" | head -4
step deps 120 deps
if step build "$LIMIT_BUILD" build; then
  step test "$LIMIT_TEST" cuda_tests
  if [ $DRY = 1 ]; then
    step bench 60 '"$PY" scripts/bench/gpu.py --help'  # parses, imports
  else
    step bench "$LIMIT_BENCH" bench
  fi
else
  tail -30 "$OUT/build.log"
fi
collect_logs
echo
echo "== summary ($(($(date +%s) - T0))s)"
printf '%s\n' "${SUMMARY[@]}"
echo "== tests"
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/test.log" 2>/dev/null | tail -40
echo "== bench"
grep -v '^{' "$OUT/bench.log" 2>/dev/null | tail -30

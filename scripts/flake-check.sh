#!/usr/bin/env bash
# Runs the C++ tests and pytest N times each, idle and under CPU load, and reports every failure.
#
#   scripts/flake-check.sh N [--load-only | --idle-only] [--cpp-only] [-- PYTEST_ARGS...]
#
# Load: one busy process per core (stress-ng when installed, else shell busy loops), so every
# test runs with the scheduler short of CPU, which is when timing assumptions break. Logs of
# failed runs are kept under build/flake-check/. Exit status: 0 when every run passed.
set -uo pipefail
cd "$(dirname "$0")/.."

runs=${1:?usage: scripts/flake-check.sh N [--load-only|--idle-only] [--cpp-only] [-- PYTEST_ARGS...]}
shift
modes=(idle load)
cpp_only=0
pytest_args=(-q -x -p no:cacheprovider)
while [ $# -gt 0 ]; do
  case "$1" in
    --load-only) modes=(load) ;;
    --idle-only) modes=(idle) ;;
    --cpp-only) cpp_only=1 ;;
    --) shift; pytest_args+=("$@"); break ;;
    *) echo "flake-check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

. .venv/bin/activate
logs=build/flake-check
mkdir -p "$logs"
cmake -S native -B build/native-tests -DTC_BUILD_TESTS=ON -DTC_BUILD_PYTHON=OFF >/dev/null
cmake --build build/native-tests -j2 >/dev/null

load_pids=()
start_load() {
  local cores
  cores=$(nproc)
  if command -v stress-ng >/dev/null; then
    stress-ng --cpu "$cores" --timeout 0 --quiet &
    load_pids+=($!)
  else
    for _ in $(seq "$cores"); do
      bash -c 'while :; do :; done' &
      load_pids+=($!)
    done
  fi
}
stop_load() {
  [ ${#load_pids[@]} -gt 0 ] && kill "${load_pids[@]}" 2>/dev/null
  wait "${load_pids[@]}" 2>/dev/null
  load_pids=()
}
trap stop_load EXIT

failures=0
report() {  # report NAME MODE RUN STATUS LOG
  if [ "$4" -ne 0 ]; then
    failures=$((failures + 1))
    echo "FAIL  $1 ($2) run $3: log $5"
    tail -n 15 "$5" | sed 's/^/      /'
  else
    rm -f "$5"
  fi
}

for mode in "${modes[@]}"; do
  [ "$mode" = load ] && start_load
  for i in $(seq "$runs"); do
    log="$logs/cpp-$mode-$i.log"
    timeout 300 ctest --test-dir build/native-tests --output-on-failure >"$log" 2>&1
    report "C++ tests" "$mode" "$i" $? "$log"
  done
  if [ "$cpp_only" = 0 ]; then
    for i in $(seq "$runs"); do
      log="$logs/pytest-$mode-$i.log"
      timeout 3600 python -m pytest "${pytest_args[@]}" >"$log" 2>&1
      report "pytest" "$mode" "$i" $? "$log"
    done
  fi
  stop_load
done

total=$(( ${#modes[@]} * runs * (cpp_only == 1 ? 1 : 2) ))
echo "flake-check: $failures failure(s) in $total runs (modes: ${modes[*]}; $runs each)"
[ "$failures" -eq 0 ]

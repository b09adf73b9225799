#!/usr/bin/env bash
# The whole test suite: generated-file staleness, lint, types, the C++ core's own tests, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate

echo "== generated protobuf stubs up to date"
python scripts/gen_proto.py --check
echo "== man pages up to date"
python scripts/gen_man.py --check
echo "== ruff"
ruff check tensorcast tests scripts
ruff format --check tensorcast tests scripts
echo "== mypy"
mypy
echo "== native core (C++ tests)"
cmake -S native -B build/native-tests -DTC_BUILD_TESTS=ON -DTC_BUILD_PYTHON=OFF >/dev/null
cmake --build build/native-tests -j2 >/dev/null
ctest --test-dir build/native-tests --output-on-failure
echo "== pytest"
python -m pytest "$@"

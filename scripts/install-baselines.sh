#!/usr/bin/env bash
# Installs the systems the benchmarks compare against (none of them is a TensorCast dependency):
#   Debian: redis-server (Redis baseline), iperf3 (network ceiling), libibverbs1 (Mooncake's wheel
#           links it even for TCP)
#   PyPI (into .venv): redis + hiredis (client), mooncake-transfer-engine-non-cuda (Mooncake
#           transfer engine and Store, `mooncake_master`), sglang-router (the SGLang model gateway),
#           matplotlib (the router benchmark's plots)
# Idempotent: what is already there is skipped. Needs root for the Debian packages.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v iperf3 >/dev/null || need+=(iperf3)
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || need+=(libibverbs1)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "install-baselines: missing Debian packages: ${need[*]} (run as root or install them)" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

[ -x .venv/bin/python ] || { echo "install-baselines: run scripts/setup.sh first" >&2; exit 1; }
. .venv/bin/activate
pip install -q --disable-pip-version-check redis hiredis mooncake-transfer-engine-non-cuda \
  sglang-router matplotlib
python - <<'PY'
import shutil
import redis, sglang_router, matplotlib  # noqa: F401
from mooncake.store import MooncakeDistributedStore  # noqa: F401
missing = [b for b in ("redis-server", "mooncake_master") if shutil.which(b) is None]
assert not missing, f"not on PATH: {missing}"
print("install-baselines: ok")
PY

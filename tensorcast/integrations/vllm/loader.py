"""`load_format="tensorcast"`: vLLM takes its weights from the TensorCast worker holding the
artifact, never from model files on disk.

    LLM(model=prepare_model_dir("llama@v1"), load_format="tensorcast")
    LLM(model=DIR, load_format="tensorcast",
        model_loader_extra_config={"artifact": "llama@v1", "addr": ..., "token": ...,
                                   "state_dir": ...})

The artifact defaults to the one named by the model directory's `.tensorcast.json` marker
(written by `prepare_model_dir`); `addr`/`token`/`state_dir` default as for `tc.connect()`. On a
host whose worker holds the artifact the tensors are mapped from its shared memory (no copy, no
disk); elsewhere the local worker pulls a replica first. vLLM's own `model.load_weights` then
copies them into its parameters (fusing q/k/v and gate/up as it does for files), so the mapped
pages are only read once.

Errors are TensorCast's typed errors with what to do: NotFound (no such artifact),
InvalidArgument (not a model directory, weights that do not fit the model), Unavailable (no
cluster); vLLM raises them from `LLM()`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from tensorcast.errors import InvalidArgument
from tensorcast.integrations import connection
from tensorcast.integrations.vllm import model as model_mod
from tensorcast.model_dir import FILE_PREFIX

if TYPE_CHECKING:
    import torch.nn as nn
    from vllm.config import ModelConfig
    from vllm.config.load import LoadConfig

log = init_logger("vllm.tensorcast")  # under "vllm": printed with vLLM's own log lines
EXTRA_KEYS = {"artifact", *connection.CONNECTION_KEYS}
WHERE = "model_loader_extra_config"


class TensorCastModelLoader(BaseModelLoader):
    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        extra = dict(load_config.model_loader_extra_config or {})
        unknown = sorted(set(extra) - EXTRA_KEYS)
        if unknown:
            raise InvalidArgument(
                f"{WHERE}: unknown keys {unknown} for load_format='tensorcast' "
                f"(known: {sorted(EXTRA_KEYS)})"
            )
        artifact = extra.get("artifact")
        if artifact is not None and (not isinstance(artifact, str) or not artifact):
            raise InvalidArgument(f"{WHERE}: 'artifact' must be an artifact id like 'llama@v1'")
        self.artifact: str | None = artifact
        self.connection = connection.connection_options(extra, WHERE)
        self.load_seconds = 0.0

    def artifact_for(self, model_config: ModelConfig) -> str:
        artifact = self.artifact or model_mod.marker_of(model_config.model).get("artifact")
        if not artifact:
            raise InvalidArgument(
                f"load_format='tensorcast' needs the artifact: pass {WHERE}="
                "{'artifact': 'NAME@VERSION'} or a model directory made by "
                "tensorcast.integrations.vllm.prepare_model_dir"
            )
        return str(artifact)

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing is downloaded: checks that the artifact exists and is a model directory."""
        rt = connection.runtime(**self.connection)
        model_mod.artifact_files(rt, self.artifact_for(model_config))

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        started = time.perf_counter()
        artifact = self.artifact_for(model_config)
        rt = connection.runtime(**self.connection)
        model_mod.artifact_files(rt, artifact)  # NotFound / not a model directory, clearly
        tensors = rt.artifact(artifact).tensor_dict()
        weights = ((n, t) for n, t in tensors.items() if not n.startswith(FILE_PREFIX))
        try:
            loaded: Any = cast(Any, model).load_weights(weights)
        except (AssertionError, KeyError, ValueError, RuntimeError) as e:
            raise InvalidArgument(
                f"the weights of {artifact!r} do not fit {type(model).__name__} as configured "
                f"by {model_config.model}: {type(e).__name__}: {e}"
            ) from None
        if loaded is not None and model_config.quantization is None:
            missing = sorted({n for n, _ in model.named_parameters()} - set(loaded))
            if missing:
                raise InvalidArgument(
                    f"{artifact!r} lacks weights that {type(model).__name__} needs: "
                    f"{missing[:5]}{' ...' if len(missing) > 5 else ''}"
                )
        del tensors  # the mapping of the worker's pool goes with the last reference
        self.load_seconds = time.perf_counter() - started
        log.info("Loading weights took %.2f seconds (tensorcast %s)", self.load_seconds, artifact)

"""vLLM integration: weights from TensorCast (`load_format="tensorcast"`), KV blocks shared as
TensorCast KV pages (`kv_connector="TensorCastConnector"`), and vLLM servers run as instances
(`tc instance start --engine vllm`).

`register()` is the project's `vllm.general_plugins` entry point, so vLLM calls it in every
process it starts (front end, engine core, workers) before it reads its configuration. It only
records names: nothing here imports vLLM or torch until vLLM asks for the classes.
"""

from __future__ import annotations

LOAD_FORMAT = "tensorcast"
CONNECTOR_NAME = "TensorCastConnector"


def register() -> None:
    """Register the model loader and the KV connector with vLLM (idempotent)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.model_executor.model_loader import register_model_loader

    from tensorcast.integrations.vllm.loader import TensorCastModelLoader

    try:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "tensorcast.integrations.vllm.connector", "TensorCastConnector"
        )
    except ValueError:  # registered already (the plugin ran twice in this process)
        pass
    register_model_loader(LOAD_FORMAT)(TensorCastModelLoader)


def prepare_model_dir(artifact: str, **connection: object):
    """See `tensorcast.integrations.vllm.model.prepare_model_dir`."""
    from tensorcast.integrations.vllm.model import prepare_model_dir as prepare

    return prepare(artifact, **connection)  # type: ignore[arg-type]

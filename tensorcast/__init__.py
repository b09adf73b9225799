"""TensorCast: tensor lifecycle as a service.

    import tensorcast as tc
    rt = tc.connect()              # the local cluster (`tc up`), or tc.connect("host:7400")
    art = rt.put({"w": torch.ones(4)}, "my-weights@v1")
    tensors = rt.artifact("my-weights@v1").tensor_dict()

Heavy modules (torch, grpc) load on first use, so importing the package stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensorcast.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FencingError,
    IntegrityError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TensorcastError,
    Unauthenticated,
    Unavailable,
)

__version__ = "0.1.0"

if TYPE_CHECKING:
    from tensorcast.sdk.artifact import Artifact
    from tensorcast.sdk.plan import CallContext, Plan
    from tensorcast.sdk.runtime import Runtime, connect
    from tensorcast.sdk.weight_sync import WeightPublisher, WeightSubscriber

__all__ = [
    "AlreadyExists",
    "Artifact",
    "CallContext",
    "DeadlineExceeded",
    "FencingError",
    "IntegrityError",
    "InvalidArgument",
    "NotFound",
    "Plan",
    "ResourceExhausted",
    "Runtime",
    "TensorcastError",
    "Unauthenticated",
    "Unavailable",
    "WeightPublisher",
    "WeightSubscriber",
    "connect",
]


def __getattr__(name: str) -> Any:
    if name in ("connect", "Runtime"):
        from tensorcast.sdk import runtime

        return getattr(runtime, name)
    if name in ("WeightPublisher", "WeightSubscriber"):
        from tensorcast.sdk import weight_sync

        return getattr(weight_sync, name)
    if name in ("CallContext", "Plan"):
        from tensorcast.sdk import plan

        return getattr(plan, name)
    if name == "Artifact":
        from tensorcast.sdk.artifact import Artifact

        return Artifact
    raise AttributeError(f"module 'tensorcast' has no attribute {name!r}")

"""The contract between TensorCast and an inference engine instance.

An adaptor lets the control plane see an instance's load, move a request's KV cache to another
instance as named pages (so generation continues there token-identically), drop caches, and reach
the engine's weight tensors so new weights can be written in place. Engines differ in how they lay
out KV memory; pages plus `meta` are the engine-neutral form that crosses process boundaries.

torch is imported only for type checking: importing this module must stay cheap for `tc --help`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class InstanceLoad:
    """A point-in-time view of an instance's work, for placement and migration decisions."""

    waiting: int  # requests queued, not yet running
    running: int  # requests currently generating
    cached_tokens: int  # tokens held in KV caches of resident requests
    requests: tuple[str, ...] = ()  # resident request ids


@dataclass(frozen=True)
class RequestStat:
    """One resident request as a rebalancing policy needs it (Algorithm 1's inputs)."""

    req_id: str
    tokens: int  # tokens of KV cache resident for it
    idle_s: float  # seconds since it last ran (0 while running)
    running: bool = False  # generating (or queued to) right now
    migrations: int = 0  # times its KV cache was imported from another instance

    def to_json(self) -> dict:
        return {
            "req_id": self.req_id,
            "tokens": self.tokens,
            "idle_s": round(self.idle_s, 3),
            "running": self.running,
            "migrations": self.migrations,
        }


@dataclass(frozen=True)
class KVExport:
    """One request's KV cache as pages plus what an importer needs to rebuild it.

    Every page is a contiguous CPU tensor the caller owns (a copy, never a view of engine memory),
    holding at most `page_tokens` tokens of one layer's K or V. `meta` is JSON-serialisable so the
    pages can travel as a safetensors file and the meta as JSON.
    """

    pages: dict[str, torch.Tensor]
    meta: dict[str, Any]


class InstanceAdaptor(ABC):
    """An engine instance as TensorCast sees it. Implementations must be thread-safe.

    Failure contract: methods raise `tensorcast.errors` classes only; a method that raises leaves
    the instance as it was.
    """

    engine: str  # e.g. "hf-transformers"

    @abstractmethod
    def export_kv(self, req_id: str) -> KVExport:
        """Copy `req_id`'s KV cache out; the request stays resident. NotFound if not resident."""

    @abstractmethod
    def import_kv(self, req_id: str, export: KVExport) -> None:
        """Make `req_id` resident from an export so it can be continued here.

        Validates everything first: InvalidArgument for pages that do not fit the model (layers,
        shapes, dtype, missing or extra pages); AlreadyExists if `req_id` is already resident.
        """

    @abstractmethod
    def evict(self, req_id: str) -> bool:
        """Drop the request's KV cache locally; False if it was not resident."""

    @abstractmethod
    def load(self) -> InstanceLoad:
        """Current load; must not wait for running generations."""

    def request_stats(self) -> list[RequestStat]:
        """Per-request detail for rebalancing policies; engines that track no more than the
        resident ids report each with 0 tokens, never idle, never migrated."""
        load = self.load()
        return [RequestStat(r, 0, 0.0) for r in load.requests]

    @abstractmethod
    def buffers(self) -> dict[str, torch.Tensor]:
        """Engine tensors that `transform_into` may fill in place (the model's parameters by name).

        They share storage with the running model: writing them changes what the engine computes.
        """

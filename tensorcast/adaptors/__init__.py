"""The contract between TensorCast and an inference engine instance.

An adaptor lets the control plane see an instance's load, move a request's KV cache to another
instance as named pages (so generation continues there token-identically), drop caches, and reach
the engine's weight tensors so new weights can be written in place. Engines differ in how they lay
out KV memory; pages plus `meta` are the engine-neutral form that crosses process boundaries.

torch is imported only for type checking: importing this module must stay cheap for `tc --help`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tensorcast.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

MAX_KV_PARTS = 64  # a migration cuts a request's KV cache into at most this many parts
DEFAULT_KV_PARTS = 4  # parts per migration (tc migrate --parts; routers)


def check_part(part: object, parts: object) -> None:
    """InvalidArgument unless `part` of `parts` names a part of a migration in parts."""
    if (
        not isinstance(parts, int)
        or not isinstance(part, int)
        or not 1 <= parts <= MAX_KV_PARTS
        or not 0 <= part < parts
    ):
        raise InvalidArgument(
            f"part must be in [0, parts) and parts in [1, {MAX_KV_PARTS}], "
            f"not {part!r} of {parts!r}"
        )


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

    Every page is a contiguous CPU tensor holding at most `page_tokens` tokens of one layer's K
    or V: a copy the caller owns, or (when `release` is set) memory the adaptor keeps unchanged
    until the caller calls `release`. `meta` is JSON-serialisable so the pages can travel as a
    safetensors file and the meta as JSON.
    """

    pages: dict[str, torch.Tensor]
    meta: dict[str, Any]
    # When set, the caller must call it once it is done with the pages (never while they are in
    # use): the adaptor then reuses their memory, or unpins the engine blocks they view.
    release: Callable[[], None] | None = None


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
        The pages' memory is the caller's again once this returns (it reuses it for the next
        import): keep copies, never views of it (pages lent by `import_buffers` excepted).
        """

    def export_kv_part(self, req_id: str, part: int, parts: int) -> KVExport | None:
        """Part `part` (0-based) of `parts` of the request's KV cache, for a migration that
        streams (the target imports part 0 while the source exports part 1). An engine that can
        cut its export returns every part's own pages with the whole request's meta; the
        default returns the whole export as part 0 and None (nothing) for the others, so any
        engine migrates in parts, only without the overlap."""
        return self.export_kv(req_id) if part == 0 else None

    def import_buffers(
        self, req_id: str, part: int, parts: int, meta: dict[str, Any]
    ) -> KVExport | None:
        """Engine memory to read part `part`'s pages straight into before `import_kv_part`:
        writable pages named and sized like the part's, lent until `release` (always called;
        it takes back those an import did not keep). An import given these very pages keeps
        them without a copy. None (the default): the caller reads into buffers of its own and
        the import copies."""
        return None

    def import_kv_part(self, req_id: str, part: int, parts: int, export: KVExport | None) -> bool:
        """Take part `part` of `parts` (in any order, each at most once per attempt; a part
        sent again replaces its earlier copy). True once the request is resident: after its
        last part arrived. Same validation and failure contract as `import_kv`; parts of an
        attempt that never completes must not hold memory for ever (the default keeps none:
        it imports a whole export at once and ignores the empty parts)."""
        if export is None:
            return False
        self.import_kv(req_id, export)
        return True

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

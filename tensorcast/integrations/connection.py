"""How an engine plugin (vLLM's loader and connector, SGLang's storage backend) reaches the
cluster: its extra-config options, and one runtime per process, cluster and role."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tensorcast.errors import InvalidArgument, TensorcastError

if TYPE_CHECKING:
    from tensorcast.sdk.runtime import Runtime

CONNECTION_KEYS = ("addr", "token", "state_dir")
_runtimes: dict[tuple[Any, ...], Runtime] = {}
_runtimes_lock = threading.Lock()


def connection_options(options: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """The `addr`, `token` and `state_dir` entries of an extra-config dict, checked."""
    options = dict(options or {})
    out = {}
    for key in CONNECTION_KEYS:
        value = options.get(key)
        if value is not None and not isinstance(value, str | os.PathLike):
            raise InvalidArgument(f"{where}: {key!r} must be a string, not {value!r}")
        out[key] = str(value) if value else None
    return out


def runtime(
    addr: str | None = None,
    token: str | None = None,
    state_dir: str | None = None,
    *,
    role: str = "",
    timeout_s: float | None = None,
) -> Runtime:
    """One `tc.connect()` per process, cluster and `role` (callers that may run at the same
    time on different threads take different roles: each gets its own page connections).

    Unavailable (with what to do) when no cluster answers: vLLM reports it at `LLM()`.
    """
    from tensorcast.sdk.runtime import connect

    key = (addr, token, state_dir, role, timeout_s)
    with _runtimes_lock:
        rt = _runtimes.get(key)
        if rt is None:
            try:
                rt = connect(addr, token, state_dir=state_dir, timeout_s=timeout_s)
            except TensorcastError as e:
                raise type(e)(f"TensorCast cluster unreachable for vLLM: {e}") from None
            _runtimes[key] = rt
        return rt

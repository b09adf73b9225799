"""Byte buffers kept for reuse between large copies (KV pages exported, KV pages received).

Why: memory a process touched before takes a copy at memory speed, while fresh pages fault in
one by one and are zeroed by the kernel first. On this project's 2-core VM a 256 MiB KV
export into fresh bytearrays took 0.6 s (57% of it the kernel clearing pages), into reused
ones 0.05 s. The same holds on real hosts at a smaller factor; engines keep their KV buffers
for the same reason.
"""

from __future__ import annotations

import threading


class BufferPool:
    """Bytearrays by exact size. `take` reuses idle ones (or allocates); `give` keeps them while
    the idle total stays within `max_idle_bytes` and drops the rest. Thread-safe."""

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._idle: dict[int, list[bytearray]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, sizes: list[int]) -> list[bytearray]:
        out: list[bytearray | None] = [None] * len(sizes)
        with self._lock:
            for i, size in enumerate(sizes):
                spare = self._idle.get(size)
                if spare:
                    out[i] = spare.pop()
                    self._idle_bytes -= size
        return [b if b is not None else bytearray(size) for b, size in zip(out, sizes)]

    def give(self, buffers: list[bytearray]) -> None:
        with self._lock:
            for buffer in buffers:
                if self._idle_bytes + len(buffer) > self.max_idle_bytes:
                    return
                self._idle.setdefault(len(buffer), []).append(buffer)
                self._idle_bytes += len(buffer)

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

"""`StoreBatcher`: a worker's same-host callers' Global Store requests, coalesced.

Every caller thread queues its operation (a put, a lookup, a delete); a caller that finds a
free request slot sends every queued operation as one `Batch` request and hands each its
result, while the others wait. At most MAX_IN_FLIGHT requests are in flight: operations pile up
meanwhile and the next request carries them all. Two, not one, so the store commits one
request's writes while the next is on its way and being parsed (its group commit merges what
arrives during a commit); with one, the store's writer sat idle for half of every round trip.
One caller alone waits for nothing (it sends its own operation at once). Each operation's
result or error is its own; a request that fails as a whole (the store unreachable) fails every
operation it carried with that error. Bounded: at most MAX_OPS operations per request, and a
caller waits no longer than its timeout for a slot.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tensorcast.errors import DeadlineExceeded, TensorcastError, error_named
from tensorcast.proto import tensorcast_pb2 as pb

MAX_OPS = 256
MAX_IN_FLIGHT = 2


class _Pending:
    __slots__ = ("done", "error", "op", "result")

    def __init__(self, op: pb.StoreOp) -> None:
        self.op = op
        self.done = False
        self.result: pb.StoreOpResult | None = None
        self.error: BaseException | None = None


class StoreBatcher:
    def __init__(self, store: Any, timeout_s: float) -> None:
        self.store = store  # a FailoverStub (or Stub) of the Global Store
        self.timeout_s = timeout_s
        self._queue: list[_Pending] = []
        self._changed = threading.Condition()  # guards the queue and the in-flight count
        self._in_flight = 0
        self.requests = 0  # Batch requests sent
        self.ops = 0  # operations they carried

    def call(self, op: pb.StoreOp, timeout_s: float | None = None) -> pb.StoreOpResult:
        """Run `op` (alone or with others); returns its result, raises its error."""
        timeout_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout_s
        pending = _Pending(op)
        with self._changed:
            self._queue.append(pending)
            while not pending.done:
                if pending in self._queue and self._in_flight < MAX_IN_FLIGHT:
                    self._send(timeout_s)  # carries `pending` and whatever else is queued
                    continue
                left = deadline - time.monotonic()
                if left <= 0 and pending in self._queue:  # never sent: nothing happened
                    self._queue.remove(pending)
                    raise DeadlineExceeded(
                        f"the Global Store did not take this request within {timeout_s:.0f}s"
                    )
                # In flight: its answer comes within that request's own timeout.
                self._changed.wait(left if left > 0 else None)
        if pending.error is not None:
            raise pending.error
        assert pending.result is not None
        if pending.result.error_kind:
            raise error_named(pending.result.error_kind, pending.result.error)
        return pending.result

    def _send(self, timeout_s: float) -> None:
        """Send the queue's head as one request; called and returning with `_changed` held
        (released while the request is in flight)."""
        batch = self._queue[:MAX_OPS]
        del self._queue[:MAX_OPS]
        self._in_flight += 1
        self._changed.release()
        try:
            size = sum(_size(p.op) for p in batch)
            reply = self.store.call(
                "Batch",
                pb.BatchRequest(ops=[p.op for p in batch]),
                timeout_s=max(timeout_s, 0.01 * size),
            )
            for p, result in zip(batch, reply.results):
                p.result = result
        except TensorcastError as e:
            for p in batch:
                p.error = e
        except BaseException as e:  # never leave a caller waiting
            for p in batch:
                p.error = e
            raise
        finally:
            self._changed.acquire()
            self._in_flight -= 1
            self.requests += 1
            self.ops += len(batch)
            for p in batch:
                p.done = True
            self._changed.notify_all()


def _size(op: pb.StoreOp) -> int:
    kind = op.WhichOneof("op")
    if kind == "put":
        return len(op.put.artifacts)
    if kind == "delete":
        return len(op.delete.art_ids)
    return 1

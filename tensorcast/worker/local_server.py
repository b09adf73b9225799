"""Same-host callers talk to the worker over a Unix socket that hands them the pool's memfd.

The connection is the lease: holds (mapped contents) and reservations (regions being written)
belong to it and are released when it closes, so a crashed caller leaks nothing.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import asdict
from typing import Any

from tensorcast.config import token_accepted
from tensorcast.errors import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TensorcastError,
    Unauthenticated,
    public_name,
)
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.rpc.convert import artifact_from_pb
from tensorcast.transport.unix import recv_message, send_message, socket_address
from tensorcast.types import TensorMeta
from tensorcast.worker.gpu_tier import GpuTier, TierEntry
from tensorcast.worker.node import WorkerNode
from tensorcast.worker.pool import Content

log = logging.getLogger("tensorcast.worker.local")

MAX_CONNECTIONS = 256
# Before the token is checked a connection gets this long and this many bytes for its hello:
# the socket is abstract (any process of the host's network namespace can connect), and an
# unauthenticated peer must not hold slots or buffers (up to 64 MiB per message) for ever.
HELLO_TIMEOUT_S = 10.0
HELLO_MAX_BYTES = 4096


class LocalServer:
    def __init__(self, node: WorkerNode, gpu: GpuTier | None = None) -> None:
        self.node = node
        self.gpu = gpu
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(socket_address(node.local_socket))
        self.sock.listen(64)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = False

    def serve_forever(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                log.warning("refusing a local connection: %d open", MAX_CONNECTIONS)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="local-server", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self._closed = True
        self.sock.close()

    def _serve(self, conn: socket.socket) -> None:
        session = _Session(self.node, self.gpu)
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            message, _ = recv_message(conn, HELLO_MAX_BYTES)
            if message.get("op") != "hello" or not token_accepted(
                self.node.token, str(message.get("token", ""))
            ):
                send_message(conn, _error(Unauthenticated("missing or wrong cluster token")))
                return
            conn.settimeout(None)  # authenticated: a caller may stay idle between requests
            send_message(
                conn,
                {
                    "ok": True,
                    "worker_id": self.node.worker_id,
                    "arena_bytes": self.node.pool.capacity_bytes,
                    "directory_bytes": self.node.pages.directory.size_bytes,
                },
                fds=(self.node.pool.fd, self.node.pages.directory.fd),
            )
            while True:
                message, _ = recv_message(conn)
                try:
                    reply = session.handle(message)
                except TensorcastError as e:
                    reply = _error(e)
                except (KeyError, TypeError, ValueError) as e:
                    reply = _error(InvalidArgument(f"malformed local request: {e!r}"))
                except Exception as e:
                    # This request fails; the session goes on. Ending it would release its
                    # holds while the caller's tensors still map them (the regions could
                    # then be reused under them).
                    log.exception("local request %r failed", message.get("op"))
                    reply = _error(TensorcastError(f"{type(e).__name__}: {e}"))
                try:
                    send_message(conn, reply)
                except ValueError as e:  # over the message limit: nothing was sent
                    send_message(conn, _error(ResourceExhausted(f"reply too large: {e}")))
        except (ConnectionError, OSError, ValueError):
            pass
        finally:
            session.close()
            conn.close()
            self._slots.release()


def _error(e: TensorcastError) -> dict[str, Any]:
    return {"ok": False, "error": public_name(e), "message": str(e)}


class _Session:
    def __init__(self, node: WorkerNode, gpu: GpuTier | None = None) -> None:
        self.node = node
        self.gpu = gpu
        self.holds: dict[int, Content] = {}
        self.gpu_holds: dict[int, TierEntry] = {}  # same hold ids as `holds`
        self.reservations: set[int] = set()
        self._next_hold = 1

    def handle(self, m: dict[str, Any]) -> dict[str, Any]:
        op = m.get("op")
        pool = self.node.pool
        if op == "open":
            content = self.node.load_and_hold(str(m["content_id"]))
            hold_id = self._next_hold
            self._next_hold += 1
            self.holds[hold_id] = content
            return {
                "ok": True,
                "hold_id": hold_id,
                "offset": content.offset,
                "size_bytes": content.size_bytes,
                "tensors": [t.to_json() for t in content.tensors],
            }
        if op == "release":
            hold_id = int(m["hold_id"])
            if hold_id in self.holds:
                pool.release(self.holds.pop(hold_id))
            elif hold_id in self.gpu_holds and self.gpu is not None:
                self.gpu.release(self.gpu_holds.pop(hold_id))
            return {"ok": True}
        if isinstance(op, str) and op.startswith("gpu_"):
            return self._gpu(op, m)
        if op == "reserve":
            res = self.node.reserve(int(m["size_bytes"]))
            self.reservations.add(res.reservation_id)
            return {"ok": True, "reservation_id": res.reservation_id, "offset": res.offset}
        if op == "commit":
            reservation_id = int(m["reservation_id"])
            if reservation_id not in self.reservations:
                raise InvalidArgument(f"reservation {reservation_id} is not this connection's")
            self.reservations.discard(reservation_id)
            tensors = [TensorMeta.from_json(t) for t in m["tensors"]]
            committed = self.node.commit(reservation_id, tensors, bool(m.get("verify")))
            return {
                "ok": True,
                "content_id": committed.content_id,
                "size_bytes": committed.size_bytes,
                "tensors": [t.to_json() for t in committed.tensors],
                "deduplicated": committed.deduplicated,
            }
        if op == "reserve_many":
            offsets = []
            try:
                for size in m["sizes"]:
                    res = self.node.reserve(int(size))
                    self.reservations.add(res.reservation_id)
                    offsets.append([res.reservation_id, res.offset])
            except BaseException:
                for reservation_id, _ in offsets:
                    self.reservations.discard(reservation_id)
                    pool.abort(reservation_id)
                raise
            return {"ok": True, "reservations": offsets}
        if op == "put":  # write (inline bytes or reservations) and name, one store request
            items = list(m["items"])
            for item in items:
                if "reservation_id" in item:
                    reservation_id = int(item["reservation_id"])
                    if reservation_id not in self.reservations:
                        raise InvalidArgument(
                            f"reservation {reservation_id} is not this connection's"
                        )
            for item in items:  # the node commits or aborts each of them from here on
                self.reservations.discard(int(item.get("reservation_id", -1)))
            infos, existed = self.node.put_batch(items, m.get("blob"), bool(m.get("brief")))
            return {"ok": True, "artifacts": [a.to_wire() for a in infos], "existed": existed}
        if op == "info":  # a lookup, coalesced with other callers' requests
            result = self.node.batcher.call(
                pb.StoreOp(get=pb.ArtifactRequest(art_id=str(m["art_id"])))
            )
            return {"ok": True, "artifact": artifact_from_pb(result.get).to_wire()}
        if op == "delete":
            result = self.node.batcher.call(
                pb.StoreOp(
                    delete=pb.DeleteArtifactsRequest(
                        art_ids=[str(a) for a in m["art_ids"]],
                        missing_ok=bool(m.get("missing_ok")),
                    )
                )
            )
            return {"ok": True, "deleted": result.delete.deleted}
        if op == "put_reference":
            committed = self.node.register_reference(str(m["path"]))
            return {"ok": True, "content_id": committed.content_id}
        if op == "abort":
            reservation_id = int(m["reservation_id"])
            if reservation_id in self.reservations:
                self.reservations.discard(reservation_id)
                pool.abort(reservation_id)
            return {"ok": True}
        raise InvalidArgument(f"unknown local operation {op!r}")

    def _gpu(self, op: str, m: dict[str, Any]) -> dict[str, Any]:
        """The GPU tier (worker/gpu_tier.py): map it, hold contents in it, warm it."""
        if self.gpu is None:
            raise NotFound(
                f"worker {self.node.name} has no GPU tier (start it with --gpu-mem SIZE)"
            )
        if op == "gpu_hello":
            return {"ok": True, **self.gpu.hello()}
        if op == "gpu_open":
            entry = self.gpu.open(str(m["content_id"]), load=bool(m.get("load", True)))
            hold_id = self._next_hold
            self._next_hold += 1
            self.gpu_holds[hold_id] = entry
            return {
                "ok": True,
                "hold_id": hold_id,
                "offset": entry.offset,
                "size_bytes": entry.size_bytes,
                "tensors": [t.to_json() for t in entry.tensors],
            }
        if op == "gpu_load":
            started = time.monotonic()
            present = str(m["content_id"]) in self.gpu.index.content_ids()
            entry = self.gpu.open(str(m["content_id"]))
            self.gpu.release(entry)
            return {
                "ok": True,
                "already_present": present,
                "bytes_moved": 0 if present else entry.size_bytes,
                "elapsed_s": time.monotonic() - started,
            }
        if op == "gpu_copy":  # into the caller's buffer, by DMA from the page-locked pool
            content, seconds = self.gpu.copy_into(str(m["content_id"]), dict(m["target"]))
            return {
                "ok": True,
                "size_bytes": content.size_bytes,
                "tensors": [t.to_json() for t in content.tensors],
                "seconds": seconds,
            }
        if op == "gpu_stats":
            return {"ok": True, **asdict(self.gpu.stats())}
        raise InvalidArgument(f"unknown local operation {op!r}")

    def close(self) -> None:
        for content in self.holds.values():
            self.node.pool.release(content)
        if self.gpu is not None:
            for entry in self.gpu_holds.values():
                self.gpu.release(entry)
        self.gpu_holds.clear()
        for reservation_id in self.reservations:
            self.node.pool.abort(reservation_id)
        self.holds.clear()
        self.reservations.clear()

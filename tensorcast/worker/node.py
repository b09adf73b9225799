"""The worker's state and its conversation with the Global Store: registration, heartbeats,
committing contents (cluster-wide dedupe, then replica registration) and dropping them."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

from tensorcast.config import host_id
from tensorcast.errors import NotFound, TensorcastError
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.proto import tensorcast_pb2_grpc as pb_grpc
from tensorcast.rpc.client import Stub, make_channel
from tensorcast.rpc.convert import tensor_to_pb, tensors_from_pb
from tensorcast.types import Committed, TensorMeta
from tensorcast.worker.pool import Pool

log = logging.getLogger("tensorcast.worker")

ROLES = ("basic", "gateway", "shard-home")


class WorkerNode:
    def __init__(
        self,
        pool: Pool,
        store_addr: str,
        token: str,
        name: str,
        roles: tuple[str, ...],
        rpc_timeout_s: float,
    ) -> None:
        self.pool = pool
        self.worker_id = uuid.uuid4().hex[:12]
        self.name = name or f"worker-{self.worker_id[:6]}"
        self.roles = roles
        self.host_id = host_id()
        self.token = token
        self.addr = ""
        self.store_addr = store_addr
        self._channel = make_channel(store_addr)
        self.store = Stub(
            pb_grpc.GlobalStoreStub(self._channel),
            f"global store {store_addr}",
            token,
            rpc_timeout_s,
        )
        self._stop = threading.Event()

    @property
    def local_socket(self) -> str:
        return f"worker-{self.worker_id}"

    def register(self) -> float:
        stats = self.pool.stats()
        reply = self.store.call(
            "RegisterWorker",
            pb.RegisterWorkerRequest(
                worker=pb.Worker(
                    worker_id=self.worker_id,
                    name=self.name,
                    addr=self.addr,
                    host_id=self.host_id,
                    local_socket=self.local_socket,
                    roles=list(self.roles),
                    mem_cap_bytes=stats.capacity_bytes,
                    pid=os.getpid(),
                )
            ),
        )
        return reply.heartbeat_ttl_s

    def commit(
        self, reservation_id: int, tensors: list[TensorMeta], verify_hashes: bool = False
    ) -> Committed:
        """Turn a written reservation into content known to the Global Store.

        If another live worker already holds identical content, ours is dropped: identical
        content is stored once in the cluster.
        """
        result = self.pool.commit(reservation_id, tensors, verify_hashes)
        content = result.content
        if not result.deduplicated:
            found = self.store.call(
                "FindContent", pb.FindContentRequest(content_id=content.content_id)
            )
            if found.exists and any(r.worker_id != self.worker_id for r in found.replicas):
                self.pool.drop(content.content_id)
                return Committed(
                    content.content_id,
                    content.size_bytes,
                    tensors_from_pb(found.tensors),
                    True,
                )
            try:
                self.store.call(
                    "AddReplica",
                    pb.AddReplicaRequest(
                        worker_id=self.worker_id,
                        content_id=content.content_id,
                        size_bytes=content.size_bytes,
                        tensors=[tensor_to_pb(t) for t in content.tensors],
                    ),
                )
            except TensorcastError:
                self.pool.drop(content.content_id)
                raise
            self.pool.mark_registered(content.content_id)
        return Committed(
            content.content_id, content.size_bytes, content.tensors, result.deduplicated
        )

    def heartbeat_once(self) -> None:
        stats = self.pool.stats()
        sent_at = time.time()
        request = pb.HeartbeatRequest(
            worker_id=self.worker_id,
            mem_used_bytes=stats.used_bytes,
            content_ids=stats.content_ids,
        )
        try:
            reply = self.store.call("Heartbeat", request)
        except NotFound:
            log.warning("global store does not know this worker; registering again")
            self.register()
            reply = self.store.call("Heartbeat", request)
        for content_id in reply.drop_content_ids:
            if self.pool.drop(content_id, unless_committed_after=sent_at):
                log.info("dropped content %s (no artifact references it)", content_id)

    def heartbeat_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.heartbeat_once()
            except TensorcastError as e:
                log.warning("heartbeat failed: %s", e)

    def start_heartbeats(self, interval_s: float) -> threading.Thread:
        thread = threading.Thread(
            target=self.heartbeat_loop, args=(interval_s,), name="heartbeat", daemon=True
        )
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
        try:
            self.store.call(
                "DeregisterWorker", pb.DeregisterWorkerRequest(worker_id=self.worker_id), 2.0
            )
        except TensorcastError as e:
            log.warning("deregistration failed: %s", e)
        self._channel.close()

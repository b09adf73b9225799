"""The TensorCast side of an engine instance: opens the attach stream to its local worker,
reports load, and runs the instance operations the worker pushes (publish, manifest, hydrate,
evict, transform_into) against the engine's `InstanceAdaptor`.

A request's KV cache is published as pages `kv/{req_id}/{page}` plus a manifest page
`kv/{req_id}/manifest` (JSON: the adaptor's meta and every page's reference), all caller-leased
with a TTL. Hydrate reads the manifest, takes pages from the local worker's cache first (a
prefetch put them there) and the rest from their shard homes, checks every hash, and imports
(reading straight into the engine's block buffers when it lends them: `import_buffers`).

Publish and hydrate also work in parts (`part` of `parts`, each with its own manifest
`kv/{req_id}/manifest-{part}-of-{parts}`): a migration that streams moves part 0 across while
the source exports part 1. Engines that cannot cut their export send it all as part 0
(`InstanceAdaptor.export_kv_part`).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tensorcast import errors
from tensorcast.adaptors import KVExport, check_part
from tensorcast.buffer_pool import BufferPool
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.sdk.pages import PageRef
from tensorcast.worker.instances import ATTACHED_OP

if TYPE_CHECKING:
    from tensorcast.adaptors import InstanceAdaptor
    from tensorcast.sdk.runtime import Runtime
    from tensorcast.types import WorkerInfo

log = logging.getLogger("tensorcast.instance")

MAX_OPS_IN_FLIGHT = 4
MAX_OPS_QUEUED = 64  # received, waiting for one of the MAX_OPS_IN_FLIGHT threads
MAX_OUTGOING = 256
RECONNECT_MAX_S = 2.0
RECEIVE_BUFFERS_KEPT_BYTES = 256 << 20  # idle page buffers kept for the next hydrate


def manifest_key(req_id: str, part: int = 0, parts: int = 1) -> str:
    """A whole publish's manifest, or one part's (a migration that streams publishes parts)."""
    if parts == 1:
        return f"kv/{req_id}/manifest"
    return f"kv/{req_id}/manifest-{part}-of-{parts}"


class InstanceRuntime:
    def __init__(
        self,
        rt: Runtime,
        adaptor: InstanceAdaptor,
        worker: WorkerInfo,
        instance_id: str,
        *,
        endpoint: str = "",
        load_interval_s: float = 0.5,
    ) -> None:
        self.rt = rt
        self.adaptor = adaptor
        self.worker = worker
        self.instance_id = instance_id
        self.endpoint = endpoint
        self.load_interval_s = load_interval_s
        self.published: dict[str, dict] = {}
        self._received = BufferPool(RECEIVE_BUFFERS_KEPT_BYTES)  # hydrate reads pages into these
        self._closed = threading.Event()
        self._attached = threading.Event()
        self._ops = ThreadPoolExecutor(MAX_OPS_IN_FLIGHT, thread_name_prefix="instance-op")
        self._queued = 0  # submitted to _ops, not started yet
        self._queued_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="attach", daemon=True)

    def start(self, timeout_s: float = 10.0) -> InstanceRuntime:
        self._thread.start()
        if not self._attached.wait(timeout_s):
            raise errors.Unavailable(f"could not attach to worker {self.worker.name}")
        return self

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self._ops.shutdown(wait=False, cancel_futures=True)

    # -- the attach stream ---------------------------------------------------------------------

    def _hello(self) -> pb.InstanceMessage:
        load = self.adaptor.load()
        return pb.InstanceMessage(
            hello=pb.Instance(
                instance_id=self.instance_id,
                engine=self.adaptor.engine,
                endpoint=self.endpoint,
                waiting=load.waiting,
                running=load.running,
                cached_tokens=load.cached_tokens,
                requests=list(load.requests),
            )
        )

    def _run(self) -> None:
        backoff = 0.1
        while not self._closed.is_set():
            outgoing: queue.Queue[pb.InstanceMessage | None] = queue.Queue(MAX_OUTGOING)
            try:
                self._serve(outgoing)
                backoff = 0.1
            except errors.TensorcastError as e:
                log.warning("attach stream to %s broke: %s", self.worker.name, e)
                self._find_worker()
            finally:
                outgoing.put(None)
            self._attached.clear()
            if self._closed.wait(backoff):
                return
            backoff = min(RECONNECT_MAX_S, backoff * 2)

    def _find_worker(self) -> None:
        """The worker's current address: restarted under its name (`tc up`), it listens on
        another port, and maybe under another id."""
        try:
            found = self.rt.resolve_worker(self.worker.name)
        except errors.TensorcastError as e:
            log.info("worker %s not found again yet: %s", self.worker.name, e)
            return
        if found.addr != self.worker.addr:
            log.info("worker %s is now at %s", found.name, found.addr)
        self.worker = found

    def _serve(self, outgoing: queue.Queue) -> None:
        def messages():
            yield self._hello()
            next_report = time.monotonic() + self.load_interval_s
            while not self._closed.is_set():
                try:
                    item = outgoing.get(timeout=max(0.0, next_report - time.monotonic()))
                except queue.Empty:
                    yield self._hello()  # a load report
                    next_report = time.monotonic() + self.load_interval_s
                    continue
                if item is None:
                    return
                yield item

        stub = self.rt.worker_stub(self.worker)
        # The stream lives as long as the instance: no deadline on it, only on each operation.
        commands = stub.stream("Attach", messages(), timeout_s=365 * 24 * 3600.0)
        for command in commands:
            if command.op == ATTACHED_OP:
                self._attached.set()
                log.info("instance %s attached to worker %s", self.instance_id, self.worker.name)
                continue
            # The worker gives up on a command after its timeout: one that has waited here
            # that long is not run at all (its plan failed, and a retry would run it again).
            expires = time.monotonic() + command.timeout_ms / 1000
            with self._queued_lock:
                full = self._queued >= MAX_OPS_QUEUED
                self._queued += 0 if full else 1
            if full:
                self._reply_error(
                    command,
                    outgoing,
                    errors.ResourceExhausted(
                        f"instance {self.instance_id} has {MAX_OPS_QUEUED} operations waiting"
                    ),
                )
            else:
                self._ops.submit(self._handle, command, outgoing, expires)
            if self._closed.is_set():
                return

    def _reply_error(
        self, command: pb.InstanceCommand, outgoing: queue.Queue, error: errors.TensorcastError
    ) -> None:
        reply = pb.InstanceMessage(
            call_id=command.call_id,
            error_kind=errors.public_name(error),
            error_message=str(error),
        )
        try:
            outgoing.put(reply, timeout=5.0)
        except queue.Full:
            log.warning("dropping the reply to %s: the stream is stuck", command.op)

    def _handle(self, command: pb.InstanceCommand, outgoing: queue.Queue, expires: float) -> None:
        with self._queued_lock:
            self._queued -= 1
        if command.timeout_ms and time.monotonic() >= expires:
            log.info(
                "trace=%s op=%s not run: it waited past its deadline", command.trace_id, command.op
            )
            self._reply_error(
                command,
                outgoing,
                errors.DeadlineExceeded(
                    f"{command.op} waited past its deadline on instance {self.instance_id}: not run"
                ),
            )
            return
        reply = pb.InstanceMessage(call_id=command.call_id)
        started = time.monotonic()
        try:
            args = json.loads(command.args_json or "{}")
            handler = getattr(self, f"op_{command.op}", None)
            if handler is None:
                raise errors.InvalidArgument(f"instance operation {command.op!r} is unknown")
            result = handler(**args)
            reply.result_json = json.dumps(result)
        except errors.TensorcastError as e:
            reply.error_kind, reply.error_message = type(e).__name__, str(e)
        except TypeError as e:
            reply.error_kind, reply.error_message = "InvalidArgument", f"bad arguments: {e}"
        except Exception as e:  # the engine failed: report it, keep serving
            log.exception("instance operation %s failed", command.op)
            reply.error_kind, reply.error_message = "TensorcastError", f"{type(e).__name__}: {e}"
        log.info(
            "trace=%s op=%s %s in %.3f s",
            command.trace_id,
            command.op,
            reply.error_kind or "ok",
            time.monotonic() - started,
        )
        try:
            outgoing.put(reply, timeout=5.0)
        except queue.Full:
            log.warning("dropping the reply to %s: the stream is stuck", command.op)

    # -- instance operations -------------------------------------------------------------------

    def op_publish(self, req_id: str, ttl_s: float = 600.0, part: int = 0, parts: int = 1) -> dict:
        check_part(part, parts)
        export = self.adaptor.export_kv_part(req_id, part, parts)
        exported = export.pages if export is not None else {}
        names = list(exported)
        pages = self.rt.pages()
        try:
            refs = pages.put_pages({f"kv/{req_id}/{n}": exported[n] for n in names}, ttl_s)
        finally:
            if export is not None and export.release is not None:
                export.release()
        listed = [dict(r.to_json(), name=n) for n, r in zip(names, refs)]
        manifest = {
            "req_id": req_id,
            "instance_id": self.instance_id,
            "meta": export.meta if export is not None else None,
            "pages": listed,
        }
        (mref,) = pages.put_pages(
            {manifest_key(req_id, part, parts): json.dumps(manifest).encode()}, ttl_s
        )
        result = {
            "req_id": req_id,
            "pages": [mref.to_json(), *listed],
            "bytes": sum(r.size_bytes for r in refs) + mref.size_bytes,
        }
        if parts == 1:
            self.published[req_id] = result
        return result

    def op_manifest(self, req_id: str) -> dict:
        if req_id in self.published:
            return self.published[req_id]
        manifest, mref = self._read_manifest(req_id, None, manifest_key(req_id))
        return {"req_id": req_id, "pages": [mref.to_json(), *manifest["pages"]], "bytes": 0}

    def _read_manifest(
        self, req_id: str, artifacts: list[dict] | None, key: str
    ) -> tuple[dict, PageRef]:
        wanted: str | PageRef = key
        for item in artifacts or []:
            if isinstance(item, dict) and item.get("key") == key:
                wanted = PageRef.from_json(item)
        (page,) = self.rt.pages().get_pages([wanted], cache=self.worker)
        if page is None:
            raise errors.NotFound(
                f"no published KV cache for request {req_id!r} (expired, or its shard home "
                "died): publish it again or recompute"
            )
        manifest = json.loads(bytes(page.data))
        return manifest, self.rt.pages().ref_of(page)

    def op_hydrate(
        self, req_id: str, artifacts: list[dict] | None = None, part: int = 0, parts: int = 1
    ) -> dict:
        check_part(part, parts)
        manifest, _ = self._read_manifest(req_id, artifacts, manifest_key(req_id, part, parts))
        refs = [PageRef.from_json(p) for p in manifest["pages"]]
        meta = manifest.get("meta")
        lent = self._engine_buffers(req_id, part, parts, meta, manifest["pages"], refs)
        buffers = [] if lent is not None else self._received.take([r.size_bytes for r in refs])
        into = (
            [lent.pages[spec["name"]] for spec in manifest["pages"]]
            if lent is not None
            else buffers
        )
        try:
            found = self.rt.pages().get_pages(refs, cache=self.worker, into=into)
            missing = [r.key for r, p in zip(refs, found) if p is None]
            if missing:
                raise errors.NotFound(
                    f"{len(missing)} KV pages of {req_id!r} are gone (first: {missing[0]}): "
                    "their lease expired or their shard home died; publish again or recompute"
                )
            tensors = {}
            for spec, page in zip(manifest["pages"], found):
                assert page is not None
                if page.dtype != spec["dtype"] or list(page.shape) != list(spec["shape"]):
                    raise errors.IntegrityError(f"page {spec['key']} does not match its manifest")
                tensors[spec["name"]] = page.tensor()
            export = KVExport(tensors, meta) if meta is not None else None
            resident = self.adaptor.import_kv_part(req_id, part, parts, export)
        finally:
            if lent is None:
                self._received.give(buffers)  # the adaptor copied what it keeps
            elif lent.release is not None:
                lent.release()  # takes back the engine's buffers the import did not keep
        return {
            "req_id": req_id,
            "pages": len(refs),
            "bytes": sum(r.size_bytes for r in refs),
            "resident": resident,
        }

    def _engine_buffers(
        self, req_id: str, part: int, parts: int, meta: dict | None, specs: list, refs: list
    ) -> KVExport | None:
        """The engine's own memory to read the pages into, when it lends some that fit
        (hydrate then skips a copy); None to read into the runtime's buffers."""
        if meta is None:
            return None
        lent = self.adaptor.import_buffers(req_id, part, parts, meta)
        if lent is None:
            return None
        fits = [
            spec["name"] in lent.pages and lent.pages[spec["name"]].nbytes == ref.size_bytes
            for spec, ref in zip(specs, refs)
        ]
        if len(lent.pages) == len(specs) and all(fits):
            return lent
        if lent.release is not None:
            lent.release()
        return None

    def op_evict(self, req_id: str) -> dict:
        self.published.pop(req_id, None)
        return {"req_id": req_id, "evicted": self.adaptor.evict(req_id), "bytes": 0}

    def op_transform_into(self, artifact: str, spec: dict | None = None) -> dict:
        art = self.rt.artifact(artifact)
        filled = art.transform_into(self.adaptor.buffers(), spec or None, strict=False)
        return {"artifact": artifact, "filled": len(filled), "bytes": art.size_bytes}

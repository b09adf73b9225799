"""gRPC face of a worker: status, views, and chunked reads/writes for callers on other hosts."""

from __future__ import annotations

import json

from tensorcast import plan as planlib
from tensorcast.errors import IntegrityError, InvalidArgument, Unavailable
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.proto import tensorcast_pb2_grpc as pb_grpc
from tensorcast.rpc.convert import shard_table_to_pb, tensor_to_pb, tensors_from_pb
from tensorcast.transport import native
from tensorcast.types import Committed, TensorMeta
from tensorcast.worker.node import WorkerNode
from tensorcast.worker.page_service import PageService
from tensorcast.worker.plans import PlanExecutor, StepRunner
from tensorcast.worker.transfers import Transfers


def _region_size(tensors: list[TensorMeta]) -> int:
    return max((t.offset_bytes + t.size_bytes for t in tensors), default=0)


def _commit_reply(c: Committed) -> pb.CommitReply:
    return pb.CommitReply(
        content_id=c.content_id,
        size_bytes=c.size_bytes,
        tensors=[tensor_to_pb(t) for t in c.tensors],
        deduplicated=c.deduplicated,
    )


class WorkerService(pb_grpc.WorkerServiceServicer):
    def __init__(self, node: WorkerNode, transfers: Transfers) -> None:
        self.node = node
        self.transfers = transfers
        self.pages = PageService(node)
        self.steps = StepRunner(node, transfers, self.pages)
        self.plans = PlanExecutor(node, self.steps)

    def Status(self, request, context):
        stats = self.node.pool.stats()
        page_stats = self.node.pages.stats()
        return pb.WorkerStatus(
            worker=pb.Worker(
                worker_id=self.node.worker_id,
                name=self.node.name,
                addr=self.node.addr,
                host_id=self.node.host_id,
                local_socket=self.node.local_socket,
                roles=list(self.node.roles),
                mem_cap_bytes=stats.capacity_bytes,
                mem_used_bytes=stats.used_bytes,
                alive=True,
            ),
            num_contents=stats.num_contents,
            num_holds=stats.num_holds,
            store_addr=self.node.store_addr,
            pages=page_stats["pages"],
            page_bytes=page_stats["bytes"],
            page_region_bytes=page_stats["region_bytes"],
            page_uncommitted_bytes=page_stats["uncommitted_bytes"],
        )

    def View(self, request, context):
        # torch loads on the first view, not at worker start (it costs ~1.5 s to import).
        from tensorcast.worker.slicing import DimSlice, copy_slices, plan_view

        slices = {
            s.tensor: [DimSlice(a, b, c) for a, b, c in zip(s.start, s.stop, s.step)]
            for s in request.slices
        }
        if len(slices) != len(request.slices):
            raise InvalidArgument("a tensor is sliced twice in one view")
        node, pool = self.node, self.node.pool
        ref = node.references.get(request.content_id)
        if ref is not None and not ref.hashes and not pool.contains(request.content_id):
            # Registered by reference and never read: read only the view's bytes. (Once the
            # hashes are known, views come from a verified pool copy.)
            targets = plan_view(ref.layout.tensors, slices)
            res = node.reserve(_region_size(targets))
            try:
                node.references.copy_view(
                    ref, slices, pool.region(res.offset, res.size_bytes), targets
                )
            except BaseException:
                pool.abort(res.reservation_id)
                raise
            return _commit_reply(node.commit(res.reservation_id, targets))
        source = node.load_and_hold(request.content_id)
        try:
            targets = plan_view(source.tensors, slices)
            res = node.reserve(_region_size(targets))
            try:
                copy_slices(
                    pool.region(source.offset, source.size_bytes),
                    source.tensors,
                    pool.region(res.offset, res.size_bytes),
                    targets,
                    slices,
                )
            except BaseException:
                pool.abort(res.reservation_id)
                raise
            return _commit_reply(node.commit(res.reservation_id, targets))
        finally:
            pool.release(source)

    def WriteChunks(self, request_iterator, context):
        pool = self.node.pool
        first = next(request_iterator, None)
        if first is None:
            raise InvalidArgument("a write starts with the layout message")
        res = self.node.reserve(first.size_bytes)
        try:
            region = pool.region(res.offset, res.size_bytes)
            written = 0
            for message in request_iterator:
                chunk = message.chunk
                end = chunk.offset_bytes + len(chunk.data)
                if end > res.size_bytes:
                    raise InvalidArgument(f"chunk [{chunk.offset_bytes}, {end}) beyond the region")
                if native.hash_buffer(chunk.data) != chunk.hash:
                    raise IntegrityError(f"chunk at {chunk.offset_bytes} failed its checksum")
                region[chunk.offset_bytes : end] = chunk.data
                written += len(chunk.data)
            if written != first.size_bytes:
                raise InvalidArgument(
                    f"write ended after {written} of {first.size_bytes} bytes; nothing stored"
                )
        except BaseException:
            pool.abort(res.reservation_id)
            raise
        tensors = list(tensors_from_pb(first.tensors))
        verify = all(t.hash_hex for t in tensors)
        return _commit_reply(self.node.commit(res.reservation_id, tensors, verify))

    def OpenTransfer(self, request, context):
        opened = self.transfers.open(request.content_id, request.ttl_ms, request.relay)
        return pb.TransferTicket(
            ticket=opened.ticket,
            offset_bytes=opened.offset,
            size_bytes=opened.size_bytes,
            data_addr=self.node.data_addr,
            tensors=[tensor_to_pb(t) for t in opened.tensors],
        )

    def CloseTransfer(self, request, context):
        self.transfers.close(request.ticket)
        return pb.Empty()

    def Prefetch(self, request, context):
        timeout_s = (request.timeout_ms or 60_000) / 1000
        result = self.transfers.prefetch(
            request.content_id,
            timeout_s,
            request.streams,
            request.relay_from,
            request.chain,
        )
        return pb.PrefetchReply(
            already_present=result.already_present,
            bytes_moved=result.bytes_moved,
            source_worker_id=result.source_worker_id,
            elapsed_s=result.elapsed_s,
            retries=result.retries,
        )

    def Pin(self, request, context):
        self.node.pool.set_pinned(request.content_id, request.pinned)
        self.node.heartbeat_once()  # the store lists the pin now, not a heartbeat later
        return pb.Empty()

    # -- plans ---------------------------------------------------------------------------------

    def RunPlan(self, request, context):
        if "gateway" not in self.node.roles:
            raise InvalidArgument(
                f"worker {self.node.name} is not a gateway: submit plans to a gateway worker"
            )
        plan = _json_object(request.plan_json, "plan")
        return pb.PlanReply(result_json=json.dumps(self.plans.run(plan)))

    def RunStep(self, request, context):
        step = _json_object(request.step_json, "step")
        planlib.validate(
            {"deadline_ms": max(1, request.timeout_ms), "steps": [dict(step, id=0, after=[])]}
        )
        result = self.steps.run(step, request.timeout_ms / 1000, request.trace_id)
        return pb.StepReply(result_json=json.dumps(result))

    def Attach(self, request_iterator, context):
        yield from self.node.instances.attach(request_iterator, context.is_active)

    # -- KV pages ------------------------------------------------------------------------------

    def PutPages(self, request, context):
        self.pages.put(list(request.pages), request.ttl_s, request.if_absent)
        return pb.Empty()

    def GetPages(self, request, context):
        keys = [(k.key, k.shard, k.token) for k in request.keys]
        pages = self.pages.get(keys)
        return pb.PagesReply(pages=pages, served=len(pages))

    def ExistsPages(self, request, context):
        keys = [(k.key, k.shard, k.token) for k in request.keys]
        return pb.ExistsReply(exists=[p is not None for p in self.pages.lookup(keys)])

    def Shards(self, request, context):
        table = self.node.leases.table
        if table is None:
            raise Unavailable(f"worker {self.node.name} has no shard lease table yet")
        return shard_table_to_pb(table)


def _json_object(text: str, what: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(f"the {what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"the {what} must be a JSON object")
    return value

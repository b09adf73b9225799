"""gRPC face of the Global Store: decode, call the `MetadataStore`, encode. Nothing else."""

from __future__ import annotations

import re
import threading
import time

from tensorcast import __version__
from tensorcast.errors import InvalidArgument, TensorcastError, public_name
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.proto import tensorcast_pb2_grpc as pb_grpc
from tensorcast.rpc.convert import (
    artifact_to_pb,
    instance_from_pb,
    instance_to_pb,
    plan_from_pb,
    plan_to_pb,
    replica_to_pb,
    shard_table_to_pb,
    tensor_to_pb,
    tensors_from_pb,
    worker_to_pb,
)
from tensorcast.store.base import (
    Coordination,
    DeleteOp,
    GetOp,
    Inventory,
    MetadataStore,
    NewArtifact,
    NewReplica,
    PutOp,
    PutResult,
    StoreOp,
    WorkerRegistration,
)


class GlobalStoreService(pb_grpc.GlobalStoreServicer):
    def __init__(
        self,
        store: MetadataStore,
        coord: Coordination,
        db_path: str,
        heartbeat_ttl_s: float,
    ) -> None:
        self.store = store
        self.coord = coord
        self.db_path = db_path
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.started_at = time.time()
        # Workers count as dead (missed heartbeats) from then on: a TTL after this store, or
        # its backend after an outage, came back (the sweeper moves it).
        self.judged_from = self.started_at + heartbeat_ttl_s
        self.frame_port = 0  # set by the server once its frame port listens
        # Heartbeats by what their inventory was: "full", "delta" or "resync" (a delta refused).
        self.heartbeats = {"full": 0, "delta": 0, "resync": 0}
        self._heartbeats_lock = threading.Lock()

    def Status(self, request, context):
        num_artifacts, num_contents = self.store.counts()
        return pb.StoreStatus(
            version=__version__,
            schema_version=getattr(self.store, "schema_version", 0),
            uptime_s=time.time() - self.started_at,
            db_path=self.db_path,
            heartbeat_ttl_s=self.heartbeat_ttl_s,
            num_artifacts=num_artifacts,
            num_contents=num_contents,
            backend_members=[
                pb.BackendMember(addr=a, healthy=h, detail=d) for a, h, d in self.store.members()
            ],
            frame_port=self.frame_port,
            settling_s=max(0.0, self.judged_from - time.time()),
        )

    def RegisterWorker(self, request, context):
        w = request.worker
        check_id("worker id", w.worker_id)
        self.store.register_worker(
            WorkerRegistration(
                worker_id=w.worker_id,
                name=w.name,
                addr=w.addr,
                host_id=w.host_id,
                local_socket=w.local_socket,
                roles=tuple(w.roles),
                mem_cap_bytes=w.mem_cap_bytes,
                pid=w.pid,
                data_addr=w.data_addr,
            ),
            time.time(),
        )
        return pb.RegisterWorkerReply(heartbeat_ttl_s=self.heartbeat_ttl_s)

    def DeregisterWorker(self, request, context):
        self.coord.release_shards(request.worker_id)
        self.store.deregister_worker(request.worker_id)
        return pb.Empty()

    def Heartbeat(self, request, context):
        now = time.time()
        inventory = Inventory.of(
            request.content_ids,
            request.pinned_content_ids,
            request.disk_content_ids,
            request.file_content_ids,
            epoch=request.inventory_epoch,
            base_epoch=request.base_epoch,
            removed=[(r.content_id, r.tier) for r in request.removed],
        )
        beat = self.store.heartbeat(
            request.worker_id,
            request.mem_used_bytes,
            inventory,
            now,
            active_transfers=request.active_transfers,
            transfer_bytes_total=request.transfer_bytes_total,
            disk_used_bytes=request.disk_used_bytes,
        )
        kind = "resync" if beat.resync else "full" if inventory.is_full else "delta"
        with self._heartbeats_lock:
            self.heartbeats[kind] += 1
        self.coord.renew_shards(
            request.worker_id, [(s.shard, s.token) for s in request.held_shards], now
        )
        self.coord.report_instances(
            request.worker_id, [instance_from_pb(i) for i in request.instances], now
        )
        return pb.HeartbeatReply(
            drop_content_ids=beat.drop_content_ids,
            shards=shard_table_to_pb(self.coord.shard_table(now)),
            resync=beat.resync,
            kept=[pb.ReplicaRef(content_id=c, tier=t) for c, t in sorted(beat.kept)],
        )

    def ListWorkers(self, request, context):
        workers = self.store.list_workers(time.time())
        return pb.ListWorkersReply(workers=[worker_to_pb(w) for w in workers])

    def AddReplica(self, request, context):
        check_id("content id", request.content_id)
        self.store.add_replica(
            request.worker_id,
            request.content_id,
            request.size_bytes,
            tensors_from_pb(request.tensors),
            time.time(),
            request.tier or "cpu",
            request.reference,
        )
        return pb.Empty()

    def ListReferences(self, request, context):
        return pb.ListReferencesReply(
            references=[
                pb.FileReferenceRecord(content_id=c, spec=spec)
                for c, spec in self.store.list_references(request.host_id)
            ]
        )

    def RemoveReplica(self, request, context):
        removed = self.store.remove_replica(
            request.worker_id, request.content_id, request.tier, request.unless_last, time.time()
        )
        return pb.RemoveReplicaReply(removed=removed)

    def FindContent(self, request, context):
        info = self.store.find_content(request.content_id, time.time())
        if info is None:
            return pb.FindContentReply(exists=False)
        return pb.FindContentReply(
            exists=True,
            replicas=[replica_to_pb(r) for r in info.replicas],
            tensors=[tensor_to_pb(t) for t in info.tensors],
        )

    def CreateArtifact(self, request, context):
        info, existed = self.store.create_artifact(
            request.art_id,
            request.content_id,
            request.owner,
            request.ttl_s,
            request.parent,
            time.time(),
        )
        return pb.CreateArtifactReply(artifact=artifact_to_pb(info), existed=existed)

    def GetArtifact(self, request, context):
        return artifact_to_pb(self.store.get_artifact(request.art_id, time.time()))

    def ListArtifacts(self, request, context):
        if request.limit == 0 and not (request.after or request.summary or request.delimiter):
            infos = self.store.list_artifacts(request.prefix, time.time())  # one reply, all
            return pb.ListArtifactsReply(artifacts=[artifact_to_pb(a) for a in infos])
        infos, next_after = self.store.list_artifact_page(
            request.prefix,
            request.after,
            request.limit,
            time.time(),
            not request.summary,
            request.delimiter,
        )
        return pb.ListArtifactsReply(
            artifacts=[artifact_to_pb(a) for a in infos], next_after=next_after
        )

    def DeleteArtifact(self, request, context):
        self.store.delete_artifact(request.art_id, time.time())
        return pb.Empty()

    def PutArtifacts(self, request, context):
        op = _put_op(request)
        result = self.store.put_artifacts(
            op.worker_id, list(op.replicas), list(op.artifacts), time.time()
        )
        return _put_reply(result, op, request.brief)

    def DeleteArtifacts(self, request, context):
        deleted = self.store.delete_artifacts(
            list(request.art_ids), time.time(), request.missing_ok
        )
        return pb.DeleteArtifactsReply(deleted=deleted)

    def Batch(self, request, context):
        ops: list[StoreOp] = []
        briefs: dict[int, bool] = {}
        for m in request.ops:
            kind = m.WhichOneof("op")
            if kind == "put":
                ops.append(_put_op(m.put))
                briefs[len(ops) - 1] = m.put.brief
            elif kind == "get":
                ops.append(GetOp(m.get.art_id))
            elif kind == "delete":
                ops.append(DeleteOp(tuple(m.delete.art_ids), m.delete.missing_ok))
            else:
                raise InvalidArgument("a batch operation names no operation")
        results = []
        for i, (op, result) in enumerate(zip(ops, self.store.run_batch(ops, time.time()))):
            if isinstance(result, TensorcastError):
                results.append(pb.StoreOpResult(error_kind=public_name(result), error=str(result)))
            elif isinstance(result, PutResult):
                assert isinstance(op, PutOp)
                results.append(pb.StoreOpResult(put=_put_reply(result, op, briefs[i])))
            elif isinstance(result, int):
                results.append(pb.StoreOpResult(delete=pb.DeleteArtifactsReply(deleted=result)))
            else:
                results.append(pb.StoreOpResult(get=artifact_to_pb(result)))
        return pb.BatchReply(results=results)

    def HeldContents(self, request, context):
        held = self.store.held_contents(list(request.content_ids), time.time(), request.touch)
        return pb.HeldContentsReply(
            content_ids=sorted(held), unreferenced_grace_s=self.store.unreferenced_grace_s
        )

    def RenewLease(self, request, context):
        return artifact_to_pb(self.store.renew_lease(request.art_id, request.ttl_s, time.time()))

    def ListShards(self, request, context):
        return shard_table_to_pb(self.coord.shard_table(time.time()))

    def AcquireShards(self, request, context):
        table = self.coord.acquire_shards(request.worker_id, list(request.shards), time.time())
        return shard_table_to_pb(table)

    def HandOffShard(self, request, context):
        table = self.coord.hand_off_shard(
            request.worker_id, request.shard, request.token, request.to_worker_id, time.time()
        )
        return shard_table_to_pb(table)

    def ListInstances(self, request, context):
        instances = self.coord.list_instances(time.time())
        return pb.ListInstancesReply(instances=[instance_to_pb(i) for i in instances])

    def BeginPlan(self, request, context):
        started, previous = self.coord.begin_plan(plan_from_pb(request), time.time())
        reply = pb.BeginPlanReply(started=started)
        if previous is not None:
            reply.existing.CopyFrom(plan_to_pb(previous))
        return reply

    def FinishPlan(self, request, context):
        self.coord.finish_plan(plan_from_pb(request), time.time())
        return pb.Empty()

    def GetPlan(self, request, context):
        return plan_to_pb(self.coord.get_plan(request.idempotency_key))

    def ListPlans(self, request, context):
        plans = self.coord.list_plans(request.limit)
        return pb.ListPlansReply(plans=[plan_to_pb(p) for p in plans])


ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")


def check_id(what: str, value: str) -> None:
    """Worker and content ids become parts of store keys (etcd: `w/<id>`, `r/<content>/<worker>`):
    an id with a separator in it would be parsed as other keys. Generated ids always fit."""
    if not ID_PATTERN.fullmatch(value):
        raise InvalidArgument(f"bad {what} {value[:80]!r}: 1-128 of A-Z a-z 0-9 . _ -")


def _put_op(request: pb.PutArtifactsRequest) -> PutOp:
    for r in request.replicas:
        check_id("content id", r.content_id)
    for a in request.artifacts:
        check_id("content id", a.content_id)
    return PutOp(
        request.worker_id,
        tuple(
            NewReplica(r.content_id, r.size_bytes, tensors_from_pb(r.tensors))
            for r in request.replicas
        ),
        tuple(
            NewArtifact(a.art_id, a.content_id, a.owner, a.ttl_s, a.parent)
            for a in request.artifacts
        ),
    )


def _put_reply(result: PutResult, op: PutOp, brief: bool) -> pb.PutArtifactsReply:
    """The artifacts without the tensors of contents the request carried (the sender has
    them; a 700-tensor publish's reply would repeat every layout); none when `brief`."""
    sent = {r.content_id for r in op.replicas}
    return pb.PutArtifactsReply(
        artifacts=[]
        if brief
        else [
            artifact_to_pb(a, with_tensors=a.content_id not in sent) for a, _ in result.artifacts
        ],
        existed=[e for _, e in result.artifacts],
        redundant_content_ids=list(result.redundant),
    )

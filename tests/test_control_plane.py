"""Control-plane cost and batches through a real cluster (issue 20): a same-host small put, lookup
or delete is one round trip to the worker and one Global Store request (the worker's `Batch`,
which coalesces its callers' requests); batches (`put_many`, `register_many`, a weight publish)
are one store transaction, all or nothing; a store killed mid-batch leaves all of it or none;
listings page and never show part of a batch."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request

import pytest
import torch
from conftest import Cluster, pool_used, wait_until, worker_contents

import tensorcast as tc
from tensorcast.metrics import rpc_counts
from tensorcast.sdk import writes

# Requests workers make on their own (heartbeats, shard leases), and a caller's refresh of its
# worker list (at most one per WORKERS_CACHE_S, whatever it does): not per operation.
BACKGROUND = {"Heartbeat", "AcquireShards", "ListShards", "HandOffShard", "ListWorkers"}


def _store_calls(cluster: Cluster) -> dict[str, float]:
    metrics_addr = next(p for p in cluster.record.processes if p.role == "store").metrics_addr
    text = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=10).read().decode()
    return {m: n for m, n in rpc_counts(text).items() if m not in BACKGROUND}


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {m: after[m] - before.get(m, 0) for m in after if after[m] != before.get(m, 0)}


def _local(rt: tc.Runtime):
    (conn,) = rt._local.values()
    return conn


def test_a_small_put_is_one_worker_round_trip_and_one_store_request(cluster):
    with cluster.connect() as rt:
        # One worker named: a burst spreads over the workers by free memory.
        rt.put({"w": torch.zeros(16)}, "cost/warm", worker="worker-1")  # lists, connects
        conn = _local(rt)
        trips = conn.round_trips
        before = _store_calls(cluster)
        art = rt.put({"w": torch.arange(16.0)}, "cost/put", worker="worker-1")
        assert _delta(before, _store_calls(cluster)) == {"Batch": 1}
        assert conn.round_trips == trips + 1
        assert art.content_id and art.info.replicas  # visible with its replica at once
        assert art.info.tensors[0].hash_hex  # the layout, though the store's reply left it out
        trips = conn.round_trips
        before = _store_calls(cluster)
        assert rt.info("cost/put").tensors[0].hash_hex == art.info.tensors[0].hash_hex
        assert _delta(before, _store_calls(cluster)) == {"Batch": 1}
        assert conn.round_trips == trips + 1
        trips = conn.round_trips
        before = _store_calls(cluster)
        got = rt.artifact("cost/put").tensor_dict()["w"]
        assert torch.equal(got, torch.arange(16.0))
        assert _delta(before, _store_calls(cluster)) == {"Batch": 1}
        assert conn.round_trips == trips + 2  # the lookup, then "open"
        kv = rt.register({"k": torch.ones(8)}, "cost/lease", ttl_s=60, worker="worker-1")
        assert kv.info.expires_at is not None
        trips = conn.round_trips
        before = _store_calls(cluster)
        rt.delete("cost/put")
        assert _delta(before, _store_calls(cluster)) == {"Batch": 1}
        assert conn.round_trips == trips + 1
        with pytest.raises(tc.NotFound, match="no artifact 'cost/put'"):
            rt.delete("cost/put")
    with cluster.connect() as other:  # another caller sees it at once
        assert other.info("cost/lease").owner == "lease"


class _HeldStore:
    """The real Global Store client, with every call held at the door until `go` is set, and
    the calls in flight counted: to see how many requests the batcher keeps in flight."""

    def __init__(self, store) -> None:
        self.store = store
        self.go = threading.Event()
        self.lock = threading.Lock()
        self.in_flight = 0
        self.sizes: list[int] = []

    def call(self, method, request, timeout_s=None):
        with self.lock:
            self.in_flight += 1
            self.sizes.append(len(request.ops))
        try:
            assert self.go.wait(30)
            return self.store.call(method, request, timeout_s)
        finally:
            with self.lock:
                self.in_flight -= 1


def test_the_store_batcher_keeps_two_requests_in_flight_and_coalesces_the_rest(cluster):
    from tensorcast.proto import tensorcast_pb2 as pb
    from tensorcast.rpc.frames import StoreClient
    from tensorcast.worker.store_batch import MAX_IN_FLIGHT, StoreBatcher

    names = [f"inflight/{i}" for i in range(5)]
    with cluster.connect() as rt:
        rt.put_many({n: {"w": torch.full((4,), float(i))} for i, n in enumerate(names)})
    store = _HeldStore(StoreClient(cluster.record.store_addr, cluster.token, 10.0))
    batcher = StoreBatcher(store, timeout_s=30.0)
    results: dict[str, object] = {}

    def lookup(name: str) -> None:
        try:
            results[name] = batcher.call(pb.StoreOp(get=pb.ArtifactRequest(art_id=name))).get
        except tc.TensorcastError as e:
            results[name] = e

    callers = [threading.Thread(target=lookup, args=(n,)) for n in [*names, "inflight/none"]]
    try:
        for k, t in enumerate(callers):
            t.start()
            if k < MAX_IN_FLIGHT:  # each of the first two finds a free slot and sends
                wait_until(lambda k=k: len(store.sizes) == k + 1, 10)
        # The other four queue behind the two held requests: no third request goes out.
        wait_until(lambda: len(batcher._queue) == len(callers) - MAX_IN_FLIGHT, 10)
        assert store.in_flight == MAX_IN_FLIGHT and len(store.sizes) == MAX_IN_FLIGHT
    finally:
        store.go.set()
        for t in callers:
            t.join(30)
    assert store.sizes == [1, 1, 4]  # the four queued ones went together in one request
    for name in names:
        assert results[name].art_id == name, results[name]
    assert isinstance(results["inflight/none"], tc.NotFound)  # its own error, nobody else's
    assert batcher.requests == 3 and batcher.ops == 6


def test_the_worker_checks_the_callers_hashes(cluster, monkeypatch):
    from tensorcast.transport import native

    with cluster.connect() as rt:
        used = pool_used(rt)
        real = native.hash_buffers
        monkeypatch.setattr(native, "hash_buffers", lambda bufs, threads=0: ["0" * 32] * len(bufs))
        with pytest.raises(tc.IntegrityError, match="sender claimed"):
            rt.put({"w": torch.ones(16)}, "lying-put")
        monkeypatch.setattr(native, "hash_buffers", real)
        with pytest.raises(tc.NotFound):
            rt.info("lying-put")
        assert all(pool_used(rt)[w] <= used[w] for w in used)


def test_put_many_creates_a_batch_in_one_request(cluster):
    items = {f"many/{i:03d}": {"w": torch.full((64,), float(i))} for i in range(40)}
    items["many/big"] = {"w": torch.arange(300_000, dtype=torch.float32)}  # a reserved region
    with cluster.connect() as rt:
        rt.put({"w": torch.zeros(4)}, "many-warm")
        before = _store_calls(cluster)
        arts = rt.put_many(items)
        # Whether the cluster holds the large content already (its bytes need not move), then
        # one transaction for all 41.
        assert _delta(before, _store_calls(cluster)) == {"HeldContents": 1, "Batch": 1}
        assert list(arts) == list(items)
        for art_id, tensors in items.items():
            assert torch.equal(rt.artifact(art_id).tensor_dict()["w"], tensors["w"])
        assert rt.put_many(items)["many/007"].content_id == arts["many/007"].content_id
        leased = rt.register_many({"many-kv/a": {"k": torch.ones(4)}}, ttl_s=30)
        assert leased["many-kv/a"].info.owner == "lease"
        assert rt.delete_many(["many/000", "many/001", "nope"], missing_ok=True) == 2
        with pytest.raises(tc.NotFound, match=r"batch member 1 \('nope'\)"):
            rt.delete_many(["many/002", "nope"])
        assert rt.info("many/002").art_id == "many/002"  # nothing deleted


def test_a_brief_batch_is_named_whole_and_answered_without_artifacts(cluster):
    from tensorcast.proto import tensorcast_pb2 as pb
    from tensorcast.sdk import batch
    from tensorcast.types import OWNER_SYSTEM

    items = [(f"brief/{i}", {"w": torch.full((16,), float(i))}) for i in range(30)]
    with cluster.connect() as rt:
        specs = batch.tensor_specs(items, OWNER_SYSTEM, 0.0)
        assert batch.put_batch(rt, specs, None, brief=True) == []
        for art_id, tensors in items:
            assert torch.equal(rt.artifact(art_id).tensor_dict()["w"], tensors["w"])
        # The store's answer, by PutArtifacts and by Batch (what workers send): `existed` for
        # each member, and the artifacts only when the request is not brief.
        named = pb.NewArtifact(
            art_id="brief/0", content_id=rt.info("brief/0").content_id, owner=OWNER_SYSTEM
        )
        for brief in (True, False):
            request = pb.PutArtifactsRequest(artifacts=[named], brief=brief)
            direct = rt.store.call("PutArtifacts", request)
            (result,) = rt.store.call(
                "Batch", pb.BatchRequest(ops=[pb.StoreOp(put=request)])
            ).results
            for reply in (direct, result.put):
                assert list(reply.existed) == [True]
                assert [a.art_id for a in reply.artifacts] == ([] if brief else ["brief/0"])


@pytest.mark.parametrize(
    ("bad_id", "error", "match"),
    [
        ("taken", tc.AlreadyExists, r"batch member 2 \('taken'\)"),
        (" spaced", tc.InvalidArgument, r"batch member 2 \(' spaced'\)"),
    ],
)
def test_a_batch_with_one_bad_member_changes_nothing(cluster, bad_id, error, match):
    tag = "exists" if error is tc.AlreadyExists else "invalid"
    with cluster.connect() as rt:
        rt.put({"other": torch.zeros(3)}, "taken")
        used = pool_used(rt)
        listed = [a.art_id for a in rt.list_artifacts()]
        items = {f"bad-{tag}/{i}": {"w": torch.full((32,), float(i))} for i in range(2)}
        items[bad_id] = {"w": torch.full((32,), 7.0)}
        items[f"bad-{tag}/big"] = {"w": torch.arange(100_000, dtype=torch.float32)}
        with pytest.raises(error, match=match):
            rt.put_many(items)
        assert [a.art_id for a in rt.list_artifacts()] == listed
        # The contents the batch wrote were freed (other tests' deletes may free more).
        assert all(pool_used(rt)[w] <= used[w] for w in used)


def test_a_weight_publish_is_one_transaction(cluster):
    state = {f"layer{i}.weight": torch.full((8, 8), float(i)) for i in range(30)}
    with cluster.connect() as rt:
        publisher = tc.WeightPublisher(rt, "txn-model", keep_last=1)
        rt.put({"w": torch.zeros(2)}, "txn-warm")
        before = _store_calls(cluster)
        publisher.publish(state, "v1")
        # One transaction for the 31 artifacts, then one listing of the model's manifests.
        assert _delta(before, _store_calls(cluster)) == {"Batch": 1, "ListArtifacts": 1}
        # A tensor id taken by other content: the whole version fails, nothing of it appears.
        rt.put({"x": torch.ones(1)}, "weights/txn-model@v2/layer29.weight")
        with pytest.raises(tc.AlreadyExists, match="layer29"):
            publisher.publish(state, "v2")
        left = [a.art_id for a in rt.list_artifacts("weights/txn-model@v2")]
        assert left == ["weights/txn-model@v2/layer29.weight"]
        rt.delete("weights/txn-model@v2/layer29.weight")
        before = _store_calls(cluster)
        publisher.publish(state, "v2")  # keep_last=1: v1 goes, in one delete request
        # The put, the listing, the manifest reads of v2 (kept: it is a version) and v1, one
        # delete of all 31 artifacts of v1. The reads and the delete ride the worker's batch,
        # or go to the store itself when this caller's release thread (unmapping a manifest)
        # has the worker connection at that instant.
        delta = _delta(before, _store_calls(cluster))
        assert delta.pop("ListArtifacts") == 1 and delta.get("Batch", 0) >= 1, delta
        assert set(delta) <= {"Batch", "GetArtifact", "DeleteArtifacts"}, delta
        assert sum(delta.values()) == 4, delta
        ids = [a.art_id for a in rt.list_artifacts("weights/txn-model@")]
        assert len(ids) == 31 and all(i.startswith("weights/txn-model@v2") for i in ids)


def test_listings_page_and_never_show_part_of_a_batch(cluster):
    with cluster.connect() as rt:
        stop = threading.Event()
        seen: list[int] = []

        def look() -> None:
            with cluster.connect() as reader:
                while not stop.is_set():
                    seen.append(len(reader.list_artifacts_page("half/", limit=1000)[0]))

        thread = threading.Thread(target=look)
        thread.start()
        try:
            wait_until(lambda: len(seen) >= 1, 30)
            rt.put_many({f"half/{i:03d}": {"w": torch.full((4,), float(i))} for i in range(300)})
            count = len(seen)
            wait_until(lambda: len(seen) > count, 30)  # one more look after the batch
        finally:
            stop.set()
            thread.join(30)
        assert set(seen) <= {0, 300} and seen[-1] == 300
        page, after = rt.list_artifacts_page("half/", limit=120)
        assert len(page) == 120 and after == "half/119" and page[0].tensors == ()
        assert page[0].num_tensors == 1
        rest, end = rt.list_artifacts_page("half/", after=after, limit=1000)
        assert len(rest) == 180 and end == ""
    first = json.loads(cluster.tc("ls", "half/", "--limit", "2", "--json", check=True).stdout)
    assert [a["art_id"] for a in first["artifacts"]] == ["half/000", "half/001"]
    assert first["next_after"] == "half/001"
    more = cluster.tc("ls", "half/", "--after", "half/297", "--json", check=True).stdout
    assert [a["art_id"] for a in json.loads(more)["artifacts"]] == ["half/298", "half/299"]
    assert json.loads(more)["next_after"] is None
    text = cluster.tc("ls", "half/", "--limit", "1", check=True).stdout
    assert "more: tc ls half/ --after half/000 --limit 1" in text  # the same prefix and limit


@pytest.fixture
def fault_dir(tmp_path):
    c = Cluster(tmp_path / "state", None)  # type: ignore[arg-type]
    yield c
    c.tc("down")


def _heartbeats(c: Cluster) -> float:
    cluster = json.loads((c.state_dir / "cluster.json").read_text())
    addr = next(p["metrics_addr"] for p in cluster["processes"] if p["name"] == "store")
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    return rpc_counts(text).get("Heartbeat", 0)


def _store_pid(c: Cluster) -> int:
    cluster = json.loads((c.state_dir / "cluster.json").read_text())
    return next(p["pid"] for p in cluster["processes"] if p["name"] == "store")


@pytest.mark.parametrize("when", ["IN_BATCH", "AFTER_COMMIT"])
def test_a_store_killed_mid_batch_leaves_all_of_it_or_none(fault_dir, when):
    c = fault_dir
    env = {f"TC_FAULT_STORE_EXIT_{when}": "50"}  # the store dies on a batch of >= 50
    c.tc("up", "--workers", "1", "--mem", "64MiB", "--json", check=True, env=env)
    items = {f"fault/{i:03d}": {"w": torch.full((16,), float(i))} for i in range(60)}
    with c.connect() as rt:
        rt.put({"w": torch.zeros(1)}, "fault/small")  # a batch of one: no fault
        store_pid = _store_pid(c)
        with pytest.raises(tc.Unavailable):
            rt.put_many(items)
    wait_until(lambda: not os.path.exists(f"/proc/{store_pid}"), 30)
    c.tc("up", "--json", check=True)  # the store again, on the same records, without the fault
    wait_until(lambda: _heartbeats(c) > 0, 30)  # the worker reached the new store process
    with c.connect() as rt:
        listed = [a.art_id for a in rt.list_artifacts("fault/")]
        if when == "IN_BATCH":
            assert listed == ["fault/small"]
            # The worker kept what it wrote (the outcome was unknown to it) until a heartbeat
            # told it the store does not know those contents.
            wait_until(lambda: worker_contents(rt) == 1, 30)
        else:
            assert listed == sorted(["fault/small", *items])
            for art_id, tensors in list(items.items())[::15]:
                assert torch.equal(rt.artifact(art_id).tensor_dict()["w"], tensors["w"])
        again = rt.put_many(items)  # all of it, either way
        assert len(again) == 60
        assert torch.equal(rt.artifact("fault/059").tensor_dict()["w"], items["fault/059"]["w"])


def test_a_remote_batch_slower_than_the_unreferenced_grace_is_named_whole(fault_dir, monkeypatch):
    c = fault_dir
    grace = 3.0  # the store collects a content named by nothing after this
    c.tc(
        "up",
        "--workers",
        "1",
        "--mem",
        "64MiB",
        "--json",
        check=True,
        env={"TC_UNREFERENCED_GRACE_S": str(grace)},
    )
    monkeypatch.setenv("TC_HOST_ID", "elsewhere")  # no worker here: contents go one by one
    write_remote = writes.write_remote
    written: list[float] = []

    def slow(*args):
        if written:  # the first content lies unnamed past the grace and a few sweeps
            past = written[0] + grace + 2.0
            wait_until(lambda: time.monotonic() > past, grace + 10)
        committed = write_remote(*args)
        written.append(time.monotonic())
        return committed

    monkeypatch.setattr(writes, "write_remote", slow)
    items = {f"slow/{i}": {"w": torch.full((16,), float(i))} for i in range(2)}
    with c.connect() as rt:
        assert len(rt.put_many(items)) == 2
        assert len(written) == 2  # both streamed to the remote worker
        for art_id, tensors in items.items():
            assert torch.equal(rt.artifact(art_id).tensor_dict()["w"], tensors["w"])


def _heartbeat_kinds(cluster: Cluster) -> dict[str, float]:
    """The store's heartbeats so far by inventory: full, delta, resync."""
    addr = next(p for p in cluster.record.processes if p.role == "store").metrics_addr
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    prefix = 'tc_store_heartbeats_total{inventory="'
    kinds = {"full": 0.0, "delta": 0.0, "resync": 0.0}
    for line in text.splitlines():
        if line.startswith(prefix):
            key, _, value = line.rpartition(" ")
            kinds[key[len(prefix) : -2]] = float(value)
    return kinds


def test_heartbeats_send_what_changed_and_the_store_keeps_up(fresh_cluster):
    """A worker's heartbeats carry the changes since the store's acknowledged inventory (decision
    85), and everything the full inventories did still happens: pins reach the store, and a
    deleted artifact's bytes leave the pool though the worker's inventory did not change."""
    c = fresh_cluster
    with c.connect() as rt:
        rt.put_many({f"inv/{i:03d}": {"w": torch.full((16,), float(i))} for i in range(200)})
        before = _heartbeat_kinds(c)
        wait_until(lambda: _heartbeat_kinds(c)["delta"] >= before["delta"] + 5, 30)
        after = _heartbeat_kinds(c)
        # Deltas, and no refusals; a full inventory only every FULL_INVENTORY_EVERY_S (30 s).
        assert after["full"] - before["full"] <= 1 and after["resync"] == 0, (before, after)
        worker = rt.workers()[0]
        rt.artifact("inv/007").pin(worker)
        wait_until(lambda: rt.info("inv/007").replicas[0].pinned, 10)
        rt.artifact("inv/007").unpin(worker)
        wait_until(lambda: not rt.info("inv/007").replicas[0].pinned, 10)
        held = worker_contents(rt)
        rt.delete("inv/001")
        wait_until(lambda: worker_contents(rt) == held - 1, 10)  # beats: every 0.2 s
        assert [r.worker_id for r in rt.info("inv/002").replicas] == [worker.worker_id]
        assert torch.equal(rt.artifact("inv/199").tensor_dict()["w"], torch.full((16,), 199.0))


def test_the_store_answers_a_beat_with_the_removals_it_kept(rt):
    """A replica row younger than the store's grace outlives a beat that no longer lists it
    (it may postdate the inventory): the store's answer says so, over the wire, so that the
    worker reports the removal again (decision 85)."""
    from tensorcast.proto import tensorcast_pb2 as pb

    worker_id = "kept-beat-worker"
    rt.store.call(
        "RegisterWorker",
        pb.RegisterWorkerRequest(
            worker=pb.Worker(worker_id=worker_id, name=worker_id, addr="127.0.0.1:1")
        ),
    )
    try:
        tensor = pb.TensorMeta(name="w", dtype="U8", shape=[4], size_bytes=4)
        for content_id in ("kept-c1", "kept-c2"):
            rt.store.call(
                "AddReplica",
                pb.AddReplicaRequest(
                    worker_id=worker_id, content_id=content_id, size_bytes=4, tensors=[tensor]
                ),
            )
        full = pb.HeartbeatRequest(worker_id=worker_id, content_ids=["kept-c1"], inventory_epoch=1)
        reply = rt.store.call("Heartbeat", full)
        assert not reply.resync
        assert [(r.content_id, r.tier) for r in reply.kept] == [("kept-c2", "cpu")]
        delta = pb.HeartbeatRequest(
            worker_id=worker_id,
            inventory_epoch=2,
            base_epoch=1,
            removed=[pb.ReplicaRef(content_id="kept-c2", tier="cpu")],
        )
        reply = rt.store.call("Heartbeat", delta)
        assert [(r.content_id, r.tier) for r in reply.kept] == [("kept-c2", "cpu")]
    finally:
        rt.store.call("DeregisterWorker", pb.DeregisterWorkerRequest(worker_id=worker_id))


def test_ids_that_would_split_store_keys_are_refused(rt):
    """Worker and content ids become parts of the store's keys: one holding a separator is
    refused with InvalidArgument, and nothing is registered."""
    from tensorcast.proto import tensorcast_pb2 as pb

    with pytest.raises(tc.InvalidArgument, match="bad worker id"):
        rt.store.call(
            "RegisterWorker",
            pb.RegisterWorkerRequest(worker=pb.Worker(worker_id="w/x", name="wx", addr="h:1")),
        )
    assert not any(w.worker_id == "w/x" for w in rt.workers())
    worker = rt.workers()[0].worker_id
    tensor = pb.TensorMeta(name="w", dtype="U8", shape=[4], size_bytes=4)
    for bad in ("c1-x/z", "", "c" * 200):
        with pytest.raises(tc.InvalidArgument, match="bad content id"):
            rt.store.call(
                "AddReplica",
                pb.AddReplicaRequest(
                    worker_id=worker, content_id=bad, size_bytes=4, tensors=[tensor]
                ),
            )
    with pytest.raises(tc.InvalidArgument, match="bad content id"):
        rt.store.call(
            "PutArtifacts",
            pb.PutArtifactsRequest(
                worker_id=worker,
                replicas=[pb.NewReplica(content_id="c1-a/b", size_bytes=4, tensors=[tensor])],
                artifacts=[pb.NewArtifact(art_id="ids/bad", content_id="c1-a/b")],
            ),
        )
    with pytest.raises(tc.NotFound):
        rt.artifact("ids/bad")


def test_an_interrupted_request_leaves_no_reply_for_the_next_one(cluster, monkeypatch):
    """Ctrl-C (or an exception from a signal handler) between a request and its reply left
    the reply in the socket: the next request read it as its own, and an artifact read gave
    another's bytes under its name. The connection is dropped instead."""
    from tensorcast.sdk import local_client

    with cluster.connect() as rt:
        rt.put({"w": torch.full((4,), 1.0)}, "intr/a", worker="worker-1")
        rt.put({"w": torch.full((4,), 2.0)}, "intr/b", worker="worker-1")
        real = local_client.unix.recv_message

        def interrupted(sock):
            monkeypatch.setattr(local_client.unix, "recv_message", real)
            raise KeyboardInterrupt

        conn = rt.local_connection(rt.resolve_worker("worker-1"))
        monkeypatch.setattr(local_client.unix, "recv_message", interrupted)
        with pytest.raises(KeyboardInterrupt):
            rt.artifact("intr/a").tensor_dict()
        # Dropped at once (that the reply, once here, makes the idle socket readable is no
        # help when the next request is sent before it arrives).
        assert conn.broken
        assert torch.equal(rt.artifact("intr/b").tensor_dict()["w"], torch.full((4,), 2.0))
        assert torch.equal(rt.artifact("intr/a").tensor_dict()["w"], torch.full((4,), 1.0))


def test_reading_a_lease_gone_since_its_register_is_not_found(fresh_cluster):
    """The artifact `register` answers reads its content without asking the store: gone since
    (the lease ended, the worker freed it), every worker says "no content" and that was
    Unavailable, an error callers retry. The store is asked then: NotFound."""
    with fresh_cluster.connect() as rt:
        leased = rt.register({"w": torch.ones(4)}, "gone/lease", ttl_s=1)

        def gone() -> bool:
            try:
                rt.info("gone/lease")
            except tc.NotFound:
                return True
            return False

        wait_until(gone, 30)
        wait_until(lambda: worker_contents(rt) == 0, 30)  # its only content: freed
        with pytest.raises(tc.NotFound):
            leased.tensor_dict()


def test_batch_errors_name_the_member_and_a_zero_ttl_is_refused(cluster, tmp_path):
    from safetensors.torch import save_file

    with cluster.connect() as rt:
        with pytest.raises(tc.InvalidArgument, match=r"batch member 1 \('b/2'\)"):
            rt.put_many({"b/1": {"x": torch.ones(2)}, "b/2": {"x": "not a tensor"}})  # type: ignore[dict-item]
        path = tmp_path / "m.safetensors"
        save_file({"w": torch.ones(4)}, str(path))
        with pytest.raises(tc.InvalidArgument, match="ttl_s must be > 0"):
            rt.put_files("b/file", path, ttl_s=0)
        with pytest.raises(tc.NotFound):
            rt.info("b/file")

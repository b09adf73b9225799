"""Artifacts through a real cluster: round trips, views, dedupe, immutability, leases."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from conftest import pool_used, wait_until, worker_contents
from safetensors.torch import load_file, save_file

import tensorcast as tc
from tensorcast.tensors import TORCH_DTYPES


def _random(dtype: torch.dtype, shape) -> torch.Tensor:
    """Random bit patterns of any dtype (every byte value, NaN payloads included)."""
    raw = torch.randint(
        0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), dtype=torch.uint8
    )
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_every_dtype_round_trips_bit_exact(rt):
    tensors = {f"t_{name}": _random(dtype, (3, 5)) for name, dtype in TORCH_DTYPES.items()}
    tensors["empty"] = torch.empty(0, 7)
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    tensors["scalar_bool"] = torch.tensor(True)
    tensors["strided"] = torch.arange(40, dtype=torch.int32).reshape(5, 8)[:, ::2]
    rt.put(tensors, "dtypes@v1")
    got = rt.artifact("dtypes@v1").tensor_dict()
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert _bits(got[name]) == _bits(t), name
    meta = rt.artifact("dtypes@v1").tensor_meta()
    assert meta["scalar"].shape == () and meta["empty"].size_bytes == 0


def test_cli_put_get_round_trip_every_dtype(cluster, tmp_path):
    # safetensors.torch supports all but F8_E8M0.
    tensors = {
        name: _random(dtype, (4, 3)) for name, dtype in TORCH_DTYPES.items() if name != "F8_E8M0"
    }
    tensors["empty"] = torch.empty(2, 0)
    tensors["scalar"] = torch.tensor(7, dtype=torch.int64)
    save_file(tensors, tmp_path / "in.safetensors")
    put = cluster.tc("put", "cli-rt", str(tmp_path / "in.safetensors"), "--json", check=True)
    assert '"art_id": "cli-rt"' in put.stdout
    cluster.tc("get", "cli-rt", "-o", str(tmp_path / "out.safetensors"), check=True)
    back = load_file(tmp_path / "out.safetensors")
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and _bits(back[name]) == _bits(t), name


@pytest.mark.slow
def test_one_gib_tensor(tmp_path):
    from conftest import start_cluster

    for c in start_cluster(tmp_path / "big", workers=1, mem="1100MiB"):
        with c.connect() as rt:
            big = torch.randint(0, 2**31, (1 << 28,), dtype=torch.int32)  # 1 GiB
            rt.put({"big": big}, "big")
            got = rt.artifact("big")
            assert got.size_bytes == 1 << 30
            t = got.tensor_dict()["big"]
            assert torch.equal(t, big)
            del t


def test_same_content_is_stored_once(rt):
    tensors = {"w": torch.randn(256, 256)}
    first = rt.put(tensors, "dedupe-a")
    used = pool_used(rt)
    second = rt.put({"w": tensors["w"].clone()}, "dedupe-b")
    assert second.content_id == first.content_id
    assert pool_used(rt) == used
    # Putting the same id with the same content again is a no-op, not an error.
    assert rt.put(tensors, "dedupe-a").content_id == first.content_id


def test_reusing_an_id_for_other_content_is_rejected(rt):
    rt.put({"w": torch.zeros(8)}, "immutable")
    used = pool_used(rt)
    with pytest.raises(tc.AlreadyExists, match="immutable"):
        rt.put({"w": torch.ones(8)}, "immutable")
    assert torch.equal(rt.artifact("immutable").tensor_dict()["w"], torch.zeros(8))
    # The rejected bytes are not left behind once the store's grace period passes; immediately
    # afterwards at most the rejected content's region is extra.
    assert sum(pool_used(rt).values()) - sum(used.values()) <= 4096


def test_view_slices_on_the_worker(rt):
    w = torch.randn(8, 6, 4)
    rt.put({"w": w, "b": torch.arange(10)}, "viewed")
    art = rt.artifact("viewed")
    cases = {
        "v-dim0": {"w": slice(2, 6)},
        "v-dim1": {"w": (slice(None), slice(1, 5))},
        "v-dim2-step": {"w": (slice(None), slice(None), slice(0, 4, 2))},
        "v-int": {"w": 3, "b": slice(-3, None)},
    }
    expected = {
        "v-dim0": (w[2:6], torch.arange(10)),
        "v-dim1": (w[:, 1:5], torch.arange(10)),
        "v-dim2-step": (w[:, :, 0:4:2], torch.arange(10)),
        "v-int": (w[3:4], torch.arange(10)[-3:]),
    }
    for name, spec in cases.items():
        view = art.view(spec, name)
        assert view.info.parent == "viewed"
        got = view.tensor_dict()
        assert torch.equal(got["w"], expected[name][0]), name
        assert torch.equal(got["b"], expected[name][1]), name
        assert view.size_bytes < art.size_bytes or name == "v-none"
    with pytest.raises(tc.InvalidArgument):
        art.view({"nope": slice(0, 1)}, "bad")
    with pytest.raises(tc.InvalidArgument):
        art.view({"w": (slice(0, 1),) * 4}, "bad")


def test_lease_expires_and_renewal_extends_it(rt):
    art = rt.register({"kv": torch.randn(64, 64)}, "lease-a", ttl_s=1.5)
    assert art.info.owner == "lease" and art.info.expires_at is not None
    rt.register({"kv": torch.randn(64, 64)}, "lease-b", ttl_s=1.5)
    first_expiry = art.info.expires_at
    new_expiry = art.renew(60.0).info.expires_at
    assert new_expiry is not None and new_expiry > first_expiry + 30
    # lease-b was registered after lease-a with the same TTL: once it is gone, lease-a would be
    # gone too without the renewal.
    wait_until(lambda: "lease-b" not in [a.art_id for a in rt.list_artifacts("lease-")], 30)
    assert torch.equal(rt.artifact("lease-a").tensor_dict()["kv"], art.tensor_dict()["kv"])
    with pytest.raises(tc.NotFound):
        rt.artifact("lease-b")
    assert "lease-b" not in [a.art_id for a in rt.list_artifacts("lease-")]
    with pytest.raises(tc.NotFound):
        rt.renew("lease-b", 10)
    art.renew(1.0)  # a renewal sets the lease from now: this one ends it soon
    wait_until(lambda: not any(a.art_id == "lease-a" for a in rt.list_artifacts("lease-")), 30)


def test_delete_frees_memory_but_held_tensors_stay_valid(rt):
    data = torch.randn(512, 512)
    rt.put({"w": data}, "to-delete")
    before = sum(pool_used(rt).values())
    contents_before = worker_contents(rt)
    held = rt.artifact("to-delete").tensor_dict()["w"]
    rt.delete("to-delete")
    with pytest.raises(tc.NotFound):
        rt.artifact("to-delete")
    # The worker learns of the delete by heartbeat; while we hold the tensor it keeps the bytes.
    wait_until(lambda: worker_contents(rt) <= contents_before - 1, 30)
    filler = rt.put({"f": torch.full((512, 512), 7.0)}, "after-delete")
    assert torch.equal(held, data)
    del held
    import gc

    gc.collect()
    wait_until(lambda: sum(pool_used(rt).values()) <= before, 30)
    assert torch.equal(filler.tensor_dict()["f"], torch.full((512, 512), 7.0))


def test_unknown_id_is_not_found(cluster, rt):
    with pytest.raises(tc.NotFound, match="no artifact"):
        rt.artifact("missing")
    with pytest.raises(tc.NotFound):
        rt.delete("missing")
    proc = cluster.tc("show", "missing")
    assert proc.returncode == tc.NotFound.exit_code and "no artifact 'missing'" in proc.stderr


def test_bad_inputs_are_invalid_argument(rt):
    with pytest.raises(tc.InvalidArgument):
        rt.put({"w": [1, 2, 3]}, "not-a-tensor")
    with pytest.raises(tc.InvalidArgument):
        rt.put({"w": torch.ones(2)}, "")
    with pytest.raises(tc.InvalidArgument):
        rt.register({"w": torch.ones(2)}, "no-ttl", ttl_s=0)
    # A lease is finite: infinity (or NaN) never expires and prints as invalid JSON.
    for ttl_s in (float("inf"), float("nan"), 1e300):
        with pytest.raises(tc.InvalidArgument, match="ttl_s"):
            rt.register({"w": torch.ones(2)}, "endless", ttl_s=ttl_s)
    art = rt.register({"w": torch.ones(2)}, "renewed", ttl_s=60)
    with pytest.raises(tc.InvalidArgument, match="ttl_s"):
        art.renew(float("inf"))
    assert "endless" not in [a.art_id for a in rt.list_artifacts("endless")]


def test_tc_get_checks_its_output_path_before_reading(cluster, tmp_path):
    for bad, why in ((tmp_path, "is a directory"), (tmp_path / "no" / "x", "does not exist")):
        proc = cluster.tc("get", "anything", "-o", str(bad))
        assert proc.returncode == tc.InvalidArgument.exit_code and why in proc.stderr
        assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no temporary file left anywhere near


def test_tc_put_refuses_an_endless_lease(cluster, tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(4)}, str(tmp_path / "a.safetensors"))
    for ttl in ("inf", "nan"):
        proc = cluster.tc("put", "endless-cli", str(tmp_path / "a.safetensors"), "--ttl", ttl)
        assert proc.returncode == tc.InvalidArgument.exit_code and "ttl_s" in proc.stderr
    assert cluster.tc("show", "endless-cli").returncode == tc.NotFound.exit_code


@pytest.mark.parametrize(
    "name", ["a\x00b", "tab\there", "new\nline", " lead", "trail ", "__metadata__", "x" * 1025]
)
def test_bad_tensor_names_are_refused_and_store_nothing(rt, name):
    before = {a.art_id for a in rt.list_artifacts("")}
    with pytest.raises(tc.InvalidArgument, match="bad tensor name"):
        rt.put({name: torch.ones(2)}, "bad-name")
    assert {a.art_id for a in rt.list_artifacts("")} == before


def test_workers_and_the_store_refuse_bad_tensor_names_from_any_client(tmp_path):
    """A client that skips the SDK's check (an old or foreign one) is refused by the worker, and
    the store refuses such a layout too: the check does not rest on the caller."""
    from tensorcast.store.sqlite_store import SqliteStore
    from tensorcast.types import TensorMeta
    from tensorcast.worker.pool import _check_layout

    bad = TensorMeta("a\x00b", "F32", (2,), 8, 0, "")
    with pytest.raises(tc.InvalidArgument, match="bad tensor name"):
        _check_layout([bad], 8)
    store = SqliteStore(tmp_path / "gs.db", heartbeat_ttl_s=3.0)
    with pytest.raises(tc.InvalidArgument, match="bad tensor name"):
        store.add_replica("w", "c1-x", 8, (bad,), now=0.0)


def test_caller_on_another_host_moves_bytes_over_grpc(cluster):
    """A caller whose host has no worker streams bytes (chunk checksums, verified hashes)."""
    with cluster.connect() as rt:
        rt.host_id = "some-other-host"
        w = torch.randn(1024, 1024)  # 4 MiB: more than one stream chunk
        art = rt.put({"w": w, "i": torch.arange(5)}, "remote-put")
        got = art.tensor_dict()
        assert torch.equal(got["w"], w) and torch.equal(got["i"], torch.arange(5))
        assert not rt._local  # no shared-memory connection was used


RACING_CLIENT = """
import sys, torch, tensorcast as tc
state, me, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with tc.connect(state_dir=state) as rt:
    for i in range(n):
        value = torch.full((16,), float(i % 3))  # the same few contents in every client
        rt.put({"w": value}, f"race-{me}-{i}")
        if not torch.equal(rt.artifact(f"race-{me}-{i}").tensor_dict()["w"], value):
            sys.exit(f"wrong bytes for race-{me}-{i}")
        rt.delete(f"race-{me}-{i}")
"""


def test_concurrent_puts_of_shared_content_while_others_delete_it(cluster):
    """Regression: six clients putting, reading and deleting the same few contents. A put whose
    content another client's delete freed in between must still succeed (it writes again), and
    a read right after it must find the bytes (the worker does not drop what it is registering).
    Before the fix about 2% of puts failed with NotFound and some reads with Unavailable."""
    import subprocess
    import sys

    clients = [
        subprocess.Popen(
            [sys.executable, "-c", RACING_CLIENT, str(cluster.state_dir), str(me), "150"],
            stderr=subprocess.PIPE,
            text=True,
        )
        for me in range(6)
    ]
    failures = [err for p in clients if (err := p.communicate(timeout=240)[1]) or p.returncode]
    assert not failures, failures[0][-2000:]


def test_put_right_after_delete_of_the_same_content(rt):
    """Regression: the store forgets deleted content at once while the worker still holds it
    until its next heartbeat; a put of the same bytes in between must register it again."""
    data = {"w": torch.randn(300, 300)}
    for i in range(5):
        rt.put(data, f"again-{i}")
        rt.delete(f"again-{i}")
        art = rt.put(data, f"again-{i}-b")
        assert torch.equal(art.tensor_dict()["w"], data["w"])
        rt.delete(f"again-{i}-b")


def test_a_reply_that_came_too_late_is_never_taken_for_the_next_one(fresh_cluster):
    """A same-host request that times out leaves the worker's late reply in the socket; the
    next request must not read it as its own (it would get another artifact's tensors, or
    another reservation's pool offsets to write to). The connection is dropped and the next
    request opens a fresh one; tensors mapped through the old one stay valid."""
    with fresh_cluster.connect() as rt:
        zeros = rt.put({"w": torch.zeros(64)}, "late/a")
        ones = rt.put({"w": torch.ones(64)}, "late/b")
        kept = rt.put({"w": torch.full((64,), 3.0)}, "late/c").tensor_dict()["w"]
        (local,) = rt._local.values()
        local.sock.settimeout(1.0)  # this connection's next answer: 1 s (the rest: the default)
        worker = fresh_cluster.pid("worker-1")
        os.kill(worker, signal.SIGSTOP)
        wait_until(lambda: _all_threads_stopped(worker), 30)  # delivery is asynchronous
        try:
            with pytest.raises((tc.Unavailable, tc.DeadlineExceeded)):
                zeros.tensor_dict()  # its "open" is answered after the caller gave up
        finally:
            os.kill(worker, signal.SIGCONT)
        # The handles put returned ask the worker directly (no lookup first).
        assert torch.equal(ones.tensor_dict()["w"], torch.ones(64))
        twos = rt.put({"w": torch.full((64,), 2.0)}, "late/d")
        assert torch.equal(twos.tensor_dict()["w"], torch.full((64,), 2.0))
        assert torch.equal(zeros.tensor_dict()["w"], torch.zeros(64))
        assert torch.equal(kept, torch.full((64,), 3.0))


def _all_threads_stopped(pid: int) -> bool:
    """Every thread of `pid` in state T (stopped by a signal), from /proc."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return bool(states) and all(state == "T" for state in states)


def test_bad_local_put_requests_leak_no_pool_space_and_store_no_bad_shapes(cluster):
    """A same-host client that skips the SDK: a put item naming held content together with
    a reservation, one whose tensors do not parse, and a tensor of negative shape are
    refused, and every reservation they carried is freed (the session no longer lists them,
    so nothing else would)."""
    with cluster.connect() as rt:
        worker = rt.resolve_worker("worker-1")
        conn = rt.local_connection(worker)
        before = pool_used(rt)["worker-1"]
        held = rt.put({"w": torch.ones(4)}, "leak/held").content_id
        mib = 1 << 20
        bad_items = [
            {"art_id": "leak/both", "owner": "system", "content_id": held},
            {"art_id": "leak/unparsed", "owner": "system", "tensors": [{"name": "a"}]},
        ]
        for item in bad_items:
            (res,) = conn.request({"op": "reserve_many", "sizes": [32 * mib]})["reservations"]
            with pytest.raises(tc.InvalidArgument):
                conn.request({"op": "put", "items": [dict(item, reservation_id=res[0])]})
        negative = {"name": "w", "dtype": "F32", "shape": [-1, -4], "size_bytes": 16}
        negative |= {"offset_bytes": 0, "hash": ""}
        with pytest.raises(tc.InvalidArgument, match="needs ints >= 0"):
            conn.request(
                {
                    "op": "put",
                    "items": [
                        {
                            "art_id": "leak/negative",
                            "owner": "system",
                            "blob_offset": 0,
                            "size_bytes": 16,
                            "tensors": [negative],
                        }
                    ],
                },
                blob=bytes(16),
            )
        with pytest.raises(tc.NotFound):
            rt.info("leak/negative")
        rt.delete("leak/held")
        wait_until(lambda: pool_used(rt)["worker-1"] <= before, 30)


def test_a_file_replaced_after_its_header_was_read_is_never_read_with_that_header(tmp_path):
    """`tc put` reads a shard's header, then its bytes: a shard replaced in between (written
    aside, renamed over) must fail the put, not store the new file's bytes under the old
    header's offsets (and the put cache must not remember that content for the new file)."""
    from safetensors.torch import save_file

    from tensorcast import model_dir
    from tensorcast.sdk import writes

    model = tmp_path / "model"
    model.mkdir()
    save_file({"weight": torch.ones(4, 4), "bias": torch.zeros(4)}, str(model / "a.safetensors"))
    files = model_dir.scan(model)
    replaced = tmp_path / "new.safetensors"
    save_file({"weight": torch.full((8, 8), 2.0)}, str(replaced))
    replaced.replace(model / "a.safetensors")
    _, size, fill = writes.plan_files(files)
    with pytest.raises(tc.IntegrityError, match="changed while it was being put"):
        fill(bytearray(size), 0, None)


def test_a_tensor_named_like_a_kept_file_is_refused(tmp_path):
    """A model directory's other files are kept as tensors `__file__/NAME`: a shard tensor of
    that name would make an artifact holding one name twice (unreadable)."""
    from safetensors.torch import save_file

    from tensorcast import model_dir

    model = tmp_path / "model"
    model.mkdir()
    save_file({"__file__/config.json": torch.ones(2)}, str(model / "model.safetensors"))
    (model / "config.json").write_text("{}")
    with pytest.raises(tc.InvalidArgument, match=r"'__file__/config\.json'"):
        model_dir.scan(model)
    index = tmp_path / "indexed"
    index.mkdir()
    save_file({"w": torch.ones(2)}, str(index / "model.safetensors"))
    (index / "model.safetensors.index.json").mkdir()  # not a file
    with pytest.raises(tc.InvalidArgument, match="cannot read"):
        model_dir.scan(index)


def test_a_put_larger_than_the_pool_evicts_nothing(cluster):
    """No eviction can make room for more than the whole pool: such a put is refused at once,
    and the replicas that eviction would have dropped stay."""
    with cluster.connect() as rt:
        art = rt.put({"w": torch.ones(1024)}, "evict/kept", worker="worker-1")
        art.prefetch("worker-2")  # worker-2's copy is evictable: worker-1 holds another
        holders = {r.worker_id for r in rt.info("evict/kept").replicas}
        capacity = rt.resolve_worker("worker-2").mem_cap_bytes
        too_big = torch.empty(capacity // 4 + 1024, dtype=torch.float32)
        with pytest.raises(tc.ResourceExhausted):
            rt.put({"w": too_big}, "evict/too-big", worker="worker-2")
        assert {r.worker_id for r in rt.info("evict/kept").replicas} == holders
        assert len(holders) == 2
        rt.delete("evict/kept")


def test_transform_into_refusals_write_nothing(rt):
    """Every (target, source) pair is checked before any is written: a wrong shape, a name
    with no target, or an expanded (self-overlapping) target refuses the whole call."""
    art = rt.put({"a": torch.ones(4), "b": torch.ones(3)}, "into/ab")
    cases = [
        ({"a": torch.zeros(4), "b": torch.zeros(5)}, None),
        ({"a": torch.zeros(4), "b": torch.zeros(3)}, {"a": "a", "zz": "b"}),
        ({"a": torch.zeros(4), "b": torch.zeros(1).expand(3)}, None),
    ]
    for target, spec in cases:
        with pytest.raises(tc.InvalidArgument):
            art.transform_into(target, spec)
        assert torch.equal(target["a"], torch.zeros(4))  # untouched
    good = {"a": torch.zeros(4), "b": torch.zeros(3)}
    assert sorted(art.transform_into(good)) == ["a", "b"]
    assert torch.equal(good["b"], torch.ones(3))
    rt.delete("into/ab")


def test_view_refuses_bad_names_and_indices_before_the_worker_copies(rt):
    """A view's name, lease and indices are checked before the worker cuts the slices (a
    refusal afterwards left the copy unnamed in the pool); bad indices are InvalidArgument,
    and a bool is not an int index."""
    art = rt.put({"m": torch.arange(60.0).reshape(3, 4, 5)}, "views/m")
    before = pool_used(rt)
    for index in (slice(None, None, 0), 1.5, True, slice(0, 2.5), [True]):
        with pytest.raises(tc.InvalidArgument):
            art.view({"m": index}, "views/bad")
    for name, ttl in (("", 0.0), ("views/ok", -5.0)):
        with pytest.raises(tc.InvalidArgument):
            art.view({"m": slice(0, 2)}, name, ttl_s=ttl)
    assert pool_used(rt) == before  # nothing cut
    with pytest.raises(tc.NotFound):
        rt.info("views/bad")
    got = art.view({"m": 1}, "views/row1").tensor_dict()["m"]
    assert torch.equal(got, torch.arange(60.0).reshape(3, 4, 5)[1:2])
    rt.delete("views/row1")
    rt.delete("views/m")


def test_lazily_conjugated_tensors_store_their_values_and_sparse_ones_are_refused(rt):
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    got = rt.put({"c": c}, "conj/c").tensor_dict()["c"]
    assert torch.equal(got, c.resolve_conj())
    with pytest.raises(tc.InvalidArgument, match="dense"):
        rt.put({"s": torch.eye(3).to_sparse()}, "conj/sparse")
    rt.delete("conj/c")

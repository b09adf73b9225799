"""`tc put --by-reference`: files registered without copying, read on first use (cold), kept in
the pool for the next caller (warm), refused when changed, cut straight from disk for views."""

from __future__ import annotations

import gc
import json
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import tensorcast as tc
from tests.conftest import pool_used, wait_until


def _model_dir(path: Path, rows: int = 512, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two shards with an index and a config: ~2 x rows x 1 KiB of float32."""
    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    a = {"a.weight": torch.randn(rows, 256, generator=g), "a.bias": torch.randn(256, generator=g)}
    b = {"b.weight": torch.randn(rows, 256, generator=g).to(torch.bfloat16)}
    save_file(a, path / "model-00001-of-00002.safetensors")
    save_file(b, path / "model-00002-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" for n in a}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in b}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text('{"model_type": "test"}')
    return a | b


def _metric(cluster, worker_name: str, series: str) -> float:
    proc = next(p for p in cluster.record.processes if p.name == worker_name)
    with urllib.request.urlopen(f"http://{proc.metrics_addr}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(series + " "):
                return float(line.split()[1])
    raise AssertionError(f"{series} missing from /metrics")


def _file_bytes_read(cluster, worker_name: str) -> float:
    return _metric(cluster, worker_name, "tc_file_read_bytes_total")


def _same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return got.keys() == expected.keys() and all(
        torch.equal(got[k], v) for k, v in expected.items()
    )


def _tiers(rt: tc.Runtime, art_id: str) -> dict[str, set[str]]:
    names = {w.worker_id: w.name for w in rt.workers()}
    tiers: dict[str, set[str]] = {}
    for r in rt.info(art_id).replicas:
        tiers.setdefault(r.tier, set()).add(names[r.worker_id])
    return tiers


def test_registers_without_reading_then_reads_once(fresh_cluster, tmp_path):
    expected = _model_dir(tmp_path / "model")
    data_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    with fresh_cluster.connect() as rt:
        before = pool_used(rt)
        out = fresh_cluster.tc(
            "put", "ref-model", str(tmp_path / "model"), "--by-reference", "--json", check=True
        )
        reply = json.loads(out.stdout)
        assert reply["by_reference"] is True and reply["content_id"].startswith("r1-")
        assert pool_used(rt) == before  # nothing was copied
        assert _file_bytes_read(fresh_cluster, "worker-1") == 0
        assert _tiers(rt, "ref-model") == {"file": {"worker-1"}}

        assert _same(rt.artifact("ref-model").tensor_dict(), expected)  # cold: from the files
        files = rt.artifact("ref-model").files()
        assert files["config.json"] == b'{"model_type": "test"}'
        assert set(files) == {"config.json", "model.safetensors.index.json"}
        cold = _file_bytes_read(fresh_cluster, "worker-1")
        # Only the data sections and the small files: no safetensors header byte is read.
        assert cold == data_bytes + sum(len(v) for v in files.values())
        assert _tiers(rt, "ref-model") == {"file": {"worker-1"}, "cpu": {"worker-1"}}
        assert all(t.hash_hex for t in rt.info("ref-model").tensors)  # learned on first read

    with fresh_cluster.connect() as rt:  # a new caller: warm, no file read
        assert _same(rt.artifact("ref-model").tensor_dict(), expected)
        assert _file_bytes_read(fresh_cluster, "worker-1") == cold
        # Registering the same unchanged files again is the same content.
        out = fresh_cluster.tc("put", "ref-model-2", str(tmp_path / "model"), "--by-reference")
        assert out.returncode == 0, out.stderr
        assert rt.info("ref-model-2").content_id == rt.info("ref-model").content_id
        assert _metric(fresh_cluster, "worker-1", 'tc_replicas{tier="file"}') == 1
        gc.collect()  # our mapping of the pool copy goes, and with it our hold on it
        # Deleting every artifact that names it: the worker forgets the reference and frees
        # the pool copy (the files themselves are the caller's and stay).
        rt.delete("ref-model")
        rt.delete("ref-model-2")
        wait_until(
            lambda: (
                _metric(fresh_cluster, "worker-1", 'tc_replicas{tier="file"}') == 0
                and pool_used(rt) == before
            ),
            10,
        )
        assert (tmp_path / "model" / "config.json").exists()


def test_changed_or_missing_files_are_refused(fresh_cluster, tmp_path):
    _model_dir(tmp_path / "model")
    shard = tmp_path / "model" / "model-00002-of-00002.safetensors"
    with fresh_cluster.connect() as rt:
        rt.put_files("changed", tmp_path / "model", by_reference=True)
        before = pool_used(rt)
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF  # same size, different bytes, new mtime
        shard.write_bytes(bytes(data))
        with pytest.raises(tc.IntegrityError, match="changed since it was registered"):
            rt.artifact("changed").tensor_dict()
        assert pool_used(rt) == before  # the reservation was given back

        _model_dir(tmp_path / "model2")
        rt.put_files("gone", tmp_path / "model2", by_reference=True)
        (tmp_path / "model2" / "model-00001-of-00002.safetensors").unlink()
        with pytest.raises(tc.Unavailable, match="is gone; put it again"):
            rt.artifact("gone").tensor_dict()
        assert pool_used(rt) == before


def test_bad_input_registers_nothing(fresh_cluster, tmp_path):
    (tmp_path / "empty").mkdir()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with fresh_cluster.connect() as rt:
        for path in (tmp_path / "empty", bad, tmp_path / "missing"):
            with pytest.raises(tc.InvalidArgument):
                rt.put_files("bad", path, by_reference=True)
        assert [a.art_id for a in rt.list_artifacts()] == []
    # A caller on a host without a worker cannot hand its files over.
    _model_dir(tmp_path / "model")
    out = fresh_cluster.tc(
        "put", "far", str(tmp_path / "model"), "--by-reference", env={"TC_HOST_ID": "elsewhere"}
    )
    assert out.returncode != 0
    assert "needs a live worker on this host" in out.stderr


def test_headers_and_indexes_nested_or_repeating_are_refused_and_the_session_goes_on(
    fresh_cluster, tmp_path
):
    """A header nested deeper than the JSON parser's stack, or an index naming a tensor twice:
    InvalidArgument (parsed on the worker for references), and the caller's connection and the
    tensors it maps are untouched."""
    nested = b"[" * 200_000 + b"]" * 200_000
    deep = tmp_path / "deep.safetensors"
    deep.write_bytes(len(nested).to_bytes(8, "little") + nested)
    twice = tmp_path / "twice"
    _model_dir(twice)
    names = {f"t{i}": "model.safetensors" for i in range(5000)}
    index = json.dumps({"weight_map": names})[:-2] + ', "t7": "model.safetensors"}}'
    (twice / "model.safetensors.index.json").write_text(index)
    with fresh_cluster.connect() as rt:
        held = rt.put({"w": torch.arange(64.0)}, "held").tensor_dict()["w"]
        with pytest.raises(tc.InvalidArgument, match="nests too deeply"):
            rt.put_files("deep", deep, by_reference=True)
        with pytest.raises(tc.InvalidArgument, match="names tensors twice: \\['t7'\\]"):
            rt.put_files("twice", twice, by_reference=True)
        assert torch.equal(held, torch.arange(64.0))
        assert torch.equal(rt.artifact("held").tensor_dict()["w"], torch.arange(64.0))
        assert [a.art_id for a in rt.list_artifacts()] == ["held"]


def test_view_reads_only_its_slice_from_the_files(fresh_cluster, tmp_path):
    expected = _model_dir(tmp_path / "model", rows=2048)
    with fresh_cluster.connect() as rt:
        art = rt.put_files("tp", tmp_path / "model", by_reference=True)
        rank1 = art.view(
            {"a.weight": slice(1024, 2048), "b.weight": [slice(None), slice(0, 64)]}, "tp/rank1"
        )
        got = rank1.tensor_dict()
        assert torch.equal(got["a.weight"], expected["a.weight"][1024:])
        assert torch.equal(got["b.weight"], expected["b.weight"][:, :64])
        assert torch.equal(got["a.bias"], expected["a.bias"])
        # Per tensor, only the span from its first to its last selected element is read:
        # half of a.weight's rows; b.weight's first 64 columns span rows 0..2047; the rest whole.
        blobs = sum(len(v) for v in rank1.files().values())
        spans = 1024 * 256 * 4 + 256 * 4 + (2047 * 256 + 64) * 2 + blobs
        assert _file_bytes_read(fresh_cluster, "worker-1") == spans < art.size_bytes
        assert "cpu" not in _tiers(rt, "tp")  # the full model was never loaded


def test_cpu_copy_is_evictable_and_read_again(fresh_cluster, tmp_path):
    """A 64 MiB pool: the by-reference model's pool copy makes room for new data (the files
    are still there, so it is not a last copy), and a later read loads it again, checked
    against the hashes of the first read."""
    expected = _model_dir(tmp_path / "model", rows=24 * 1024)  # ~ 24 + 12 MiB
    with fresh_cluster.connect() as rt:
        art = rt.put_files("big", tmp_path / "model", by_reference=True)
        art.tensor_dict()
        first = _file_bytes_read(fresh_cluster, "worker-1")
        rt.put({"x": torch.ones(10 * 1024 * 1024)}, "filler")  # 40 MiB: needs the room
        wait_until(lambda: "cpu" not in _tiers(rt, "big"), 30)
        rt.delete("filler")
        wait_until(lambda: pool_used(rt)["worker-1"] == 0, 30)
        got = art.tensor_dict()
        assert all(torch.equal(got[k], v) for k, v in expected.items())
        assert _file_bytes_read(fresh_cluster, "worker-1") == 2 * first


def test_peer_pulls_from_the_referencing_worker(cluster, tmp_path):
    expected = _model_dir(tmp_path / "model")
    with cluster.connect() as rt:
        rt.put_files("shared-ref", tmp_path / "model", by_reference=True, worker="worker-1")
        reply = rt.artifact("shared-ref").prefetch("worker-2")  # worker-1 reads, worker-2 pulls
        assert reply.bytes_moved == rt.info("shared-ref").size_bytes
        assert _tiers(rt, "shared-ref")["cpu"] == {"worker-1", "worker-2"}
        rt.host_id = "another-host"  # read through worker-2's copy over gRPC/TCP, verified
        got = rt.artifact("shared-ref").tensor_dict()
        assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_a_restarted_worker_serves_unchanged_references_again(fresh_cluster, tmp_path):
    """The store keeps what a by-reference put registered: after kill -9 of the worker, a new
    worker on the host serves the unchanged files again (no second put); changed ones not."""
    import os
    import signal

    expected = _model_dir(tmp_path / "kept")
    _model_dir(tmp_path / "edited", seed=1)
    with fresh_cluster.connect() as rt:
        rt.put_files("kept", tmp_path / "kept", by_reference=True)
        rt.put_files("edited", tmp_path / "edited", by_reference=True)
        assert _same(rt.artifact("kept").tensor_dict(), expected)
    os.kill(fresh_cluster.pid("worker-1"), signal.SIGKILL)
    shard = tmp_path / "edited" / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes())  # same bytes, new mtime: no longer the registered file
    with fresh_cluster.extra_worker("reborn"), fresh_cluster.connect() as rt:
        wait_until(lambda: "file" in _tiers(rt, "kept") and "cpu" not in _tiers(rt, "kept"), 30)
        assert _tiers(rt, "kept") == {"file": {"reborn"}}
        assert _same(rt.artifact("kept").tensor_dict(), expected)  # read from the files
        assert _tiers(rt, "edited") == {}
        with pytest.raises(tc.Unavailable, match="no live replica"):
            rt.artifact("edited").tensor_dict()


def test_cli_get_writes_the_tensors_of_a_model_directory(cluster, tmp_path):
    """`tc get` of a directory put (by reference or not): a safetensors file of its tensors,
    byte for byte; the directory's other files are not tensors and are left out."""
    from safetensors.torch import load_file

    expected = _model_dir(tmp_path / "model")
    for how in ("--by-reference", "--json"):  # the second is a plain put
        art_id = f"get-{how.strip('-')}"
        cluster.tc("put", art_id, str(tmp_path / "model"), how, check=True)
        out = tmp_path / f"{art_id}.safetensors"
        got = cluster.tc("get", art_id, "-o", str(out), "--json", check=True)
        assert json.loads(got.stdout)["size_bytes"] == sum(
            t.numel() * t.element_size() for t in expected.values()
        )
        assert _same(load_file(out), expected)

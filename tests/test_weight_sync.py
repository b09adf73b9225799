"""RL weight sync: versioned publication, delta sync counted in bytes, GC, no mixed versions."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import save_file

import tensorcast as tc
from tensorcast.sdk.weight_sync import list_versions


def _state(n=10, fill=None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        f"layer{i}.weight": (
            torch.full((64, 32 + i), float(fill))
            if fill is not None
            else torch.randn(64, 32 + i, generator=g)
        )
        for i in range(n)
    }


def test_delta_sync_moves_exactly_the_changed_tensors(rt):
    v1 = _state()
    publisher = tc.WeightPublisher(rt, "delta-model", keep_last=5)
    publisher.publish(v1, "v1")
    target = {k: torch.zeros_like(v) for k, v in v1.items()}
    sub = tc.WeightSubscriber(rt, "delta-model", target)
    first = sub.sync()
    assert (first.version, first.moved_tensors) == ("v1", 10)
    assert first.moved_bytes == sum(t.nbytes for t in v1.values())
    v2 = {k: v.clone() for k, v in v1.items()}
    changed = ["layer2.weight", "layer5.weight", "layer9.weight"]
    for name in changed:
        v2[name] += 1.0
    publisher.publish(v2, "v2")
    second = sub.sync()
    assert (second.version, second.moved_tensors, second.unchanged_tensors) == ("v2", 3, 7)
    assert second.moved_bytes == sum(v2[n].nbytes for n in changed)
    assert all(torch.equal(target[k], v2[k]) for k in v2)
    assert sub.sync("v2").moved_tensors == 0
    back = sub.sync("v1")  # going back moves the same three
    assert back.moved_tensors == 3 and all(torch.equal(target[k], v1[k]) for k in v1)
    with pytest.raises(tc.AlreadyExists):
        publisher.publish(v1, "v2")  # versions are immutable


def test_publishing_a_version_again_with_the_same_weights_is_a_retry(rt):
    # A trainer whose publish timed out (did it run?) publishes again.
    publisher = tc.WeightPublisher(rt, "retry-model", keep_last=5)
    first = publisher.publish(_state(n=3, fill=1), "v1")
    again = publisher.publish(_state(n=3, fill=1), "v1")
    assert again.published_at == first.published_at and again.tensors == first.tensors
    with pytest.raises(tc.AlreadyExists):
        publisher.publish(_state(n=3, fill=2), "v1")  # other weights: refused
    reshaped = {k: v.reshape(-1) for k, v in _state(n=3, fill=1).items()}
    assert any(t.dim() > 1 for t in _state(n=3, fill=1).values())
    with pytest.raises(tc.AlreadyExists):  # the same bytes in other shapes: other weights
        publisher.publish(reshaped, "v1")
    assert [v.version for v in list_versions(rt, "retry-model")] == ["v1"]


def test_an_artifact_under_the_models_name_that_is_no_version_breaks_nothing(rt):
    publisher = tc.WeightPublisher(rt, "stray-model", keep_last=1)
    publisher.publish(_state(n=2, fill=1), "v1")
    rt.put({"x": torch.ones(2)}, "weights/stray-model@junk")  # someone else's artifact
    assert tc.WeightSubscriber(rt, "stray-model", _state(n=2, fill=0)).sync().version == "v1"
    publisher.publish(_state(n=2, fill=2), "v2")  # and collects v1, not the stranger
    assert [v.version for v in list_versions(rt, "stray-model")] == ["v2"]
    assert rt.info("weights/stray-model@junk").art_id == "weights/stray-model@junk"
    assert tc.WeightSubscriber(rt, "stray-model", _state(n=2, fill=0)).sync().version == "v2"


def test_a_target_of_another_shape_or_dtype_is_refused_unchanged(rt):
    tc.WeightPublisher(rt, "shape-model").publish(
        {"a": torch.arange(4.0), "b": torch.ones(2, 2)}, "v1"
    )
    for bad in ({"b": torch.zeros(3, 3)}, {"b": torch.zeros(2, 2, dtype=torch.float16)}):
        target = {"a": torch.zeros(4), **bad}  # "a" fits; "b" does not
        with pytest.raises(tc.InvalidArgument, match="'b'"):
            tc.WeightSubscriber(rt, "shape-model", target).sync()
        assert torch.equal(target["a"], torch.zeros(4))  # nothing written, not even "a"
    broadcast = {"a": torch.zeros(3, 4)}  # copy_ would broadcast arange(4) into every row
    with pytest.raises(tc.InvalidArgument, match="'a'"):
        tc.WeightSubscriber(rt, "shape-model", broadcast).sync()


def test_keep_last_collects_old_versions(rt):
    publisher = tc.WeightPublisher(rt, "gc-model", keep_last=2)
    for i in range(5):
        publisher.publish(_state(n=3, fill=i), f"s{i}")
    assert [v.version for v in list_versions(rt, "gc-model")] == ["s3", "s4"]
    left = {a.art_id for a in rt.list_artifacts("weights/gc-model@")}
    assert all(a.startswith(("weights/gc-model@s3", "weights/gc-model@s4")) for a in left)
    assert len(left) == 2 * (3 + 1)


def test_concurrent_publish_and_sync_never_mix_versions(rt):
    publisher = tc.WeightPublisher(rt, "race-model", keep_last=10)
    publisher.publish(_state(n=6, fill=0), "r0")
    target = {k: torch.empty_like(v) for k, v in _state(n=6, fill=0).items()}
    sub = tc.WeightSubscriber(rt, "race-model", target)
    done = threading.Event()

    def publish_more():
        for i in range(1, 6):
            publisher.publish(_state(n=6, fill=i), f"r{i}")
        done.set()

    thread = threading.Thread(target=publish_more)
    thread.start()
    seen = set()
    while not done.is_set() or len(seen) < 2:
        result = sub.sync()
        values = {float(t.flatten()[0]) for t in target.values()}
        assert values == {float(result.version[1:])}, (result, values)  # never a mix
        assert all(bool((t == t.flatten()[0]).all()) for t in target.values())
        seen.add(result.version)
        if done.is_set():
            break
    thread.join()
    assert sub.sync().version == "r5"


def test_a_version_collected_mid_sync_leaves_the_target_as_it_was(rt):
    """A publisher with `keep_last=1` collects the version a subscriber is reading: the sync
    fails (NotFound) and the target holds the version it held, never part of each."""
    publisher = tc.WeightPublisher(rt, "collected-model", keep_last=1)
    publisher.publish(_state(n=8, fill=0), "c0")
    target = {k: torch.empty_like(v) for k, v in _state(n=8, fill=0).items()}
    sub = tc.WeightSubscriber(rt, "collected-model", target)
    sub.sync()
    publisher.publish(_state(n=8, fill=1), "c1")
    # The subscriber reads c1 tensor by tensor; after the fourth, c2 is published and c1
    # collected, as a concurrent publisher would.
    calls = []
    real_artifact = rt.artifact

    def artifact_then_collect(art_id, *args, **kwargs):
        calls.append(art_id)
        if len(calls) == 4:
            publisher.publish(_state(n=8, fill=2), "c2")
        return real_artifact(art_id, *args, **kwargs)

    rt.artifact = artifact_then_collect
    try:
        with pytest.raises(tc.NotFound):
            sub.sync("c1")
    finally:
        del rt.artifact
    assert {float(t.flatten()[0]) for t in target.values()} == {0.0}
    assert sub.version == "c0"
    assert sub.sync().version == "c2"
    assert {float(t.flatten()[0]) for t in target.values()} == {2.0}


def test_cli_weights_publish_ls_sync(cluster, tmp_path):
    save_file(_state(n=4), tmp_path / "w.safetensors")
    out = json.loads(
        cluster.tc(
            "weights",
            "publish",
            str(tmp_path / "w.safetensors"),
            "--model",
            "cli-model",
            "--version",
            "a",
            "--json",
            check=True,
        ).stdout
    )
    assert out["tensors"] == 4
    listed = json.loads(
        cluster.tc("weights", "ls", "--model", "cli-model", "--json", check=True).stdout
    )
    assert [v["version"] for v in listed["versions"]] == ["a"]
    synced = json.loads(
        cluster.tc(
            "weights", "sync", "--model", "cli-model", "--to", "worker-2", "--json", check=True
        ).stdout
    )
    assert synced["version"] == "a"
    again = json.loads(
        cluster.tc(
            "weights", "sync", "--model", "cli-model", "--to", "worker-2", "--json", check=True
        ).stdout
    )
    assert again["moved_tensors"] == 0 and again["moved_bytes"] == 0
    missing = cluster.tc("weights", "sync", "--model", "nope", "--to", "worker-2")
    assert missing.returncode == tc.NotFound.exit_code

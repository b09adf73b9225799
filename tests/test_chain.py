"""Chain fan-out: prefetch to several workers as a pipeline (each relays to the next while it
receives). The interleaving itself (READs wait for bytes not yet received) is proven in
native/tests/test_transport.cpp; here: real workers, who served whom, fallbacks, the CLI."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from conftest import start_cluster, wait_dead, wait_until

import tensorcast as tc
from tensorcast.proto import tensorcast_pb2 as pb

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    yield from start_cluster(tmp_path_factory.mktemp("chain"), workers=4, mem="160MiB")


def _names(rt) -> dict[str, str]:
    return {w.worker_id: w.name for w in rt.workers()}


def test_a_chain_relays_each_replica_from_the_one_before(four):
    with four.connect() as rt:
        data = torch.randn(24 * MiB // 4)
        art = rt.put({"w": data, "i": torch.arange(5)}, "chain/a", worker="worker-1")
        replies = art.prefetch_chain(["worker-2", "worker-3", "worker-4"])
        names = _names(rt)
        assert [names[r.source_worker_id] for r in replies] == ["worker-1", "worker-2", "worker-3"]
        assert all(r.bytes_moved == art.size_bytes and not r.already_present for r in replies)
        holders = {names[r.worker_id] for r in rt.info("chain/a").replicas}
        assert holders == {"worker-1", "worker-2", "worker-3", "worker-4"}
        # Again: everyone holds it, nothing moves.
        assert all(r.already_present for r in art.prefetch_chain(["worker-2", "worker-4"]))
        with pytest.raises(tc.InvalidArgument, match="named twice"):
            art.prefetch_chain(["worker-2", "worker-2"])


def test_holders_stay_out_of_the_chain_and_the_cli_prints_it(four):
    with four.connect() as rt:
        data = torch.randn(6 * MiB // 4)
        art = rt.put({"w": data}, "chain/b", worker="worker-1")
        art.prefetch("worker-3")
        out = four.tc(
            "prefetch",
            "chain/b",
            "--to",
            "worker-3",
            "--to",
            "worker-2",
            "--to",
            "worker-4",
            "--json",
            check=True,
        ).stdout
        rows = json.loads(out)["chain"]
        names = _names(rt)
        assert [r["worker"] for r in rows] == ["worker-3", "worker-2", "worker-4"]
        assert rows[0]["already_present"] and rows[0]["bytes_moved"] == 0
        # worker-3 held it: worker-2 heads the chain (best replica), worker-4 follows it.
        assert names[rows[2]["source_worker_id"]] == "worker-2"
        assert rows[1]["bytes_moved"] == rows[2]["bytes_moved"] == art.size_bytes
        bad = four.tc("prefetch", "chain/b", "--to", "worker-2", "--to", "worker-9")
        assert bad.returncode == tc.NotFound.exit_code and "worker-9" in bad.stderr


def test_a_link_that_cannot_relay_sends_the_next_to_the_usual_sources(four):
    with four.connect() as rt:
        data = torch.randn(4 * MiB // 4)
        art = rt.put({"w": data}, "chain/c", worker="worker-1")
        ids = {n: i for i, n in _names(rt).items()}
        # worker-3 neither holds nor receives it: worker-2 waits a little, then pulls from
        # worker-1 (a chain's link whose own pull failed looks the same).
        started = time.monotonic()
        reply = rt.worker_stub(rt.resolve_worker("worker-2")).call(
            "Prefetch",
            pb.PrefetchRequest(
                content_id=art.content_id, timeout_ms=60_000, relay_from=ids["worker-3"]
            ),
            timeout_s=70,
        )
        assert reply.source_worker_id == ids["worker-1"] and reply.retries == 1
        assert time.monotonic() - started >= 4.5  # it did wait for worker-3 first
        # The relayed-to replica is complete on its own: read it with worker-1 gone.
        assert torch.equal(rt.artifact("chain/c").tensor_dict()["w"], data)


def test_a_chain_survives_its_source_dying_after_it(tmp_path):
    for c in start_cluster(tmp_path / "state", workers=3, mem="96MiB"):
        with c.connect() as rt:
            data = torch.randn(20 * MiB // 4)
            art = rt.put({"w": data}, "chain/d", worker="worker-1")
            art.prefetch_chain(["worker-2", "worker-3"])
            os.kill(c.pid("worker-1"), 9)
            os.kill(c.pid("worker-2"), 9)
            wait_dead(rt, "worker-1")
            wait_dead(rt, "worker-2")
            assert torch.equal(rt.artifact("chain/d").tensor_dict()["w"], data)


def test_an_empty_artifact_goes_down_a_chain(four):
    with four.connect() as rt:
        art = rt.put({"e": torch.empty(0), "z": torch.zeros(0, 3)}, "chain/e", worker="worker-1")
        assert art.size_bytes == 0
        replies = art.prefetch_chain(["worker-2", "worker-3"])
        assert all(not r.already_present and r.bytes_moved == 0 for r in replies)
        holders = {_names(rt)[r.worker_id] for r in rt.info("chain/e").replicas}
        assert {"worker-2", "worker-3"} <= holders
        got = rt.artifact("chain/e").tensor_dict()
        assert got["e"].shape == (0,) and got["z"].shape == (0, 3)


def test_a_pull_that_cannot_reserve_closes_its_ticket_at_the_source(tmp_path):
    for c in start_cluster(tmp_path / "state", workers=2, mem="64MiB"):
        with c.connect() as rt:
            art = rt.put({"w": torch.randn(40 * MiB // 4)}, "full/a", worker="worker-1")
            rt.put({"w": torch.randn(40 * MiB // 4)}, "full/b", worker="worker-2")  # last copy
            source = rt.worker_stub(rt.resolve_worker("worker-1"))
            holds = source.call("Status", pb.Empty()).num_holds
            with pytest.raises(tc.ResourceExhausted):
                art.prefetch("worker-2")
            # The ticket worker-2 opened on worker-1 (a hold on the content) before finding no
            # room is closed, not left to expire.
            wait_until(lambda s=source, h=holds: s.call("Status", pb.Empty()).num_holds == h, 10)
            assert [r.worker_id for r in rt.info("full/a").replicas] == [
                rt.resolve_worker("worker-1").worker_id
            ]


def test_prefetch_timeouts_past_a_uint32_of_milliseconds_are_clear_errors(four):
    """A prefetch's timeout travels in uint32 milliseconds and the ticket it opens asks for
    5 s more: near the top, that overflowed inside the worker (a bare ValueError, as an
    internal error, and no source tried). The SDK refuses more than a day; a worker given a
    timeout at the top of the range still prefetches."""
    with four.connect() as rt:
        rt.put({"w": torch.arange(64.0)}, "long-wait", worker="worker-1")
        art = rt.artifact("long-wait")
        with pytest.raises(tc.InvalidArgument, match="timeout_s"):
            art.prefetch("worker-2", timeout_s=5e6)
        target = rt.resolve_worker("worker-2")
        reply = rt.worker_stub(target).call(
            "Prefetch",
            pb.PrefetchRequest(content_id=art.content_id, timeout_ms=(1 << 32) - 1),
            timeout_s=60,
        )
        assert reply.bytes_moved == 64 * 4 and not reply.already_present

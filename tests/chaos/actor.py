"""One chaos actor: a real client process looping one kind of operation until it is killed.

    python tests/chaos/actor.py KIND STATE_DIR JOURNAL PREFIX SEED [TARGET_WORKER]

Each acknowledged operation is appended to JOURNAL (one JSON line, flushed before the next
operation starts), so the round that kills this process knows exactly what was promised. Every
read checks the bytes against what was written; a mismatch is journaled as {"wrong": ...}, which
fails the round. Expected errors of a cluster under fire (a worker killed under us) are journaled
as {"error": kind} and the loop goes on; anything else ends the process with a traceback.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

import tensorcast as tc

# Values repeat across actors and iterations so that contents are shared and deduplicated.
DISTINCT_VALUES = 5
ERROR_PAUSE_S = 0.1
TOLERATED = (tc.Unavailable, tc.DeadlineExceeded, tc.FencingError, tc.ResourceExhausted)


def expected(value: float, numel: int) -> torch.Tensor:
    return torch.full((numel,), value)


class Journal:
    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def write(self, **record: object) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def put_loop(rt, journal, prefix, rnd, numel, delete_every):
    for i in range(10**9):
        name = f"{prefix}/a{i}"
        value = float(rnd.randrange(DISTINCT_VALUES))
        rt.put({"w": expected(value, numel)}, name)
        journal.write(op="put", name=name, value=value, numel=numel)
        got = rt.artifact(name).tensor_dict()["w"]
        if not torch.equal(got, expected(value, numel)):
            journal.write(wrong=name)
        if i % delete_every == 0:
            journal.write(op="delete", name=name)  # before: a kill may cut the call short
            rt.delete(name)


def prefetch_loop(rt, journal, prefix, rnd, target):
    for i in range(10**9):
        name = f"{prefix}/f{i}"
        value = float(i)
        art = rt.put({"w": expected(value, 1 << 20)}, name, worker="worker-1")  # 4 MiB
        journal.write(op="put", name=name, value=value, numel=1 << 20)
        art.prefetch(target)
        journal.write(op="prefetch", name=name, worker=target)


def pin_loop(rt, journal, prefix, rnd, target):
    for i in range(10**9):
        name = f"{prefix}/p{i}"
        value = float(i)
        art = rt.put({"w": expected(value, 1 << 16)}, name, worker="worker-1")
        journal.write(op="put", name=name, value=value, numel=1 << 16)
        art.pin(target)
        journal.write(op="pin", name=name, worker=target)
        if i % 2:
            art.unpin(target)
            journal.write(op="unpin", name=name, worker=target)


def pages_loop(rt, journal, prefix, rnd, ttl_s):
    pages = rt.pages()
    for i in range(10**9):
        batch = {
            f"{prefix}/k{i}/{j}": expected(float(rnd.randrange(1000)), 1 << 16) for j in range(4)
        }
        pages.put_pages(batch, ttl_s=ttl_s)
        for key, page in batch.items():
            journal.write(op="page", key=key, value=float(page[0]), numel=page.numel())
        for key, got in zip(batch, pages.get_pages(list(batch))):
            # Absent is allowed (a home died, a lease moved); different bytes never are.
            if got is not None and not torch.equal(got.tensor(), batch[key]):
                journal.write(wrong=key)


def weights_loop(rt, journal, prefix, rnd):
    model = prefix.replace("/", "-")
    publisher = tc.WeightPublisher(rt, model, keep_last=2)
    target = {f"layer{j}": torch.zeros(1 << 14) for j in range(4)}
    subscriber = tc.WeightSubscriber(rt, model, target)
    for i in range(10**9):
        # Only some tensors change between versions: a sync moves just those.
        state = {n: expected(float(rnd.randrange(3)), 1 << 14) for n in target}
        publisher.publish(state, f"v{i}")
        values = {n: float(t[0]) for n, t in state.items()}
        journal.write(op="publish", model=model, version=f"v{i}", values=values, numel=1 << 14)
        subscriber.sync(f"v{i}")
        if any(not torch.equal(target[n], state[n]) for n in target):
            journal.write(wrong=f"{model}@v{i}")


def plan_loop(rt, journal, prefix, rnd, target):
    for i in range(10**9):
        name = f"{prefix}/q{i}"
        value = float(i)
        rt.put({"w": expected(value, 1 << 18)}, name, worker="worker-1")
        journal.write(op="put", name=name, value=value, numel=1 << 18)
        key = f"{prefix}-plan-{i}"
        journal.write(op="plan-begin", key=key, name=name, worker=target)
        plan = tc.Plan(tc.CallContext(deadline_ms=60_000, idempotency_key=key))
        plan.on_worker(target).prefetch(name)
        plan.on_worker(target).pin(name, after=[])
        result = plan.run(rt)
        journal.write(op="plan", key=key, name=name, worker=target, result=result)


def migrate_loop(rt, journal, prefix, rnd, target):
    from tensorcast.engine.server import engine_request
    from tensorcast.sdk.migrate import migrate

    endpoints = {i.instance_id: i.endpoint for i in rt.instances() if i.alive}
    prompt = [rnd.randrange(128) for _ in range(24)]
    reference = engine_request(
        endpoints["chaos-a"],
        "POST",
        "/generate",
        {"req_id": f"{prefix}-ref", "prompt_ids": prompt, "max_new_tokens": 12},
    )["tokens"]
    for i in range(10**9):
        req = f"{prefix}-r{i}"
        body = {"req_id": req, "prompt_ids": prompt, "max_new_tokens": 6}
        first = engine_request(endpoints["chaos-a"], "POST", "/generate", body)["tokens"]
        key = f"{prefix}-move-{i}"
        journal.write(op="migrate-begin", key=key, req=req)
        result = migrate(rt, req, "chaos-a", "chaos-b", idempotency_key=key, ttl_s=60)
        journal.write(op="migrate", key=key, req=req, result=result)
        rest = engine_request(
            endpoints["chaos-b"],
            "POST",
            "/generate",
            {"req_id": req, "prompt_ids": None, "max_new_tokens": 6},
        )["tokens"]
        if first + rest != reference:
            journal.write(wrong=req, got=first + rest, reference=reference)
        engine_request(endpoints["chaos-b"], "POST", "/evict", {"req_id": req})


def main() -> None:
    kind, state_dir, journal_path, prefix, seed = sys.argv[1:6]
    target = sys.argv[6] if len(sys.argv) > 6 else ""
    rnd = random.Random(int(seed))
    journal = Journal(journal_path)
    loops = {
        "put": lambda rt, p: put_loop(rt, journal, p, rnd, 1 << 14, 3),
        "dedupe": lambda rt, p: put_loop(rt, journal, p, rnd, 16, 1),
        "prefetch": lambda rt, p: prefetch_loop(rt, journal, p, rnd, target),
        "pin": lambda rt, p: pin_loop(rt, journal, p, rnd, target),
        "pages": lambda rt, p: pages_loop(rt, journal, p, rnd, 2.0),
        "weights": lambda rt, p: weights_loop(rt, journal, p, rnd),
        "plan": lambda rt, p: plan_loop(rt, journal, p, rnd, target),
        "migrate": lambda rt, p: migrate_loop(rt, journal, p, rnd, target),
    }
    with tc.connect(state_dir=Path(state_dir)) as rt:
        journal.write(started=True)
        for attempt in range(1000):  # bounded: a cluster that fails every call ends the actor
            try:
                loops[kind](rt, f"{prefix}/{attempt}")  # a fresh namespace after each error
            except TOLERATED as e:  # a worker died under us: note it, go on
                journal.write(error=type(e).__name__, message=str(e)[:300])
                # A dead target fails each call at once: pace the retries so the actor lives
                # (≥ 100 s) until its round kills it rather than spending its attempts in a blink.
                time.sleep(ERROR_PAUSE_S)


if __name__ == "__main__":
    main()

"""The worker's side of delta heartbeats (worker/inventory.py): what each beat reports given
what the store answered before. The store's side is in tests/test_store_contract.py, both
together in tests/test_control_plane.py."""

from __future__ import annotations

from tensorcast.store.base import BeatResult, Inventory
from tensorcast.worker.inventory import FULL_INVENTORY_EVERY_S, InventoryReporter

A, B, C = ("a", "cpu"), ("b", "cpu"), ("c", "disk")


def _beat(reporter: InventoryReporter, held: dict, now: float, result=None) -> Inventory:
    sent = reporter.report(held, now)
    reporter.answered(sent, held, result or BeatResult([]), now)
    return sent


def test_a_beat_reports_what_changed_since_the_acknowledged_inventory():
    r = InventoryReporter()
    first = _beat(r, {A: False, B: False}, 0.0)
    assert (first.is_full, dict(first.held), first.epoch) == (True, {A: False, B: False}, 1)
    second = _beat(r, {A: True, B: False, C: False}, 1.0)  # a pinned, c spilled to disk
    assert (second.base_epoch, dict(second.held), second.removed) == (1, {A: True, C: False}, set())
    third = _beat(r, {A: True}, 2.0)
    assert (third.base_epoch, dict(third.held), third.removed) == (2, {}, {B, C})
    assert _beat(r, {A: True}, 3.0).held == {} and r.report({A: True}, 3.5).base_epoch == 4


def test_an_unanswered_beat_is_covered_by_the_next_delta():
    r = InventoryReporter()
    _beat(r, {A: False}, 0.0)
    r.report({A: False, B: False}, 1.0)  # lost: no answer
    again = r.report({A: False, B: False, C: False}, 2.0)
    assert (again.base_epoch, dict(again.held)) == (1, {B: False, C: False})


def test_refused_deltas_kept_removals_and_drops_are_sent_again():
    r = InventoryReporter()
    _beat(r, {A: False, B: False}, 0.0)
    # The store kept b's row (younger than its grace): b is reported removed again.
    _beat(r, {A: False}, 1.0, BeatResult([], kept=frozenset({B})))
    assert r.report({A: False}, 2.0).removed == {B}
    _beat(r, {A: False}, 2.0)
    assert r.report({A: False}, 3.0).removed == set()
    # Told to drop a, the worker still holds it (a newer commit): reported again next time.
    _beat(r, {A: False}, 3.0, BeatResult(["a"]))
    assert dict(r.report({A: False}, 4.0).held) == {A: False}
    # A refused delta: the next beat is the whole inventory.
    _beat(r, {A: False}, 4.0, BeatResult([], resync=True))
    assert r.report({A: False}, 5.0).is_full
    r.forget()  # registered again
    assert r.report({A: False}, 5.5).is_full


def test_the_whole_inventory_goes_again_now_and_then():
    r = InventoryReporter()
    _beat(r, {A: False}, 0.0)
    assert not _beat(r, {A: False}, FULL_INVENTORY_EVERY_S - 0.1).is_full
    assert _beat(r, {A: False}, FULL_INVENTORY_EVERY_S).is_full
    assert not _beat(r, {A: False}, FULL_INVENTORY_EVERY_S + 1).is_full

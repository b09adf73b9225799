"""The baseline routing choices, pure (randomness and state are passed in).

- round-robin: the next instance in id order after the previous pick.
- load-aware: power of two choices (Mitzenmacher): two distinct instances at random, the less
  loaded wins (ties: the first drawn).
- cache-aware: the SGLang gateway's rule over the router's own picture of each instance's cache
  (`PrefixIndex`): if the load is imbalanced (max - min > balance_abs and max > balance_rel *
  min) the least loaded instance; else the instance with the longest prefix match when it
  covers at least `cache_threshold` of the request, else the one with the smallest picture
  (most room).
- least-busy (the rebalance router's choice for a new session): the instance with the fewest
  turns in flight, then the one owning the fewest active sessions, then the smallest id.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from tensorcast.errors import Unavailable


def round_robin(instances: Sequence[str], previous: str | None) -> str:
    order = sorted(instances)
    if not order:
        raise Unavailable("no live instance to route to")
    if previous is None or previous not in order:
        return (
            order[0]
            if previous is None
            else min((i for i in order if i > previous), default=order[0])
        )
    return order[(order.index(previous) + 1) % len(order)]


def power_of_two(instances: Sequence[str], loads: Mapping[str, float], rng: random.Random) -> str:
    order = sorted(instances)
    if not order:
        raise Unavailable("no live instance to route to")
    if len(order) == 1:
        return order[0]
    a, b = rng.sample(order, 2)
    return b if loads.get(b, 0.0) < loads.get(a, 0.0) else a


def prefix_keys(tokens: Sequence[int], block_tokens: int) -> list[bytes]:
    """Chain hashes of full blocks (the same scheme as the emulated engine's cache)."""
    keys: list[bytes] = []
    previous = b""
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(array("I", tokens[start : start + block_tokens]).tobytes())
        previous = digest.digest()
        keys.append(previous)
    return keys


class PrefixIndex:
    """Per instance, the blocks the router sent there (LRU, `capacity_blocks` each)."""

    def __init__(self, capacity_blocks: int = 1 << 16) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def match(self, instance: str, keys: Sequence[bytes]) -> int:
        blocks = self._blocks.get(instance)
        if not blocks:
            return 0
        n = 0
        for key in keys:
            if key not in blocks:
                break
            n += 1
        return n

    def insert(self, instance: str, keys: Sequence[bytes]) -> None:
        blocks = self._blocks.setdefault(instance, OrderedDict())
        for key in reversed(keys):  # tail older than head, as the engine's cache
            blocks[key] = None
            blocks.move_to_end(key)
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)

    def size(self, instance: str) -> int:
        return len(self._blocks.get(instance, ()))

    def forget(self, instance: str, keys: Sequence[bytes] = ()) -> None:
        if not keys:
            self._blocks.pop(instance, None)
            return
        blocks = self._blocks.get(instance)
        for key in keys:
            if blocks is not None:
                blocks.pop(key, None)


def cache_aware(
    instances: Sequence[str],
    loads: Mapping[str, float],
    index: PrefixIndex,
    keys: Sequence[bytes],
    cache_threshold: float = 0.5,
    balance_abs: float = 32.0,
    balance_rel: float = 1.5,
) -> str:
    order = sorted(instances)
    if not order:
        raise Unavailable("no live instance to route to")
    values = [loads.get(i, 0.0) for i in order]
    high, low = max(values), min(values)
    if high - low > balance_abs and high > balance_rel * low:
        return min(order, key=lambda i: (loads.get(i, 0.0), i))
    best = max(order, key=lambda i: (index.match(i, keys), -loads.get(i, 0.0)))
    if keys and index.match(best, keys) / len(keys) >= cache_threshold:
        return best
    return min(order, key=lambda i: (index.size(i), loads.get(i, 0.0), i))


def least_busy(
    instances: Sequence[str], loads: Mapping[str, float], occupancy: Mapping[str, int]
) -> str:
    order = sorted(instances)
    if not order:
        raise Unavailable("no live instance to route to")
    return min(order, key=lambda i: (loads.get(i, 0.0), occupancy.get(i, 0), i))

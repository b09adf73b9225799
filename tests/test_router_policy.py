"""Algorithm 1 (tensorcast/router/policy.py): golden transcripts (inputs -> decision, worked out
by hand from the paper's pseudo-code) and properties checked against a brute-force reading."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorcast.errors import InvalidArgument, Unavailable
from tensorcast.router.policy import (
    LoadSample,
    RebalanceParams,
    RequestState,
    decide,
    score,
    tick,
    update_loads,
)

PARAMS = RebalanceParams(alpha=0.5, theta_abs=2.0, theta_rel=1.5, horizon_s=60.0, penalty=1.0)


def samples(**loads: tuple[int, int]) -> list[LoadSample]:
    return [LoadSample(i, w, r) for i, (w, r) in loads.items()]


# Each tick: (now, {instance: (waiting, running)}, requests, expected loads after the EWMA,
# expected (req, source, target, score) or None, expected reason prefix).
TRANSCRIPT = [
    (
        100.0,
        {"a": (3, 1), "b": (0, 1), "c": (0, 0)},
        [
            RequestState("r1", "a", 1000, last_active=100.0),  # score 1000
            RequestState("r2", "a", 3000, last_active=40.0),  # 3000 * e^-1 = 1103.64
            RequestState("r3", "a", 5000, last_active=100.0, running=True),  # ineligible
            RequestState("r4", "a", 8000, last_active=100.0, migrating=True),  # ineligible
            RequestState("r5", "b", 9000, last_active=100.0),  # not on the source
        ],
        # First samples start the EWMA: a=4, b=1, c=0; gap 4, ratio 4/max(0,1)=4.
        {"a": 4.0, "b": 1.0, "c": 0.0},
        ("r2", "a", "c", 1103.638323514327),
        "migrate",
    ),
    (
        101.0,
        {"a": (1, 0), "b": (0, 1), "c": (2, 1)},
        [RequestState("r1", "a", 1000, last_active=100.0)],
        # a = .5*1 + .5*4 = 2.5, b = .5*1 + .5*1 = 1, c = .5*3 + .5*0 = 1.5: gap 1.5 < 2.
        {"a": 2.5, "b": 1.0, "c": 1.5},
        None,
        "balanced: gap",
    ),
    (
        102.0,
        {"a": (5, 0), "b": (0, 0), "c": (3, 0)},
        [
            RequestState("r2", "a", 3000, last_active=40.0, migrations=1),  # 533.73
            RequestState("r6", "a", 600, last_active=102.0),  # 600
        ],
        # a = 3.75, b = 0.5, c = 2.25: gap 3.25, ratio 3.75 / max(0.5, 1) = 3.75.
        {"a": 3.75, "b": 0.5, "c": 2.25},
        ("r6", "a", "b", 600.0),
        "migrate",
    ),
    (
        103.0,
        {"a": (2, 0), "b": (1, 0), "d": (0, 0)},  # c detached, d joined
        [RequestState("r7", "a", 4000, last_active=103.0, running=True)],
        # a = 2.875, b = 0.75, d = 0 (first sample): gap 2.875, ratio 2.875, but nothing eligible.
        {"a": 2.875, "b": 0.75, "d": 0.0},
        None,
        "no eligible request on a",
    ),
]


def test_golden_transcript_of_four_ticks():
    loads: dict[str, float] = {}
    for now, sampled, requests, want_loads, want, reason in TRANSCRIPT:
        result = tick(loads, samples(**sampled), requests, now, PARAMS)
        assert result.loads == pytest.approx(want_loads)
        assert result.reason.startswith(reason), result.reason
        if want is None:
            assert result.decision is None
        else:
            assert result.decision is not None
            got = result.decision
            assert (got.req_id, got.source, got.target) == want[:3]
            assert got.score == pytest.approx(want[3])
        loads = result.loads


@pytest.mark.parametrize(
    ("loads", "want", "reason"),
    [
        ({"a": 10.0, "b": 8.0}, None, "balanced: ratio 1.25 < theta_rel 1.5"),  # gap 2 is enough
        ({"a": 2.9, "b": 1.0}, None, "balanced: gap 1.9 < theta_abs 2"),
        ({"a": 3.0, "b": 1.0}, ("a", "b"), "migrate"),  # gap 2 >= 2 and ratio 3 >= 1.5: both met
        ({"a": 3.0, "b": 3.0, "c": 0.0}, ("a", "c"), "migrate"),  # tied source: smallest id
        ({"x": 0.0, "b": 5.0, "a": 0.0}, ("b", "a"), "migrate"),  # tied target: smallest id
        ({"a": 0.5, "b": 0.0}, None, "balanced: gap"),  # ratio uses max(L_dst, 1)
        ({"a": 7.0}, None, "1 instance(s)"),
        ({}, None, "0 instance(s)"),
    ],
)
def test_gates_and_ties(loads, want, reason):
    requests = [RequestState("r", i, 100, last_active=0.0) for i in loads]
    result = decide(loads, requests, 0.0, PARAMS)
    assert result.reason.startswith(reason), result.reason
    if want is None:
        assert result.decision is None
    else:
        assert result.decision is not None
        assert (result.decision.source, result.decision.target) == want


def test_score_factors_and_ties():
    now = 1000.0
    fresh = RequestState("b", "a", 500, last_active=now)
    assert score(fresh, now, PARAMS) == 500.0
    idle = RequestState("c", "a", 500, last_active=now - 120.0)
    assert score(idle, now, PARAMS) == pytest.approx(500 * math.exp(-2))
    moved_twice = RequestState("d", "a", 500, last_active=now, migrations=2)
    assert score(moved_twice, now, PARAMS) == pytest.approx(500 / 3)
    future = RequestState("e", "a", 500, last_active=now + 5.0)  # another process's clock
    assert score(future, now, PARAMS) == 500.0
    # Equal scores: the smaller request id is chosen, whatever the input order.
    twin = RequestState("a", "a", 500, last_active=now)
    for order in ([fresh, twin], [twin, fresh]):
        result = decide({"a": 9.0, "b": 0.0}, order, now, PARAMS)
        assert result.decision is not None and result.decision.req_id == "a"


def test_penalty_stops_ping_pong():
    """A request that moved before loses to a shorter one that never moved (lambda = 1)."""
    requests = [
        RequestState("big", "a", 3000, last_active=0.0, migrations=3),  # 750
        RequestState("small", "a", 1000, last_active=0.0),  # 1000
    ]
    result = decide({"a": 10.0, "b": 0.0}, requests, 0.0, PARAMS)
    assert result.decision is not None and result.decision.req_id == "small"
    no_penalty = RebalanceParams(penalty=0.0)
    result = decide({"a": 10.0, "b": 0.0}, requests, 0.0, no_penalty)
    assert result.decision is not None and result.decision.req_id == "big"


def test_alpha_one_keeps_no_history():
    loads = update_loads({"a": 100.0}, samples(a=(1, 1)), alpha=1.0)
    assert loads == {"a": 2.0}
    loads = update_loads({"a": 100.0}, samples(a=(1, 1)), alpha=0.25)
    assert loads == {"a": pytest.approx(0.25 * 2 + 0.75 * 100)}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"alpha": 0.0},
        {"alpha": 1.5},
        {"theta_abs": -1.0},
        {"theta_rel": -0.1},
        {"horizon_s": 0.0},
        {"penalty": -1.0},
        {"alpha": float("nan")},
        {"horizon_s": float("inf")},
        {"theta_abs": True},
    ],
)
def test_bad_parameters_are_invalid_arguments(kwargs):
    with pytest.raises(InvalidArgument):
        RebalanceParams(**kwargs)


def test_bad_observations_are_invalid_arguments():
    with pytest.raises(InvalidArgument, match="sampled twice"):
        update_loads({}, [LoadSample("a", 1, 0), LoadSample("a", 2, 0)], 0.5)
    with pytest.raises(InvalidArgument, match="negative load"):
        update_loads({}, [LoadSample("a", -1, 0)], 0.5)
    twice = [RequestState("r", "a", 1, 0.0), RequestState("r", "a", 2, 0.0)]
    with pytest.raises(InvalidArgument, match="listed twice"):
        decide({"a": 9.0, "b": 0.0}, twice, 0.0, PARAMS)


# -- properties: the policy equals a direct, brute-force reading of the pseudo-code ------------

instance_ids = st.sampled_from(["i0", "i1", "i2", "i3", "i4"])
request_st = st.builds(
    RequestState,
    req_id=st.text("abcdef", min_size=1, max_size=3),
    instance_id=instance_ids,
    tokens=st.integers(0, 100_000),
    last_active=st.floats(0, 1000),
    migrations=st.integers(0, 5),
    running=st.booleans(),
    migrating=st.booleans(),
)
params_st = st.builds(
    RebalanceParams,
    alpha=st.floats(0.01, 1.0),
    theta_abs=st.floats(0, 10),
    theta_rel=st.floats(0, 4),
    horizon_s=st.floats(0.1, 500),
    penalty=st.floats(0, 3),
)


def brute_force(previous, sampled, requests, now, params):
    loads = {}
    for s in sampled:
        old = previous.get(s.instance_id)
        new = s.waiting + s.running
        loads[s.instance_id] = new if old is None else params.alpha * new + (1 - params.alpha) * old
    if len(loads) < 2:
        return loads, None
    top = max(loads.values())
    source = sorted(i for i, v in loads.items() if v == top)[0]
    rest = {i: v for i, v in loads.items() if i != source}
    low = min(rest.values())
    target = sorted(i for i, v in rest.items() if v == low)[0]
    gap = loads[source] - loads[target]
    ratio = loads[source] / max(loads[target], 1)
    if gap < params.theta_abs or ratio < params.theta_rel:
        return loads, None
    eligible = [
        r for r in requests if r.instance_id == source and not r.running and not r.migrating
    ]
    if not eligible:
        return loads, None
    best = None
    for r in eligible:
        s = (
            r.tokens
            * math.exp(-max(0.0, now - r.last_active) / params.horizon_s)
            / (1 + params.penalty * r.migrations)
        )
        if best is None or s > best[0] or (s == best[0] and r.req_id < best[1].req_id):
            best = (s, r)
    assert best is not None
    return loads, (best[1].req_id, source, target)


@settings(max_examples=300, deadline=None)
@given(
    previous=st.dictionaries(instance_ids, st.floats(0, 50), max_size=5),
    loads=st.dictionaries(
        instance_ids, st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=5
    ),
    requests=st.lists(request_st, max_size=12, unique_by=lambda r: r.req_id),
    now=st.floats(0, 1000),
    params=params_st,
    seed=st.integers(0, 2**16),
)
def test_policy_equals_the_pseudo_code(previous, loads, requests, now, params, seed):
    sampled = samples(**loads)
    want_loads, want = brute_force(previous, sampled, requests, now, params)
    result = tick(previous, sampled, requests, now, params)
    assert result.loads == pytest.approx(want_loads)
    got = result.decision
    assert (None if got is None else (got.req_id, got.source, got.target)) == want
    if got is not None:  # never a running or migrating request, never to itself
        chosen = next(r for r in requests if r.req_id == got.req_id)
        assert not chosen.running and not chosen.migrating and got.source != got.target
    # Input order never matters.
    rng = random.Random(seed)
    shuffled_samples, shuffled_requests = sampled[:], requests[:]
    rng.shuffle(shuffled_samples)
    rng.shuffle(shuffled_requests)
    again = tick(previous, shuffled_samples, shuffled_requests, now, params)
    assert again.decision == result.decision and again.loads == result.loads


@settings(max_examples=100, deadline=None)
@given(
    loads=st.dictionaries(instance_ids, st.floats(0, 100), min_size=2, max_size=5),
    requests=st.lists(request_st, max_size=12, unique_by=lambda r: r.req_id),
)
def test_no_decision_when_the_gap_gate_is_closed(loads, requests):
    gap = max(loads.values()) - min(loads.values())
    closed = RebalanceParams(theta_abs=gap + 0.001)
    assert decide(loads, requests, 500.0, closed).decision is None


# -- the baseline routing choices -----------------------------------------------------------


def test_round_robin_cycles_in_id_order():
    from tensorcast.router.baselines import round_robin

    picks, previous = [], None
    for _ in range(5):
        previous = round_robin(["c", "a", "b"], previous)
        picks.append(previous)
    assert picks == ["a", "b", "c", "a", "b"]
    assert round_robin(["a", "c"], "b") == "c"  # the previous pick left: the next one after it


def test_power_of_two_takes_the_less_loaded_of_two():
    from tensorcast.router.baselines import power_of_two

    rng = random.Random(0)
    loads = {"a": 5.0, "b": 1.0, "c": 9.0}
    picks = [power_of_two(["a", "b", "c"], loads, rng) for _ in range(200)]
    assert "c" not in picks  # c is never the less loaded of any pair
    assert picks.count("b") > picks.count("a")  # b wins every pair it is drawn in


def test_cache_aware_prefers_the_longest_prefix_unless_imbalanced():
    from tensorcast.router.baselines import PrefixIndex, cache_aware, prefix_keys

    index = PrefixIndex()
    keys = prefix_keys(list(range(320)), 32)
    assert len(keys) == 10
    index.insert("b", keys[:8])
    index.insert("a", keys[:2])
    assert cache_aware(["a", "b", "c"], {}, index, keys) == "b"  # 8/10 >= 0.5
    # Below the threshold: the instance with the smallest picture of the cache (c: empty).
    assert cache_aware(["a", "b", "c"], {}, index, prefix_keys(list(range(999, 1319)), 32)) == "c"
    # Imbalanced (gap > 32 and ratio > 1.5): the least loaded, whatever the match.
    loads = {"a": 10.0, "b": 50.0, "c": 12.0}
    assert cache_aware(["a", "b", "c"], loads, index, keys) == "a"


def test_least_busy_takes_the_shortest_queue_then_the_fewest_sessions():
    from tensorcast.router.baselines import least_busy

    loads = {"a": 1.0, "b": 0.0, "c": 0.0}
    assert least_busy(["c", "a", "b"], loads, {"b": 3, "c": 2}) == "c"  # b and c idle: c owns fewer
    assert least_busy(["a", "b"], {"a": 0.0, "b": 2.0}, {"a": 9}) == "a"  # in flight first
    assert least_busy(["b", "a"], {}, {}) == "a"  # all equal: the smallest id
    with pytest.raises(Unavailable):
        least_busy([], {}, {})

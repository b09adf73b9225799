"""The agent workload generator: seeded, order-independent, with the paper's think-time presets
and a time-compression factor that divides think times and nothing else."""

from __future__ import annotations

import math
import statistics

import pytest

from tensorcast.errors import InvalidArgument
from tensorcast.router.workload import PRESETS, LogNormal, Workload


def test_same_seed_same_sessions_in_any_order():
    a, b = Workload(seed=7), Workload(seed=7)
    forward = a.sessions(20)
    backward = [b.session(k) for k in reversed(range(20))][::-1]
    assert forward == backward
    assert forward[3].append_ids(2, a.vocab) == backward[3].append_ids(2, b.vocab)
    other = Workload(seed=8).sessions(20)
    assert [s.turns for s in other] != [s.turns for s in forward]


@pytest.mark.parametrize(
    ("preset", "mu", "sigma"), [("fast", 2.1, 0.6), ("medium", 3.0, 0.8), ("slow", 4.1, 1.0)]
)
def test_presets_are_the_papers_lognormals(preset, mu, sigma):
    assert (PRESETS[preset].mu, PRESETS[preset].sigma) == (mu, sigma)
    w = Workload(preset=preset, seed=1)
    thinks = [t.think_s for s in w.sessions(300) for t in s.turns]
    assert len(thinks) > 3000
    logs = [math.log(x) for x in thinks]
    assert statistics.median(thinks) == pytest.approx(math.exp(mu), rel=0.08)
    assert statistics.stdev(logs) == pytest.approx(sigma, rel=0.08)


def test_time_compression_divides_think_times_only():
    plain = Workload(preset="slow", seed=3).sessions(10)
    fast = Workload(preset="slow", seed=3, time_compression=20.0).sessions(10)
    for p, f in zip(plain, fast):
        assert len(p.turns) == len(f.turns)
        for tp, tf in zip(p.turns, f.turns):
            assert tf.think_s == pytest.approx(tp.think_s / 20.0)
            assert (tf.append_tokens, tf.output_tokens) == (tp.append_tokens, tp.output_tokens)


def test_sessions_fit_the_context_and_the_documented_ranges():
    w = Workload(seed=5, max_context_tokens=16384)
    sessions = w.sessions(200)
    assert len({s.session_id for s in sessions}) == 200
    lengths = []
    for s in sessions:
        assert 1 <= len(s.turns) <= 80
        assert 64 <= s.turns[0].append_tokens <= 4096
        assert all(16 <= t.append_tokens <= 8192 for t in s.turns[1:])
        assert all(8 <= t.output_tokens <= 1024 for t in s.turns)
        context = w.system_tokens + sum(t.append_tokens + t.output_tokens for t in s.turns)
        assert context <= w.max_context_tokens
        lengths.append(len(s.turns))
    assert 8 <= statistics.median(lengths) <= 22  # median 20 planned, cut by the context cap
    # Every session starts with the same system prompt, then its own tokens.
    assert w.system_ids() == Workload(seed=5).system_ids()
    firsts = {tuple(s.append_ids(0, w.vocab)[:16]) for s in sessions}
    assert len(firsts) == 200


def test_lognormal_clips():
    import random

    d = LogNormal(0.0, 3.0, low=1.0, high=2.0)
    rng = random.Random(0)
    values = [d.sample(rng) for _ in range(200)]
    assert min(values) == 1.0 and max(values) == 2.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"preset": "warp"},
        {"time_compression": 0.0},
        {"time_compression": -1.0},
        {"time_compression": math.inf},
        {"vocab": 1},
        {"max_context_tokens": 100},
    ],
)
def test_bad_workloads_are_invalid_arguments(kwargs):
    with pytest.raises(InvalidArgument):
        Workload(**kwargs)
    with pytest.raises(InvalidArgument):
        Workload().session(-1)

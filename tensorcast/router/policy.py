"""Algorithm 1 of the paper (appendix A): the router's request rebalancing policy, as pure code.

At each tick:

    foreach instance i:  L_i <- alpha * Load(i) + (1 - alpha) * L_i      (EWMA of waiting+running)
    src <- argmax_i L_i ;  dst <- argmin_{i != src} L_i
    gap <- L_src - L_dst ;  ratio <- L_src / max(L_dst, 1)
    if gap < theta_abs or ratio < theta_rel:  no rebalance
    R <- requests resident on src that are neither running nor migrating
    if R is empty:  no rebalance
    score_r <- tokens_r * exp(-(now - last_active_r) / H) * 1 / (1 + lambda * migrations_r)
    migrate argmax_r score_r from src to dst

Nothing here does I/O, starts threads or reads a clock: `now` and every observation are
arguments, the EWMA state is a value passed in and returned, so every decision can be replayed
from its inputs (tests/test_router_policy.py holds golden transcripts).

Choices the algorithm leaves open, fixed here:
- An instance seen for the first time starts at its first sample (L_i = Load(i)), not at 0, so a
  single tick (`tc rebalance` from the shell) sees the real loads. Instances missing from a tick's
  samples (dead, detached) are dropped from the state.
- Ties: the most loaded instance with the smallest id is the source, the least loaded other one
  with the smallest id the target, the highest score with the smallest request id the candidate.
  Iteration order of the inputs never matters.
- A request whose `last_active` is after `now` (clocks of different processes) counts as active
  just now: its age is clamped at 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tensorcast.errors import InvalidArgument


@dataclass(frozen=True)
class RebalanceParams:
    """Every knob of Algorithm 1, with the defaults `tc router start` and `tc rebalance` use.

    alpha: weight of the newest load sample in the EWMA, in (0, 1]; 1 keeps no history.
    theta_abs: act only when L_src - L_dst >= theta_abs (requests).
    theta_rel: act only when L_src / max(L_dst, 1) >= theta_rel.
    horizon_s: H, the recency horizon: a request idle for H seconds scores 1/e of an active one.
    penalty: lambda, the ping-pong penalty per past migration of the same request.
    """

    alpha: float = 0.5
    theta_abs: float = 2.0
    theta_rel: float = 1.5
    horizon_s: float = 60.0
    penalty: float = 1.0

    def __post_init__(self) -> None:
        checks = (
            ("alpha", 0 < self.alpha <= 1, "in (0, 1]"),
            ("theta_abs", self.theta_abs >= 0, ">= 0"),
            ("theta_rel", self.theta_rel >= 0, ">= 0"),
            ("horizon_s", self.horizon_s > 0, "> 0"),
            ("penalty", self.penalty >= 0, ">= 0"),
        )
        for name, ok, rule in checks:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not ok:
                raise InvalidArgument(f"rebalance parameter {name} must be {rule}, not {value!r}")
            if math.isnan(value) or math.isinf(value):
                raise InvalidArgument(f"rebalance parameter {name} must be finite, not {value!r}")

    def to_json(self) -> dict:
        return {
            "alpha": self.alpha,
            "theta_abs": self.theta_abs,
            "theta_rel": self.theta_rel,
            "horizon_s": self.horizon_s,
            "penalty": self.penalty,
        }


@dataclass(frozen=True)
class LoadSample:
    """One instance's queue depth at this tick: Load(i) = waiting + running."""

    instance_id: str
    waiting: int
    running: int

    @property
    def load(self) -> int:
        return self.waiting + self.running


@dataclass(frozen=True)
class RequestState:
    """A request (a session's resident KV cache) as the policy sees it.

    `last_active` is on the same clock as the tick's `now` (seconds). `running`: generating right
    now; `migrating`: a migration of it is in flight. Both make it ineligible.
    """

    req_id: str
    instance_id: str
    tokens: int
    last_active: float
    migrations: int = 0
    running: bool = False
    migrating: bool = False


@dataclass(frozen=True)
class Decision:
    """Migrate `req_id` (with its KV cache) from `source` to `target`."""

    req_id: str
    source: str
    target: str
    score: float

    def to_json(self) -> dict:
        return {
            "req_id": self.req_id,
            "source": self.source,
            "target": self.target,
            "score": self.score,
        }


@dataclass(frozen=True)
class TickResult:
    """What one tick saw and decided. `loads` is the EWMA state to pass to the next tick."""

    loads: dict[str, float]
    decision: Decision | None
    reason: str  # why there is no decision, or "migrate"
    source: str = ""
    target: str = ""
    gap: float = 0.0
    ratio: float = 0.0
    scores: dict[str, float] = field(default_factory=dict)  # eligible requests on the source

    def to_json(self) -> dict:
        return {
            "loads": {k: round(v, 6) for k, v in sorted(self.loads.items())},
            "decision": None if self.decision is None else self.decision.to_json(),
            "reason": self.reason,
            "source": self.source,
            "target": self.target,
            "gap": round(self.gap, 6),
            "ratio": round(self.ratio, 6),
            "scores": {k: round(v, 6) for k, v in sorted(self.scores.items())},
        }


def update_loads(
    previous: Mapping[str, float], samples: Iterable[LoadSample], alpha: float
) -> dict[str, float]:
    """Line 3 of Algorithm 1 for every sampled instance; unsampled instances are dropped."""
    loads: dict[str, float] = {}
    for sample in samples:
        if sample.instance_id in loads:
            raise InvalidArgument(f"instance {sample.instance_id!r} sampled twice in one tick")
        if sample.waiting < 0 or sample.running < 0:
            raise InvalidArgument(f"instance {sample.instance_id!r} reported a negative load")
        before = previous.get(sample.instance_id)
        loads[sample.instance_id] = (
            float(sample.load) if before is None else alpha * sample.load + (1.0 - alpha) * before
        )
    return loads


def score(request: RequestState, now: float, params: RebalanceParams) -> float:
    """tokens * e^(-(now - last_active)/H) * 1/(1 + lambda * migrations) (lines 14-16)."""
    age_s = max(0.0, now - request.last_active)
    active = math.exp(-age_s / params.horizon_s)
    return request.tokens * active / (1.0 + params.penalty * request.migrations)


def decide(
    loads: Mapping[str, float],
    requests: Iterable[RequestState],
    now: float,
    params: RebalanceParams,
) -> TickResult:
    """Lines 4-18 of Algorithm 1 over already-updated loads."""
    state = dict(loads)
    if len(state) < 2:
        return TickResult(state, None, f"{len(state)} instance(s): nothing to balance")
    order = sorted(state)
    source = min(order, key=lambda i: (-state[i], i))
    target = min((i for i in order if i != source), key=lambda i: (state[i], i))
    gap = state[source] - state[target]
    ratio = state[source] / max(state[target], 1.0)

    def result(decision: Decision | None, reason: str, scores: dict | None = None) -> TickResult:
        return TickResult(state, decision, reason, source, target, gap, ratio, scores or {})

    if gap < params.theta_abs:
        return result(None, f"balanced: gap {gap:.3g} < theta_abs {params.theta_abs:g}")
    if ratio < params.theta_rel:
        return result(None, f"balanced: ratio {ratio:.3g} < theta_rel {params.theta_rel:g}")
    scores: dict[str, float] = {}
    for r in requests:
        if r.instance_id != source or r.running or r.migrating:
            continue
        if r.req_id in scores:
            raise InvalidArgument(f"request {r.req_id!r} listed twice on {source!r}")
        if r.tokens < 0 or r.migrations < 0:
            raise InvalidArgument(f"request {r.req_id!r} has negative tokens or migrations")
        scores[r.req_id] = score(r, now, params)
    if not scores:
        return result(None, f"no eligible request on {source} (all running or migrating)")
    best = min(scores, key=lambda k: (-scores[k], k))
    return result(Decision(best, source, target, scores[best]), "migrate", scores)


def tick(
    previous_loads: Mapping[str, float],
    samples: Iterable[LoadSample],
    requests: Iterable[RequestState],
    now: float,
    params: RebalanceParams | None = None,
) -> TickResult:
    """One rebalance tick: update the EWMA loads, then decide (the whole of Algorithm 1)."""
    params = params or RebalanceParams()
    return decide(update_loads(previous_loads, samples, params.alpha), requests, now, params)

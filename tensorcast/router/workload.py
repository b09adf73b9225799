"""Multi-turn agent workloads (paper §6.4): concurrent sessions whose every turn appends tokens to
the session's context, with LogNormal think times between turns.

Pure and seeded: a `Workload` is a description; `session(k)` is the k-th session it would run,
derived only from (seed, k), so any session can be regenerated alone, in any order, in any
process. Nothing here reads a clock or sleeps: the driver (scripts/bench/router.py) waits.

What a session looks like (shaped like agentic coding rollouts, e.g. OpenHands on SWE-Gym: a
long shared system prompt, a task statement, then tens of tool calls whose observations
dominate the context):

  turn 0 context  = system prompt (shared by every session) + task statement
  turn k context  = turn k-1 context + the engine's output of turn k-1 + observation k
  each turn asks for `output_tokens` new tokens; the session ends after `turns` turns or when
  the next context would pass `max_context_tokens`.

Distributions (all sizes in tokens, LogNormal(mu, sigma) of the natural log, clipped):
  turns per session     LogNormal(ln 20, 0.6)   in [2, 80]    median 20
  task statement        LogNormal(ln 600, 0.5)  in [64, 4096] median 600
  observation per turn  LogNormal(ln 350, 0.9)  in [16, 8192] median 350, heavy tail (file views,
                                                                test logs)
  output per turn       LogNormal(ln 120, 0.6)  in [8, 1024]  median 120
  think time (seconds)  LogNormal(mu, sigma) of the preset, divided by `time_compression`; the
                        first turn of a session waits one think time too, so sessions start
                        spread out rather than all at once.
Presets (paper Tab. 3): fast (2.1, 0.6) median 8.2 s; medium (3.0, 0.8) median 20 s;
slow (4.1, 1.0) median 60 s.

Time compression c divides every think time; an engine emulating compute must divide its cost
model by the same c (`tc instance start --engine sim --time-scale c`) so that the ratio of think
time to compute, which decides how loaded the instances are, is unchanged.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from tensorcast.errors import InvalidArgument


@dataclass(frozen=True)
class LogNormal:
    """exp(N(mu, sigma)), clipped to [low, high]."""

    mu: float
    sigma: float
    low: float = 0.0
    high: float = math.inf

    def sample(self, rng: random.Random) -> float:
        return min(self.high, max(self.low, rng.lognormvariate(self.mu, self.sigma)))

    @property
    def median(self) -> float:
        return min(self.high, max(self.low, math.exp(self.mu)))


PRESETS: dict[str, LogNormal] = {
    "fast": LogNormal(2.1, 0.6),
    "medium": LogNormal(3.0, 0.8),
    "slow": LogNormal(4.1, 1.0),
}


@dataclass(frozen=True)
class Turn:
    """One request of a session: wait `think_s`, append `append_tokens` new tokens (the task
    statement for turn 0, an observation later), ask for `output_tokens` tokens."""

    index: int
    think_s: float
    append_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Session:
    session_id: str
    turns: tuple[Turn, ...]
    seed: int  # of this session's token ids

    def append_ids(self, turn: int, vocab: int) -> list[int]:
        """The token ids turn `turn` appends (deterministic; unique to this session)."""
        rng = random.Random(f"{self.seed}/{self.session_id}/{turn}")
        return [rng.randrange(vocab) for _ in range(self.turns[turn].append_tokens)]


@dataclass(frozen=True)
class Workload:
    """A reproducible agent workload; see the module docstring for every distribution."""

    preset: str = "medium"
    seed: int = 0
    time_compression: float = 1.0
    system_tokens: int = 2048
    max_context_tokens: int = 32768
    vocab: int = 32000
    turns: LogNormal = field(default_factory=lambda: LogNormal(math.log(20), 0.6, 2, 80))
    task_tokens: LogNormal = field(default_factory=lambda: LogNormal(math.log(600), 0.5, 64, 4096))
    observation_tokens: LogNormal = field(
        default_factory=lambda: LogNormal(math.log(350), 0.9, 16, 8192)
    )
    output_tokens: LogNormal = field(default_factory=lambda: LogNormal(math.log(120), 0.6, 8, 1024))

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise InvalidArgument(
                f"unknown preset {self.preset!r}: use one of {', '.join(sorted(PRESETS))}"
            )
        if not self.time_compression > 0 or math.isinf(self.time_compression):
            raise InvalidArgument(
                f"time_compression must be a positive number, not {self.time_compression!r}"
            )
        if self.system_tokens < 0 or self.vocab < 2:
            raise InvalidArgument("system_tokens must be >= 0 and vocab >= 2")
        if self.max_context_tokens <= self.system_tokens + self.task_tokens.high:
            raise InvalidArgument(
                "max_context_tokens must exceed the system prompt plus the longest task statement"
            )

    @property
    def think(self) -> LogNormal:
        return PRESETS[self.preset]

    def system_ids(self) -> list[int]:
        """The system prompt every session starts with (the one prefix they all share)."""
        rng = random.Random(f"{self.seed}/system")
        return [rng.randrange(self.vocab) for _ in range(self.system_tokens)]

    def session(self, k: int) -> Session:
        """The k-th session (k >= 0), from (seed, k) alone."""
        if k < 0:
            raise InvalidArgument(f"session index must be >= 0, not {k}")
        rng = random.Random(f"{self.seed}/session/{k}")
        planned = round(self.turns.sample(rng))
        context = self.system_tokens
        turns: list[Turn] = []
        for index in range(planned):
            append = round(
                (self.task_tokens if index == 0 else self.observation_tokens).sample(rng)
            )
            output = round(self.output_tokens.sample(rng))
            think_s = self.think.sample(rng) / self.time_compression
            if context + append + output > self.max_context_tokens:
                break
            turns.append(Turn(index, think_s, append, output))
            context += append + output
        return Session(f"s{self.seed}-{k}", tuple(turns), self.seed)

    def sessions(self, count: int) -> list[Session]:
        return [self.session(k) for k in range(count)]

    def to_json(self) -> dict:
        return {
            "preset": self.preset,
            "think_mu": self.think.mu,
            "think_sigma": self.think.sigma,
            "seed": self.seed,
            "time_compression": self.time_compression,
            "system_tokens": self.system_tokens,
            "max_context_tokens": self.max_context_tokens,
        }

"""A programmable request router built on TensorCast's signals and plans (paper §3.3, §6.4).

- `policy`: Algorithm 1 (EWMA load, threshold-gated rebalancing, request scoring) as pure code.
- `baselines`: the baseline routing choices (round-robin, power of two, longest prefix).
- `workload`: seeded multi-turn agent workloads with LogNormal think times.
- `rebalance`: one rebalancing tick against a live cluster (signals in, a migration plan out).
- `server`: the HTTP router (`tc router start`).

Importing this package imports nothing heavy (no torch, grpc or numpy).
"""

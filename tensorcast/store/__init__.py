"""Global Store: control-plane metadata (workers, artifacts, replicas, leases, plan results)."""

#!/usr/bin/env bash
# Autoscaling serving capacity with nothing but `tc` commands and their --json output.
#
#   scripts/autoscale.sh out MODEL [--mem SIZE]   start a worker, prefetch and pin MODEL, report ready
#   scripts/autoscale.sh in WORKER MODEL          unpin MODEL, drain WORKER's last copies, stop it
#
# Uses the local cluster of the state dir (TC_STATE_DIR) unless TC_ADDR/TC_TOKEN point elsewhere.
# Prints one JSON line per step; exits non-zero (with tc's exit code) at the first failure.
set -euo pipefail

TC=${TC:-tc}
step() { jq -cn --arg step "$1" --argjson data "$2" '{step: $step} + $data'; }
die() { echo "autoscale: $*" >&2; exit 1; }

store_addr() { $TC status --json | jq -r '.components[] | select(.role == "store") | .addr'; }

scale_out() {
  local model=$1 mem=${2:-1GiB}
  local name="scale-$(date +%s)-$$"
  local dir="${TC_STATE_DIR:-$HOME/.local/state/tensorcast}/autoscale"
  mkdir -p "$dir"
  $TC show "$model" --json >/dev/null  # fail early on an unknown model
  local store; store=$(store_addr)
  [ -n "$store" ] || die "no Global Store reachable (tc status)"
  nohup $TC worker start --store "$store" --name "$name" --mem "$mem" \
    --ready-file "$dir/$name.ready" >"$dir/$name.log" 2>&1 &
  for _ in $(seq 1 600); do
    [ -f "$dir/$name.ready" ] && break
    kill -0 $! 2>/dev/null || die "worker $name exited: $(tail -5 "$dir/$name.log")"
    sleep 0.1
  done
  [ -f "$dir/$name.ready" ] || die "worker $name not ready after 60s"
  step started "$(jq -c '{worker: "'"$name"'", addr, pid}' "$dir/$name.ready")"
  step prefetched "$($TC prefetch "$model" --to "$name" --json)"
  step pinned "$($TC pin "$model" --on "$name" --json)"
  local health
  health=$($TC status --json | jq -c --arg n "$name" '.components[] | select(.name == $n)')
  [ "$(jq -r .state <<<"$health")" = healthy ] || die "worker $name is not healthy: $health"
  step ready "$(jq -c --arg m "$model" '{worker: .name, state, model: $m}' <<<"$health")"
}

scale_in() {
  local worker=$1 model=$2
  step unpinned "$($TC unpin "$model" --on "$worker" --json)"
  # Drain: every artifact whose only live replica is on this worker gets a copy elsewhere first.
  local target
  target=$($TC status --json | jq -r --arg w "$worker" \
    '[.components[] | select(.role == "worker" and .state == "healthy" and .name != $w)][0].name // empty')
  local moved=0 art
  for art in $($TC ls --json | jq -r --arg w "$worker" \
      '.artifacts[] | select((.replicas | length) == 1 and .replicas[0].worker == $w) | .art_id'); do
    [ -n "$target" ] || die "$art has its only copy on $worker and no other worker is healthy"
    $TC prefetch "$art" --to "$target" --json >/dev/null
    moved=$((moved + 1))
  done
  step drained "$(jq -cn --arg t "$target" --argjson n "$moved" '{moved: $n, to: $t}')"
  step stopped "$($TC worker stop "$worker" --json)"
}

case "${1:-}" in
  out) shift; [ $# -ge 1 ] || die "usage: autoscale.sh out MODEL [--mem SIZE]"
       model=$1; shift; mem=1GiB
       [ "${1:-}" = --mem ] && mem=$2
       scale_out "$model" "$mem" ;;
  in) shift; [ $# -eq 2 ] || die "usage: autoscale.sh in WORKER MODEL"; scale_in "$1" "$2" ;;
  *) die "usage: autoscale.sh out MODEL [--mem SIZE] | in WORKER MODEL" ;;
esac

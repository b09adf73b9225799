#!/usr/bin/env python3
"""Benchmark `gpu`: time until every tensor of a generated model is on the GPU, side by side.

One run generates a safetensors model of --size-gib (bf16 tensors of 256 MiB and less, random
bytes made on the GPU) and one of --small-gib, starts a Global Store and one worker with a pool
and a GPU tier big enough for both (`tc worker start --mem ... --gpu-mem ...`), puts both models,
then times each mode in a fresh child process (imports, CUDA initialisation and a warm-up kernel
happen before the clock starts; the clock stops after `torch.cuda.synchronize()`):

  pinned_h2d        torch pinned host tensor -> GPU, 2 GiB, median of 5: the ceiling
  pageable_h2d      an ordinary (pageable) host tensor -> GPU, 2 GiB, median of 3
  pool_worker       tensor_dict(device="cuda", shared=False) of a content not in the tier: the
                    worker copies it by DMA from its page-locked pool into a buffer the
                    caller allocated and shared with it by CUDA IPC (the default route)
  pool_register     the same with TC_CUDA_COPY=register: the caller maps the pool region,
                    page-locks it chunk by chunk and copies (the worker's GPU not used)
  pool_staging      the caller copies through pinned staging buffers (TC_CUDA_COPY=staging)
  tier_first        tensor_dict(device="cuda"): the worker copies the content from its
                    page-locked pool into its GPU tier, the caller maps it (first caller)
  ipc               tensor_dict(device="cuda") again, fresh process: CUDA IPC, no copy (x3)
  ipc_small         the same for the small model (flat in size?)
  tier_private      tensor_dict(device="cuda", shared=False) with the tier warm: a private
                    device-to-device copy
  st_cache          safetensors.torch.load_file(path, device="cuda:0"), file in page cache
  st_cold           the same after `sync; echo 3 > /proc/sys/vm/drop_caches` (root only)
  kv                KV pages: put_pages from GPU tensors and get_pages(into=GPU buffers)
                    (256 pages x 2 MiB, median of 3), against a bounce through host tensors

Every materialization mode reports a checksum of all tensor bytes (computed after the clock
stops); they must agree. vLLM's default loader is not measured here (no vLLM GPU build on the
machine). Prints one JSON line with everything, then a table; `--out FILE` also writes the JSON.

    python scripts/bench/gpu.py --size-gib 12 --small-gib 1.5 --workdir /tmp/tc-gpu-bench
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
TENSOR_BYTES = 256 * MIB
CHILD_TIMEOUT_S = 600
POOL_SPARE_BYTES = 4 * GIB  # KV pages of the kv mode
DROP_CACHES = "/proc/sys/vm/drop_caches"


# -- children ----------------------------------------------------------------------------------


def _checksum(tensors: dict[str, Any]) -> int:
    """Sum over tensors of (position + 1) * (byte sum), mod 2^61: cheap on the GPU, and a
    missing, shifted or swapped tensor changes it."""
    import torch

    total = 0
    for i, name in enumerate(sorted(tensors)):
        flat = tensors[name].reshape(-1).view(torch.uint8)
        s = 0
        for start in range(0, flat.numel(), 256 * MIB):
            s += int(flat[start : start + 256 * MIB].sum(dtype=torch.int64))
        total = (total + (i + 1) * s) % ((1 << 61) - 1)
    return total


def _warm() -> None:
    import torch

    torch.cuda.init()
    x = torch.ones(1 << 20, device="cuda")
    (x * 2).sum().item()
    torch.empty(1 << 20, dtype=torch.uint8).to("cuda")
    torch.cuda.synchronize()


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    _warm()
    mode = args.child
    if mode in ("pinned_h2d", "pageable_h2d"):
        size = 2 * GIB
        host = torch.empty(size, dtype=torch.uint8, pin_memory=mode == "pinned_h2d")
        host.fill_(1)
        dest = torch.empty(size, dtype=torch.uint8, device="cuda")
        times = []
        for _ in range(5 if mode == "pinned_h2d" else 3):
            torch.cuda.synchronize()
            started = time.perf_counter()
            dest.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return {"seconds": statistics.median(times), "bytes": size, "all_s": times}
    if mode == "kv":
        return _kv(args)
    if mode.startswith("st_"):
        from safetensors.torch import load_file

        started = time.perf_counter()
        tensors = load_file(args.path, device="cuda:0")
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        return {"seconds": seconds, "checksum": _checksum(tensors)}
    import tensorcast as tc

    rt = tc.connect(args.addr, args.token)
    art = rt.artifact(args.art)
    started = time.perf_counter()
    tensors = art.tensor_dict(
        device="cuda", shared=not mode.startswith("pool_") and mode != "tier_private"
    )
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    out = {"seconds": seconds, "bytes": art.size_bytes, "checksum": _checksum(tensors)}
    from tensorcast.sdk import device

    report = device.last_copy_report
    if mode.startswith("pool_") and report is not None:  # the route actually taken
        out["route"] = report.route
        out["register_s"] = report.register_s
        out["copy_s"] = report.seconds
    if mode in ("ipc", "ipc_small", "tier_first"):
        # Zero copy: the process's own CUDA allocations stay small.
        out["allocated_bytes"] = torch.cuda.memory_allocated()
    return out


def _kv(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import tensorcast as tc

    rt = tc.connect(args.addr, args.token)
    pages = rt.pages()
    n, page_bytes = 256, 2 * MIB
    src = [torch.randn(page_bytes // 2, dtype=torch.bfloat16, device="cuda") for _ in range(n)]
    into = [torch.empty_like(t) for t in src]
    out: dict[str, Any] = {"pages": n, "page_bytes": page_bytes}
    for variant in ("gpu", "bounce"):
        put_s, get_s = [], []
        for rep in range(4):  # the first round warms (page-locks the pool mapping once)
            keys = [f"kv/bench/{variant}/{rep}/{i}" for i in range(n)]
            torch.cuda.synchronize()
            started = time.perf_counter()
            if variant == "gpu":
                pages.put_pages(dict(zip(keys, src)), ttl_s=120)
            else:
                pages.put_pages({k: t.cpu() for k, t in zip(keys, src)}, ttl_s=120)
            put = time.perf_counter() - started
            started = time.perf_counter()
            if variant == "gpu":
                got = pages.get_pages(keys, into=into)
            else:
                got = pages.get_pages(keys)
                for page, dest in zip(got, into):
                    assert page is not None
                    dest.copy_(page.tensor())
            torch.cuda.synchronize()
            get = time.perf_counter() - started
            assert all(p is not None for p in got)
            assert all(torch.equal(a, b) for a, b in zip(src[:4], into[:4]))
            if rep:
                put_s.append(put)
                get_s.append(get)
            for dest in into:
                dest.zero_()
        total = n * page_bytes
        out[variant] = {
            "put_gbps": total / statistics.median(put_s) / 1e9,
            "get_gbps": total / statistics.median(get_s) / 1e9,
            "put_s": put_s,
            "get_s": get_s,
        }
    return out


# -- parent ------------------------------------------------------------------------------------


def write_model(path: Path, size_bytes: int, seed: int) -> None:
    """A safetensors file of bf16 tensors (256 MiB each, the last smaller), random bytes."""
    import torch

    sizes = []
    left = size_bytes
    while left > 0:
        sizes.append(min(TENSOR_BYTES, left))
        left -= sizes[-1]
    header: dict[str, Any] = {}
    offset = 0
    for i, n in enumerate(sizes):
        header[f"layers.{i}.weight"] = {
            "dtype": "BF16",
            "shape": [n // 2 // 4096, 4096] if n % (2 * 4096) == 0 else [n // 2],
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    g = torch.Generator(device="cuda").manual_seed(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for n in sizes:
            t = torch.randn(n // 2, dtype=torch.bfloat16, device="cuda", generator=g)
            f.write(t.cpu().view(torch.uint8).numpy().data)


def start(
    cmd: list[str], log: Path, ready: Path, env: dict[str, str], timeout_s: float
) -> tuple[subprocess.Popen, dict]:
    ready.unlink(missing_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tensorcast.cli.main", *cmd, "--ready-file", str(ready)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready.exists() and ready.stat().st_size:
            return proc, json.loads(ready.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited {proc.returncode}: {log.read_text()[-3000:]}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{cmd[0]} not ready within {timeout_s}s: {log.read_text()[-3000:]}")


def run_child(mode: str, extra: list[str], env: dict[str, str]) -> dict[str, Any]:
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", mode, *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=CHILD_TIMEOUT_S,
    )
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:], "child_wall_s": wall}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["child_wall_s"] = wall
    return result


def drop_caches() -> str | None:
    try:
        subprocess.run(["sync"], check=True)
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return f"cannot drop the page cache: {e}"


def read_through(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 * MIB):
            pass


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / GIB, 1)
    try:
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        info["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        info["nvidia_smi"] = f"unavailable: {e}"
    try:
        info["shmem_thp"] = (
            Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip()
        )
    except OSError:
        info["shmem_thp"] = "unknown"
    with open("/proc/meminfo") as f:
        info["mem_total_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    return info


def parent(args: argparse.Namespace) -> dict[str, Any]:
    import psutil
    import torch

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="tc-gpu-"))
    workdir.mkdir(parents=True, exist_ok=True)
    big, small = workdir / "big.safetensors", workdir / "small.safetensors"
    size = int(args.size_gib * GIB)
    small_size = int(args.small_gib * GIB)
    result: dict[str, Any] = {
        "bench": "gpu",
        "command": " ".join(sys.argv),
        "size_bytes": size,
        "small_bytes": small_size,
        "env": environment(),
        "modes": {},
        "steps_s": {},
    }
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(workdir)], capture_output=True, text=True)
    result["env"]["workdir_fs"] = fs.stdout.strip()
    # The pool (both models + room for KV pages) must fit the memory the worker sees.
    available = psutil.virtual_memory().available
    room = int(available * 0.6) - small_size - POOL_SPARE_BYTES
    if size > room:
        result["size_reduced_from"] = size
        size = max(GIB, room // TENSOR_BYTES * TENSOR_BYTES)
        result["size_bytes"] = size
    result["env"]["mem_available_gib"] = round(available / GIB, 1)

    def save() -> None:  # after every step: a run cut short still leaves its figures
        if args.out:
            Path(args.out).write_text(json.dumps(result) + "\n")

    step = time.perf_counter()
    for path, n, seed in ((big, size, 1), (small, small_size, 2)):
        if not (path.exists() and path.stat().st_size > n):
            write_model(path, n, seed)
    result["steps_s"]["generate"] = time.perf_counter() - step
    torch.cuda.empty_cache()

    token = "bench-" + os.urandom(8).hex()
    env = {**os.environ, "TC_TOKEN": token, "PYTHONUNBUFFERED": "1"}
    env.pop("TC_CUDA_COPY", None)
    state = workdir / "state"
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir()
    procs: list[subprocess.Popen] = []
    try:
        step = time.perf_counter()
        store, info = start(
            ["store", "start", "--db", str(state / "store.db"), "--listen", "127.0.0.1:0"],
            state / "store.log",
            state / "store.json",
            env,
            60,
        )
        procs.append(store)
        addr = info["addr"]
        pool = size + small_size + POOL_SPARE_BYTES
        worker, _ = start(
            [
                "worker",
                "start",
                "--store",
                addr,
                "--mem",
                str(pool),
                "--gpu-mem",
                str(size + small_size + GIB),
                "--name",
                "gpu-1",
            ],
            state / "worker.log",
            state / "worker.json",
            env,
            300,
        )
        procs.append(worker)
        result["steps_s"]["cluster_up"] = time.perf_counter() - step
        result["worker_log_tier"] = [
            line for line in (state / "worker.log").read_text().splitlines() if "GPU tier" in line
        ]

        import tensorcast as tc

        rt = tc.connect(addr, token)
        step = time.perf_counter()
        rt.put_files("bench/big@v1", big)
        rt.put_files("bench/small@v1", small)
        result["steps_s"]["put"] = time.perf_counter() - step

        base = ["--addr", addr, "--token", token]
        modes = result["modes"]
        save()
        modes["pinned_h2d"] = run_child("pinned_h2d", [], env)
        modes["pageable_h2d"] = run_child("pageable_h2d", [], env)
        modes["pool_worker"] = run_child("pool_worker", [*base, "--art", "bench/big@v1"], env)
        for route in ("register", "staging"):
            modes[f"pool_{route}"] = run_child(
                f"pool_{route}", [*base, "--art", "bench/big@v1"], {**env, "TC_CUDA_COPY": route}
            )
        save()
        modes["tier_first"] = run_child("tier_first", [*base, "--art", "bench/big@v1"], env)
        save()
        runs = [run_child("ipc", [*base, "--art", "bench/big@v1"], env) for _ in range(3)]
        modes["ipc"] = _median_of(runs)
        run_child("tier_first", [*base, "--art", "bench/small@v1"], env)  # warm the small one
        modes["ipc_small"] = run_child("ipc_small", [*base, "--art", "bench/small@v1"], env)
        modes["tier_private"] = run_child("tier_private", [*base, "--art", "bench/big@v1"], env)
        save()
        modes["kv"] = run_child("kv", base, env)
        save()
        result["worker_log_tier"] += [
            line
            for line in (state / "worker.log").read_text().splitlines()
            if "GPU tier: loaded" in line
        ]
        rt.close()
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    read_through(big)
    result["modes"]["st_cache"] = run_child("st_cache", ["--path", str(big)], env)
    save()
    if args.skip_cold:
        result["modes"]["st_cold"] = {"skipped": "--skip-cold"}
    else:
        reason = drop_caches()
        result["modes"]["st_cold"] = (
            {"skipped": reason} if reason else run_child("st_cold", ["--path", str(big)], env)
        )
    save()
    if not args.keep:
        big.unlink(missing_ok=True)
        small.unlink(missing_ok=True)
    return result


def _median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "seconds" in r]
    if not ok:
        return runs[0]
    best = sorted(ok, key=lambda r: r["seconds"])[len(ok) // 2]
    return {**best, "all_s": [r["seconds"] for r in ok]}


def table(result: dict[str, Any]) -> str:
    size = result["size_bytes"]
    modes = result["modes"]
    pinned = modes.get("pinned_h2d", {})
    ceiling = pinned.get("bytes", 0) / pinned["seconds"] / 1e9 if "seconds" in pinned else 0.0
    sums = {m.get("checksum") for k, m in modes.items() if "checksum" in m and k != "ipc_small"}
    lines = [
        f"gpu bench: {size / GIB:.1f} GiB model, {result['env'].get('gpu')}, "
        f"checksums {'agree' if len(sums) == 1 else 'DIFFER: ' + str(sums)}",
        f"{'mode':<14} {'seconds':>9} {'GB/s':>8} {'vs pinned':>9}  note",
    ]
    for name, m in modes.items():
        if name == "kv":
            continue
        if "seconds" not in m:
            note = m.get("skipped") or m.get("error", "")[-200:]
            lines.append(f"{name:<14} {'-':>9} {'-':>8} {'-':>9}  {note}")
            continue
        nbytes = m.get("bytes") or (result["small_bytes"] if name == "ipc_small" else size)
        rate = nbytes / m["seconds"] / 1e9
        share = f"{rate / ceiling:.2f}" if ceiling and name not in ("ipc", "ipc_small") else ""
        lines.append(f"{name:<14} {m['seconds']:>9.3f} {rate:>8.1f} {share:>9}")
    kv = modes.get("kv", {})
    for variant in ("gpu", "bounce"):
        if variant in kv:
            put, get = kv[variant]["put_gbps"], kv[variant]["get_gbps"]
            lines.append(f"kv {variant:<11} put {put:.1f} GB/s, get {get:.1f} GB/s")
    if "error" in kv:
        lines.append(f"kv error: {kv['error'][-300:]}")
    lines += [line[-160:] for line in result.get("worker_log_tier", [])[:4]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=12.0)
    parser.add_argument("--small-gib", type=float, default=1.5)
    parser.add_argument("--workdir", default="")
    parser.add_argument("--keep", action="store_true", help="keep the generated model files")
    parser.add_argument("--skip-cold", action="store_true", help="no page-cache drop")
    parser.add_argument("--out", default="", help="also write the JSON line here")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--addr", default="", help=argparse.SUPPRESS)
    parser.add_argument("--token", default="", help=argparse.SUPPRESS)
    parser.add_argument("--art", default="", help=argparse.SUPPRESS)
    parser.add_argument("--path", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    result = parent(args)
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(table(result))


if __name__ == "__main__":
    main()

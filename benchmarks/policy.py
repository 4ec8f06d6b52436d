"""Cache policy under epochs of fresh random permutations, dataset larger than the cache.

For each policy (``keep``: admit until full, then keep; ``lru``) the same
dataset is mounted with a fresh cache of ``--cache-fraction`` of the dataset,
read for ``--epochs`` epochs, each in a new random order, and the byte hit
ratio of every epoch is taken from the daemon's metrics. Theory (anchors):
keep -> c from epoch 2 on; lru -> c + (1-c) ln(1-c). The page cache is
dropped between epochs and the daemon's memory budget is kept small so the
disk cache policy, not RAM, is what is measured.

    python -m benchmarks.policy [--files 2000] [--file-kb 64] [--cache-fraction 0.5]
                                [--epochs 4] [--workers 8] [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.origin import SeaweedOrigin, s3_env
from benchmarks.util import drop_caches, free_ports, is_mounted, per_label, scrape_labeled, scrape_metrics

BUCKET = "policy"


def theory(policy: str, c: float) -> float:
    if c >= 1:
        return 1.0
    return c if policy == "keep" else c + (1 - c) * math.log(1 - c)




def run_policy(origin: SeaweedOrigin, work: Path, policy: str, keys: list[str], cache_bytes: int,
               block: str, epochs: int, workers: int, seed: int,
               budget: str | None = None) -> list[dict[str, Any]]:
    mnt, cache = work / f"mnt-{policy}", work / f"cache-{policy}"
    mnt.mkdir(exist_ok=True)
    addr = f"127.0.0.1:{free_ports(1)[0]}"
    env = dict(os.environ, **s3_env())
    cmd = [sys.executable, "-m", "cachefs", "mount", f"s3://{BUCKET}/ds", str(mnt), "--cache-dir",
           str(cache), "--cache-size", str(cache_bytes), "--cache-policy", policy, "--block-size", block,
           "--memory-budget", budget or ("4M" if block == "64K" else "16M"), "--endpoint-url", origin.endpoint,
           "--metrics-addr", addr, "--metadata-ttl", "inf"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip())
    rows = []
    try:
        rnd = random.Random(seed)
        for epoch in range(1, epochs + 1):
            order = keys[:]
            rnd.shuffle(order)
            drop_caches()
            before, labeled = scrape_metrics(addr), scrape_labeled(f"http://{addr}/metrics")
            t0 = time.perf_counter()
            with ThreadPoolExecutor(workers) as pool:
                total = sum(pool.map(lambda k: len((mnt / k).read_bytes()), order))
            seconds = time.perf_counter() - t0
            after = scrape_metrics(addr)
            hit = after["cachefs_cache_hit_bytes_total"] - before.get("cachefs_cache_hit_bytes_total", 0)
            miss = after["cachefs_cache_miss_bytes_total"] - before.get("cachefs_cache_miss_bytes_total", 0)
            rows.append({"policy": policy, "epoch": epoch, "bytes": total, "seconds": seconds,
                         "hit_ratio": hit / (hit + miss) if hit + miss else 0.0,
                         "s3_bytes": after["cachefs_s3_bytes_total"] - before.get("cachefs_s3_bytes_total", 0),
                         "cache_used": after.get("cachefs_cache_used_bytes", 0),
                         "prefetch_issued": (after.get("cachefs_prefetch_issued_bytes_total", 0)
                                             - before.get("cachefs_prefetch_issued_bytes_total", 0)),
                         "prefetch_used": (after.get("cachefs_prefetch_used_bytes_total", 0)
                                           - before.get("cachefs_prefetch_used_bytes_total", 0)),
                         # (by policy: which speculation fetched what, when it is not 0)
                         "prefetch_issued_by_policy": per_label(
                             labeled, scrape_labeled(f"http://{addr}/metrics"),
                             "cachefs_prefetch_issued_bytes_total", 1)})
    finally:
        subprocess.run([sys.executable, "-m", "cachefs", "unmount", str(mnt)], env=env)
        if is_mounted(str(mnt)):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--file-kb", type=int, default=64)
    ap.add_argument("--cache-fraction", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--folders", type=int, default=50)
    ap.add_argument("--memory-budget", help="the daemon's --memory-budget (default 4M for files "
                    "of 64 KiB or less, else 16M)")
    ap.add_argument("--policies", default="keep,lru")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="200 files of 16 KiB, 3 epochs")
    ap.add_argument("--json", type=Path, help="write the per-epoch rows here")
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.files, args.file_kb, args.epochs = 200, 16, 3
    size = args.file_kb * 1024
    block = "64K" if size <= 64 * 1024 else "4M"
    dataset = args.files * size
    cache_bytes = int(dataset * args.cache_fraction)
    c = cache_bytes / dataset
    if args.workdir is not None:  # kept, to look at afterwards
        args.workdir.mkdir(parents=True, exist_ok=True)
        return _run(args, args.workdir, size, block, dataset, cache_bytes, c)
    # A temporary directory holds the dataset twice (the S3 server's copy and the cache):
    # removed at the end, like the demo's.
    work = Path(tempfile.mkdtemp(prefix="cachefs-policy-"))
    try:
        return _run(args, work, size, block, dataset, cache_bytes, c)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path, size: int, block: str, dataset: int,
         cache_bytes: int, c: float) -> int:
    rows: list[dict[str, Any]] = []
    with SeaweedOrigin(work / "s3") as origin:
        origin.ensure_bucket(BUCKET)
        s3 = origin.client(max_pool=16)
        keys = [f"c{i % args.folders:02d}/f{i:06d}.bin" for i in range(args.files)]
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda k: s3.put_object(Bucket=BUCKET, Key="ds/" + k,
                                                  Body=random.Random(k).randbytes(size)), keys))
        for policy in args.policies.split(","):
            rows += run_policy(origin, work, policy, keys, cache_bytes, block, args.epochs, args.workers,
                               args.seed, args.memory_budget)
    print(f"dataset {args.files} files x {args.file_kb} KiB = {dataset / 1e6:.1f} MB; cache c = {c:.2f} "
          f"of it; {args.epochs} epochs, fresh random order each; co-located SeaweedFS")
    print(f"{'policy':<8}{'epoch':>6}{'hit ratio':>11}{'theory':>9}{'from S3':>12}{'not from S3':>13}"
          f"{'prefetched':>12}{'used':>10}{'MB/s':>8}")
    for r in rows:
        expect = 0.0 if r["epoch"] == 1 else theory(r["policy"], c)
        print(f"{r['policy']:<8}{r['epoch']:>6}{r['hit_ratio']:>11.3f}{expect:>9.3f}"
              f"{r['s3_bytes'] / 1e6:>9.1f} MB{1 - r['s3_bytes'] / r['bytes']:>13.3f}"
              f"{r['prefetch_issued'] / 1e6:>9.1f} MB{r['prefetch_used'] / 1e6:>7.1f} MB"
              f"{r['bytes'] / r['seconds'] / 1e6:>8.1f}  "
              + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in r["prefetch_issued_by_policy"].items()))
    for policy in args.policies.split(","):
        later = [r["hit_ratio"] for r in rows if r["policy"] == policy and r["epoch"] > 1]
        if later:
            mean = sum(later) / len(later)
            print(f"{policy}: mean hit ratio after epoch 1 = {mean:.3f} = {mean / c:.3f} c "
                  f"(theory {theory(policy, c):.3f})")
    if args.json:
        args.json.write_text(json.dumps({"c": c, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

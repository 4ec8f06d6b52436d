"""``make demo``: cachefs end to end on an embedded default.

Starts a local S3-compatible server (SeaweedFS) on loopback, uploads a
generated sample dataset (image-like files in class folders plus a few large
shards), mounts it with cachefs, reads everything twice (the second time from
the block cache, with the page cache dropped in between), prints cold vs warm
throughput, bytes fetched from S3 and the byte hit ratio, then unmounts and
stops the server, even on Ctrl-C or failure.

    python -m benchmarks.demo [--files 300] [--shards 3] [--shard-mb 64] [--workers 8]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.origin import SeaweedOrigin, s3_env
from benchmarks.util import drop_caches, free_ports, is_mounted, scrape_metrics

BUCKET = "demo"
PREFIX = "sample-dataset"


def generate(origin: SeaweedOrigin, files: int, shards: int, shard_mb: int) -> dict[str, int]:
    """Upload the sample dataset (deterministic); return key -> size."""
    rnd = random.Random(0)
    objects: dict[str, int] = {}
    for i in range(files):
        objects[f"{PREFIX}/train/class{i % 10:02d}/img{i:05d}.jpg"] = rnd.randint(40_000, 180_000)
    for i in range(shards):
        objects[f"{PREFIX}/shards/shard-{i:04d}.tar"] = shard_mb << 20
    s3 = origin.client(max_pool=16)
    origin.ensure_bucket(BUCKET)

    def put(item: tuple[str, int]) -> None:
        key, size = item
        data = random.Random(key).randbytes(size)
        s3.put_object(Bucket=BUCKET, Key=key, Body=data)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, objects.items()))
    return objects


def read_all(root: Path, workers: int) -> tuple[int, float]:
    paths = sorted(p for p in root.rglob("*") if p.is_file())
    t0 = time.perf_counter()

    def read(p: Path) -> int:
        n = 0
        with open(p, "rb") as f:
            while chunk := f.read(1 << 20):
                n += len(chunk)
        return n

    with ThreadPoolExecutor(workers) as pool:
        total = sum(pool.map(read, paths))
    return total, time.perf_counter() - t0




def mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=300)
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--shard-mb", type=int, default=64)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()

    if args.workdir:
        work = Path(args.workdir)
        work.mkdir(parents=True, exist_ok=True)
        return run(args, work, kept=True)
    # A temporary directory holds the dataset twice (the S3 server's copy and the cache):
    # removed at the end, or every demo would leave ~0.5 GB behind.
    work = Path(tempfile.mkdtemp(prefix="cachefs-demo-"))
    try:
        return run(args, work, kept=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path, *, kept: bool) -> int:
    """The demo in ``work``; ``kept``: the directory stays afterwards (say so)."""
    mnt, cache = work / "mnt", work / "cache"
    mnt.mkdir(exist_ok=True)
    env = dict(os.environ, **s3_env())
    metrics_addr = f"127.0.0.1:{free_ports(1)[0]}"
    print(f"cachefs demo in {work}")
    with SeaweedOrigin(work / "s3") as origin:
        print(f"S3-compatible server (SeaweedFS) at {origin.endpoint}")
        objects = generate(origin, args.files, args.shards, args.shard_mb)
        dataset = sum(objects.values())
        print(f"dataset: {len(objects)} objects, {mb(dataset)} "
              f"({args.files} images in 10 classes, {args.shards} shards of {args.shard_mb} MiB)")
        cmd = [sys.executable, "-m", "cachefs", "mount", f"s3://{BUCKET}/{PREFIX}", str(mnt),
               "--cache-dir", str(cache), "--cache-size", "2G", "--endpoint-url",
               origin.endpoint, "--metrics-addr", metrics_addr]
        print(f"$ cachefs mount s3://{BUCKET}/{PREFIX} {mnt} --cache-dir {cache} "
              f"--endpoint-url {origin.endpoint}")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr.strip(), file=sys.stderr)
            return 1
        try:
            drop_caches()
            cold_bytes, cold_s = read_all(mnt, args.workers)
            after_cold = scrape_metrics(metrics_addr)
            drop_caches()  # the second pass must come from the block cache, not RAM
            warm_bytes, warm_s = read_all(mnt, args.workers)
            after_warm = scrape_metrics(metrics_addr)
        finally:
            subprocess.run([sys.executable, "-m", "cachefs", "unmount", str(mnt)], env=env)
            if is_mounted(str(mnt)):
                subprocess.run(["fusermount3", "-u", "-z", str(mnt)])
    s3_cold = after_cold.get("cachefs_s3_bytes_total", 0)
    s3_warm = after_warm.get("cachefs_s3_bytes_total", 0) - s3_cold
    assert cold_bytes == warm_bytes == dataset, (cold_bytes, warm_bytes, dataset)
    print()
    print(f"{'pass':<6}{'seconds':>9}{'throughput':>14}{'from S3':>14}{'byte hit ratio':>16}")
    print(f"{'cold':<6}{cold_s:>9.2f}{cold_bytes / cold_s / 1e6:>10.1f} MB/s{mb(s3_cold):>14}"
          f"{'-':>16}")
    # Bytes read that did not come from S3: the daemon's cache-hit counters miss the reads
    # the kernel makes itself from passed-through cache files (all of them, for small files).
    ratio = 1.0 - s3_warm / warm_bytes if warm_bytes else 0.0
    print(f"{'warm':<6}{warm_s:>9.2f}{warm_bytes / warm_s / 1e6:>10.1f} MB/s{mb(s3_warm):>14}"
          f"{100 * ratio:>15.1f}%")
    print(f"\nwarm/cold speed-up {cold_s / warm_s:.1f}x; both passes read the whole dataset "
          f"({mb(dataset)} each); unmounted and server stopped"
          + (f"; its files are kept in {work}." if kept else "."))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Random reads of a large file: pieces at random offsets, cold, and the bytes it costs.

    python -m benchmarks.randomreads                          # cachefs at 4M and 256K blocks, rclone
    python -m benchmarks.randomreads --systems cachefs --block-sizes 4M,1M,256K,64K
    python -m benchmarks.randomreads --quick                  # seconds (tests/test_bench_quick.py)

One object of ``--size-mb`` on a SeaweedFS origin behind the WAN emulator (70 ms RTT,
48 MB/s in total, 16 MB/s per connection by default). ``--threads`` threads ``pread``
``--reads`` pieces of ``--read-kb`` at random offsets of it (a memory-mapped token
array, an HDF5 or LMDB file read by a sampler), each piece compared with the object's
bytes. Every system starts with an empty cache.

The baseline, measured in the same run over the same link, is ``direct``: the same
threads asking S3 for exactly each piece (one ranged GET each, boto3): what the link
allows this pattern without any cache. Per system it reports the time, reads/s, the
ratio to the baseline's reads/s, the bytes that crossed the link (the emulator's count
of GET bodies) per byte read, and for cachefs its daemon CPU.

A read that misses costs a whole block (``--block-size``): this benchmark shows what
the block size costs a random reader, next to what ``benchmarks.run --datasets
shards`` shows it costs a sequential one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import mmap
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

from benchmarks.origin import SeaweedOrigin, s3_client
from benchmarks.systems import Mounted, mount_cachefs, mount_rclone
from benchmarks.util import (
    add_link_args,
    fuse_usable,
    proc_sample,
    scrape_metrics,
    stop_cleanly_on_signals,
    write_rows,
)
from benchmarks.wan import WanLink

BUCKET, PREFIX, KEY = "bench", "random", "big.bin"


def _transferred(wan: WanLink) -> int:
    return int(wan.stats()["get_transferred_bytes"])


def _read_all(read: Any, offsets: list[int], size: int, data: bytes, threads: int) -> float:
    """Read ``size`` bytes at each offset with ``read(offset, size)`` on ``threads`` threads,
    checking every piece; the seconds it took."""
    def one(offset: int) -> None:
        got = read(offset, size)
        if got != data[offset:offset + size]:
            raise AssertionError(f"wrong bytes at offset {offset}")

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(one, offsets):
            pass
    return time.perf_counter() - t0


#: What the worker processes of a memory-mapped run read: set before they are forked.
_MAPPED: dict[str, Any] = {}


def _check_mapped(offset: int) -> None:
    size, data = _MAPPED["size"], _MAPPED["data"]
    if _MAPPED["map"][offset:offset + size] != data[offset:offset + size]:
        raise AssertionError(f"wrong bytes at offset {offset}")


def _read_mapped(mapped: mmap.mmap, offsets: list[int], size: int, data: bytes,
                 workers: int) -> float:
    """Slice ``size`` bytes at each offset of ``mapped`` in ``workers`` forked processes
    (as DataLoader workers do), checking every piece; the seconds it took. Processes, not
    threads: a slice of a memory map is copied with the interpreter lock held through its
    page faults, so threads of one process would fault one at a time."""
    import multiprocessing

    _MAPPED.update(map=mapped, size=size, data=data)
    try:
        with concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("fork")) as pool:
            list(pool.map(abs, range(workers)))  # (the workers start outside the timing)
            t0 = time.perf_counter()
            for _ in pool.map(_check_mapped, offsets):
                pass
            return time.perf_counter() - t0
    finally:
        _MAPPED.clear()


def measure_direct(wan: WanLink, offsets: list[int], size: int, data: bytes,
                   threads: int) -> dict[str, Any]:
    client = s3_client(wan.endpoint, max_pool=threads)

    def read(offset: int, n: int) -> bytes:
        body = client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{KEY}",
                                 Range=f"bytes={offset}-{offset + n - 1}")["Body"]
        return bytes(body.read())

    before = _transferred(wan)
    seconds = _read_all(read, offsets, size, data, threads)
    return {"system": "direct", "seconds": seconds, "link_bytes": _transferred(wan) - before}


def measure_mount(m: Mounted, wan: WanLink, offsets: list[int], size: int, data: bytes,
                  threads: int, access: str = "pread") -> dict[str, Any]:
    fd = os.open(m.root / KEY, os.O_RDONLY)
    mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ) if access == "mmap" else None
    try:
        before = _transferred(wan)
        cpu0 = proc_sample(m.pid) if m.pid else None
        if mapped is not None:  # page faults: the kernel reads around each one
            seconds = _read_mapped(mapped, offsets, size, data, threads)
        else:
            seconds = _read_all(lambda off, n: os.pread(fd, n, off), offsets, size, data,
                                threads)
        cpu1 = proc_sample(m.pid) if m.pid else None
        row: dict[str, Any] = {"system": m.system, "seconds": seconds,
                               "link_bytes": _transferred(wan) - before}
        if cpu0 is not None and cpu1 is not None:
            row["daemon_cpu_s"] = round(cpu1.cpu_s - cpu0.cpu_s, 2)
        if m.metrics_url:
            addr = urllib.parse.urlsplit(m.metrics_url).netloc
            row["piece_reads"] = int(scrape_metrics(addr).get("cachefs_piece_reads_total", 0))
        return row
    finally:
        if mapped is not None:
            mapped.close()
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    stop_cleanly_on_signals()
    ap = argparse.ArgumentParser(prog="python -m benchmarks.randomreads",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default="cachefs,rclone",
                    help="comma list of cachefs, rclone (direct is always measured)")
    ap.add_argument("--block-sizes", default="4M,256K", help="cachefs --block-size values")
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--read-kb", type=int, default=64)
    ap.add_argument("--reads", type=int, default=600)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--access", choices=("pread", "mmap"), default="pread",
                    help="pread the pieces in threads, or slice a memory map of the file (page "
                         "faults) in as many forked processes")
    add_link_args(ap)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="256 MB, 60 reads, RTT 20 ms")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mb, args.reads, args.rtt_ms = 256, 60, 20.0
    ok, why = fuse_usable()
    if not ok:
        print(f"FUSE is not usable here: {why}", file=sys.stderr)
        return 1
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in ("cachefs", "rclone")]
    if bad:
        print(f"unknown system: {', '.join(bad)}", file=sys.stderr)
        return 2
    size, piece = args.size_mb << 20, args.read_kb << 10
    rng = random.Random(args.seed)
    data = rng.randbytes(size) if size < (1 << 28) else os.urandom(size)
    offsets = [rng.randrange(0, size - piece) for _ in range(args.reads)]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cachefs-random-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    try:
        with SeaweedOrigin(work / "s3") as origin:
            origin.ensure_bucket(BUCKET)
            client = origin.client()
            client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{KEY}", Body=data)
            with WanLink(origin.s3_port, args.rtt_ms, args.bandwidth_MBps,
                         args.conn_bandwidth_MBps, log_path=str(work / "wan.log")) as wan:
                rows.append(measure_direct(wan, offsets, piece, data, args.threads))
                for system in systems:
                    variants = ([(f"cachefs {bs}", ["--block-size", bs])
                                 for bs in args.block_sizes.split(",") if bs]
                                if system == "cachefs" else [("rclone", [])])
                    for name, extra in variants:
                        run = work / name.replace(" ", "-")
                        run.mkdir()
                        mount = (mount_cachefs(wan.endpoint, BUCKET, PREFIX, run, extra=extra)
                                 if system == "cachefs" else
                                 mount_rclone(wan.endpoint, BUCKET, PREFIX, run))
                        with mount as m:
                            row = measure_mount(m, wan, offsets, piece, data, args.threads,
                                                args.access)
                        row["system"] = name
                        rows.append(row)
        base = args.reads / rows[0]["seconds"]
        print(f"{args.reads} {args.access}s of {args.read_kb} KB at random offsets of a {args.size_mb} MB "
              f"object, {args.threads} threads, {args.rtt_ms:.0f} ms / {args.bandwidth_MBps:.0f} "
              f"MB/s link, cold")
        print("| system | seconds | reads/s | vs direct | link bytes per byte read | daemon CPU s "
              "| reads as pieces |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            rate = args.reads / r["seconds"]
            print(f"| {r['system']} | {r['seconds']:.2f} | {rate:.1f} | {rate / base:.2f} | "
                  f"{r['link_bytes'] / (args.reads * piece):.2f} | {r.get('daemon_cpu_s', '-')} | "
                  f"{r.get('piece_reads', '-')} |")
        if args.json:
            write_rows(args.json, args, rows)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

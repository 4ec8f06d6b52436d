"""One large file read warm the ways training reads it: whole, or through a memory map kept
for the whole run, and again after the daemon restarts over its cache.

    python -m benchmarks.largefile                                   # 1.5 GiB, sequential
    python -m benchmarks.largefile --access mmap --size-mb 256      # 4 forked readers fault
                                                                     # every page of one map
    python -m benchmarks.largefile --quick                           # seconds

One object of ``--size-mb`` on a SeaweedFS origin on loopback (no link emulator: the
epochs after the first are what is measured, and the first only fills the cache). For each
system it runs three epochs, the machine's page cache dropped before each (so every byte
is asked of the file system):

- ``cold``: the first epoch, with an empty cache;
- ``warm``: the same mount again. With ``--access mmap`` the *same map* is read again, as
  a Dataset that maps its Arrow or token file in ``__init__`` does: its handle was opened
  before the file was cached;
- ``restarted``: the daemon stopped and started again over the same cache directory (a
  node's mount recovered after a crash, a rolling upgrade), the file opened (mapped) anew.

``--access seq`` reads the file in 1 MiB ``read()`` calls, as ``dd`` or a shard reader does;
``--access mmap`` maps it once and has ``--workers`` forked processes fault every 4 KiB page
in a shuffled order (every page once per epoch); ``--access mmap-each`` has ``--workers``
processes each open and map the file themselves, their maps kept across epochs as well (a
node's training processes each mapping the same token file), and fault the pages the same
way. Every byte read is compared with the object. The baseline, measured in the same run, is
``local``: the same reads of a copy of the object on this machine's disk, with its page cache
dropped the same way.

Reported per epoch: seconds, MB/s, the ratio to local, the daemon's CPU seconds, and (from
its metrics) the FUSE READs it answered and the handles it bound to its own read loop late
(``cachefs_passthrough_upgraded_total``). Systems: ``cachefs`` (passthrough where the kernel
has it) and ``cachefs-nopt`` (``--passthrough off``: the native read loop). Needs root (the
page cache is dropped) and FUSE.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from benchmarks.origin import SeaweedOrigin
from benchmarks.systems import Mounted, mount_cachefs
from benchmarks.util import drop_caches, fuse_usable, proc_sample, scrape_labeled, stop_cleanly_on_signals, write_rows

BUCKET, PREFIX, KEY = "bench", "large", "big.bin"
SYSTEMS = ("cachefs", "cachefs-nopt")
PAGE = 4096
CHUNK = 1 << 20


def _make_object(path: Path, size: int, seed: int) -> str:
    """Write ``size`` pseudo-random bytes to ``path``; their digest (XXH3-128: the check must
    not bound the reader, as SHA-256's 1.5 GB/s would)."""
    rng = random.Random(seed)
    digest = xxhash.xxh3_128()
    with open(path, "wb") as f:
        left = size
        while left:
            block = rng.randbytes(min(64 << 20, left))
            digest.update(block)
            f.write(block)
            left -= len(block)
    return digest.hexdigest()


def read_sequential(path: Path) -> str:
    """Read the whole file in 1 MiB read() calls (into one buffer, as ``dd`` does); the digest
    of what was read."""
    digest = xxhash.xxh3_128()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


#: What the forked readers of a map read: set before they are forked.
_MAP: dict[str, Any] = {}


def _fault_pages(job: tuple[int, int]) -> bytes:
    """(forked reader) Fault the pages of ``job`` (a slice of the shuffled order); each page
    is hashed with its index, and the digests XORed (the parent combines the workers' the
    same way: independent of the order)."""
    start, stop = job
    return _digest_pages(_MAP["map"], _MAP["order"][start:stop]).to_bytes(16, "little")


def page_digest(data_path: Path, size: int) -> bytes:
    """The order-free digest of every page of the object (what _fault_pages combines to)."""
    acc = 0
    with open(data_path, "rb") as f:
        for i in range((size + PAGE - 1) // PAGE):
            page = f.read(PAGE)
            acc ^= int.from_bytes(xxhash.xxh3_128_digest(page, seed=i),
                                  "little")
    return acc.to_bytes(16, "little")


def _shuffled_pages(size: int, seed: int) -> list[int]:
    order = list(range((size + PAGE - 1) // PAGE))
    random.Random(seed).shuffle(order)
    return order


def _digest_pages(mapped: mmap.mmap, pages: list[int]) -> int:
    acc = 0
    for i in pages:
        acc ^= int.from_bytes(xxhash.xxh3_128_digest(mapped[i * PAGE:(i + 1) * PAGE], seed=i),
                              "little")
    return acc


def _map_and_serve(path: str, conn: Any) -> None:
    """(a reader process of :class:`OwnMaps`) Map ``path`` once, then fault the pages each
    job names, answering their combined digest, until told None."""
    fd = os.open(path, os.O_RDONLY)
    mapped = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    conn.send("mapped")
    while (job := conn.recv()) is not None:
        if job == "forget":  # (pages this process maps are not dropped with the page cache)
            mapped.madvise(mmap.MADV_DONTNEED)
            conn.send("forgot")
        else:
            conn.send(_digest_pages(mapped, job))
    mapped.close()
    os.close(fd)


class OwnMaps:
    """``workers`` processes that each open and map the file once, their own handle, and keep
    it across epochs: each training process of a node (torchrun's ranks) mapping the same
    token file in its Dataset's ``__init__``."""

    def __init__(self, path: Path, workers: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        self._readers: list[tuple[Any, Any]] = []
        for _ in range(workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_map_and_serve, args=(str(path), child), daemon=True)
            proc.start()
            self._readers.append((proc, parent))
        for _, conn in self._readers:
            if conn.recv() != "mapped":
                raise SystemExit("largefile: a reader could not map the file")

    def fault(self, order: list[int]) -> bytes:
        """Fault every page of ``order``, split among the readers; the combined digest."""
        step = (len(order) + len(self._readers) - 1) // len(self._readers)
        for k, (_, conn) in enumerate(self._readers):
            conn.send(order[k * step:(k + 1) * step])
        acc = 0
        for _, conn in self._readers:
            acc ^= conn.recv()
        return acc.to_bytes(16, "little")

    def forget(self) -> None:
        """Unmap every page the readers faulted (their maps stay), so that dropping the page
        cache drops them too."""
        for _, conn in self._readers:
            conn.send("forget")
        for _, conn in self._readers:
            conn.recv()

    def close(self) -> None:
        for proc, conn in self._readers:
            conn.send(None)
            proc.join(60)
        self._readers = []


def read_mapped(mapped: mmap.mmap, size: int, workers: int, seed: int) -> bytes:
    """Fault every page of ``mapped`` once, in a shuffled order split among ``workers``
    forked processes (a DataLoader's workers); the combined page digest."""
    import concurrent.futures
    import multiprocessing

    order = _shuffled_pages(size, seed)
    pages = len(order)
    _MAP.update(map=mapped, order=order)
    try:
        step = (pages + workers - 1) // workers
        jobs = [(k, min(k + step, pages)) for k in range(0, pages, step)]
        with concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("fork")) as pool:
            acc = 0
            for part in pool.map(_fault_pages, jobs):
                acc ^= int.from_bytes(part, "little")
        return acc.to_bytes(16, "little")
    finally:
        _MAP.clear()


def _metric(m: Mounted | None, sample: str) -> float:
    """A sample of the daemon's metrics, labels in its name (:func:`scrape_labeled`)."""
    return scrape_labeled(m.metrics_url).get(sample, 0.0) if m is not None and m.metrics_url else 0.0


def _fuse_reads(m: Mounted | None) -> float:
    # Every FUSE READ, whoever answered it (the native loop's are counted here too).
    return _metric(m, "cachefs_fuse_requests_total{op=read}")


class Epochs:
    """Runs and records the epochs of one system; ``read(path_or_map)`` is the access."""

    def __init__(self, system: str, size: int, expect: Any, access: str, workers: int,
                 seed: int) -> None:
        self.system, self.size, self.expect = system, size, expect
        self.access, self.workers, self.seed = access, workers, seed
        self.rows: list[dict[str, Any]] = []
        self._map: tuple[int, mmap.mmap] | None = None
        self._own: OwnMaps | None = None

    def _open_map(self, path: Path) -> mmap.mmap:
        self.close_map()
        fd = os.open(path, os.O_RDONLY)
        self._map = (fd, mmap.mmap(fd, 0, prot=mmap.PROT_READ))
        return self._map[1]

    def close_map(self) -> None:
        if self._own is not None:
            self._own.close()
            self._own = None
        if self._map is not None:
            fd, mapped = self._map
            mapped.close()
            os.close(fd)
            self._map = None

    def epoch(self, name: str, path: Path, m: Mounted | None, *, remap: bool) -> None:
        if self._own is not None:
            self._own.forget()
        if not drop_caches():
            raise SystemExit("largefile: dropping the page cache needs root")
        mapped = None
        if self.access == "mmap":
            mapped = self._open_map(path) if remap or self._map is None else self._map[1]
        elif self.access == "mmap-each" and (remap or self._own is None):
            self.close_map()
            self._own = OwnMaps(path, self.workers)
        cpu0 = proc_sample(m.pid) if m is not None and m.pid else None
        reads0, upgraded0 = _fuse_reads(m), _metric(m, "cachefs_passthrough_upgraded_total")
        t0 = time.perf_counter()
        if self._own is not None:
            got: Any = self._own.fault(_shuffled_pages(self.size, self.seed))
        elif mapped is not None:
            got = read_mapped(mapped, self.size, self.workers, self.seed)
        else:
            got = read_sequential(path)
        seconds = time.perf_counter() - t0
        if got != self.expect:
            raise SystemExit(f"largefile: {self.system} {name}: wrong bytes")
        row: dict[str, Any] = {"system": self.system, "epoch": name, "seconds": round(seconds, 3),
                               "MB_per_s": round(self.size / seconds / 1e6, 1)}
        if cpu0 is not None and m is not None and m.pid:
            cpu1 = proc_sample(m.pid)
            if cpu1 is not None:
                row["daemon_cpu_s"] = round(cpu1.cpu_s - cpu0.cpu_s, 2)
            row["fuse_reads"] = int(_fuse_reads(m) - reads0)
            row["upgraded"] = int(_metric(m, "cachefs_passthrough_upgraded_total") - upgraded0)
        self.rows.append(row)
        print(json.dumps(row), flush=True)


def run_local(copy: Path, size: int, expect: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    e = Epochs("local", size, expect, args.access, args.workers, args.seed)
    try:
        e.epoch("cold", copy, None, remap=True)  # (a local file is never cold: its disk)
        e.epoch("warm", copy, None, remap=False)
        e.epoch("restarted", copy, None, remap=True)
    finally:
        e.close_map()
    return e.rows


def run_cachefs(system: str, endpoint: str, work: Path, size: int, expect: Any,
                args: argparse.Namespace) -> list[dict[str, Any]]:
    extra = list(args.cachefs_arg) + (["--passthrough", "off"] if system == "cachefs-nopt" else [])
    run = work / system
    cache = run / "kept-cache"
    e = Epochs(system, size, expect, args.access, args.workers, args.seed)

    def mounted(body: Callable[[Mounted], None]) -> None:
        with mount_cachefs(endpoint, BUCKET, PREFIX, run, extra=extra, keep_cache=cache) as m:
            try:
                body(m)
            finally:
                e.close_map()  # (before the unmount: a map holds the file open)

    run.mkdir(parents=True)
    mounted(lambda m: (e.epoch("cold", m.root / KEY, m, remap=True),
                       e.epoch("warm", m.root / KEY, m, remap=False)))
    mounted(lambda m: e.epoch("restarted", m.root / KEY, m, remap=True))
    shutil.rmtree(cache, ignore_errors=True)
    return e.rows


def main(argv: list[str] | None = None) -> int:
    stop_cleanly_on_signals()
    ap = argparse.ArgumentParser(prog="python -m benchmarks.largefile",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma list of {', '.join(SYSTEMS)} (local is always measured)")
    ap.add_argument("--size-mb", type=int, default=1536)
    ap.add_argument("--access", choices=("seq", "mmap", "mmap-each"), default="seq",
                    help="seq: read() calls; mmap: one map faulted by --workers forked readers; "
                         "mmap-each: --workers processes that each map the file themselves")
    ap.add_argument("--workers", type=int, default=4, help="reader processes of the mmap accesses")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cachefs-arg", action="append", default=[],
                    help="extra argument for cachefs mount (repeatable)")
    ap.add_argument("--quick", action="store_true", help="64 MB")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--workdir", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mb = 64
    if args.size_mb <= 0 or args.workers <= 0:
        print("largefile: --size-mb and --workers must be positive", file=sys.stderr)
        return 2
    ok, why = fuse_usable()
    if not ok:
        print(f"FUSE is not usable here: {why}", file=sys.stderr)
        return 1
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        print(f"unknown system: {', '.join(bad)}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("largefile: needs root (the page cache is dropped before each epoch)", file=sys.stderr)
        return 1
    size = args.size_mb << 20
    work = args.workdir or Path(tempfile.mkdtemp(prefix="cachefs-largefile-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    try:
        copy = work / "local" / KEY
        copy.parent.mkdir(parents=True, exist_ok=True)
        digest = _make_object(copy, size, args.seed)
        expect: Any = digest if args.access == "seq" else page_digest(copy, size)
        with SeaweedOrigin(work / "s3") as origin:
            origin.ensure_bucket(BUCKET)
            with open(copy, "rb") as f:
                origin.client().upload_fileobj(f, BUCKET, f"{PREFIX}/{KEY}")
            rows += run_local(copy, size, expect, args)
            for system in systems:
                rows += run_cachefs(system, f"http://127.0.0.1:{origin.s3_port}", work, size,
                                    expect, args)
        local = {r["epoch"]: r["MB_per_s"] for r in rows if r["system"] == "local"}
        how = {"seq": "1 MiB read() calls",
               "mmap": f"every page of one map faulted by {args.workers} forked readers, shuffled",
               "mmap-each": f"every page faulted, shuffled, by {args.workers} processes that each "
                            "map the file"}[args.access]
        print(f"\n{args.size_mb} MiB object, {how}; page cache dropped before each epoch; "
              f"SeaweedFS on loopback")
        print("| system | epoch | seconds | MB/s | vs local | daemon CPU s | FUSE READs | bound late |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['system']} | {r['epoch']} | {r['seconds']:.2f} | {r['MB_per_s']:.0f} | "
                  f"{r['MB_per_s'] / local[r['epoch']]:.2f} | {r.get('daemon_cpu_s', '-')} | "
                  f"{r.get('fuse_reads', '-')} | {r.get('upgraded', '-')} |")
        if args.json:
            write_rows(args.json, args, rows)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

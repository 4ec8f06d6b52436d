"""Warm reads of one large object after a daemon restart: ``python -m benchmarks.restart``.

A new daemon over a warm cache trusts none of the last daemon's written marks, so an
object too large to be read back at its open (``MAX_OBJECT_BYTES``, 1 GiB) is served by
the daemon until something reads it back whole. This measures that case end to end:

1. one object of ``--size-mib`` (default 1536) in SeaweedFS on loopback (no link
   emulator), and its copy on local disk (the reference);
2. cachefs mounted, the object read once (cold: cached), the daemon stopped and mounted
   again on the same cache directory (a restart);
3. ``--passes`` warm passes, each ``dd bs=1M`` of the mounted file after dropping the page
   cache: MB/s and the daemon's CPU seconds per pass. After the first pass the script
   waits (at most ``--settle`` seconds; objects over 1 GiB only) for a read-back in the background to end
   (``cachefs_passthrough_read_backs_total``; a build without it has nothing to wait for)
   and reports how long it took and the daemon CPU meanwhile. ``--first open``: an open
   that reads nothing comes first instead (the read-back then runs alone, its time and CPU
   reported), then the passes.

Root (passthrough, dropping the page cache). One JSON line per run on stdout; the load
average at the start and the end goes with it (others may share the machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

from benchmarks.origin import SeaweedOrigin
from benchmarks.systems import Mounted, mount_cachefs
from benchmarks.util import drop_caches, proc_sample, scrape_metrics

BUCKET = "restart"
PREFIX, NAME = "shards", "big.bin"
READ_BACKS = "cachefs_passthrough_read_backs_total"


def _dd(path: Path) -> float:
    """Seconds to read ``path`` whole with dd (bs=1M) after dropping the page cache."""
    if not drop_caches():
        raise SystemExit("dropping the page cache needs root")
    start = time.monotonic()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], check=True,
                   capture_output=True)
    return time.monotonic() - start


def _make_object(path: Path, size: int) -> None:
    chunk = os.urandom(16 << 20)
    with open(path, "wb") as f:
        left = size
        while left > 0:
            f.write(chunk[:min(left, len(chunk))])
            left -= len(chunk)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    size = args.size_mib << 20
    local = work / "big.bin"
    _make_object(local, size)
    out: dict[str, Any] = {"size_mib": args.size_mib, "passthrough": args.passthrough,
                           "load_start": os.getloadavg()}
    ref = _dd(local)
    out["local_disk_MBps"] = round(size / ref / 1e6)
    with SeaweedOrigin(work / "origin", bucket=BUCKET) as origin:
        origin.client().upload_file(str(local), BUCKET, f"{PREFIX}/{NAME}")

        def mounted() -> contextlib.AbstractContextManager[Mounted]:
            # (the same cache directory each time: the second mount is the restart)
            return mount_cachefs(origin.endpoint, BUCKET, PREFIX, work / "run", cache_size="8G",
                                 extra=["--passthrough", args.passthrough],
                                 keep_cache=work / "cache")

        with mounted() as m:
            out["cold_s"] = round(_dd(m.root / NAME), 2)
        with mounted() as m:  # the restart: a new daemon on the same cache
            assert m.pid is not None and m.metrics_url is not None
            pid, addr = m.pid, urllib.parse.urlsplit(m.metrics_url).netloc
            path = m.root / NAME
            passes = []
            if args.first == "open":
                drop_caches()
                with open(path, "rb"):
                    pass  # (an open that reads nothing: the read-back alone, on a cold disk)
                out["read_back"] = _settle(pid, addr, args.settle)
            for i in range(args.passes):
                cpu = proc_sample(pid).cpu_s  # type: ignore[union-attr]
                took = _dd(path)
                cpu = proc_sample(pid).cpu_s - cpu  # type: ignore[union-attr]
                passes.append({"MBps": round(size / took / 1e6), "daemon_cpu_s": round(cpu, 2)})
                if i == 0 and size > 1 << 30 and args.first == "read":  # (MAX_OBJECT_BYTES: smaller ones need none)
                    out["read_back"] = _settle(pid, addr, args.settle)
            out["passes"] = passes
            metrics = scrape_metrics(addr)
            out["passthrough_opens"] = metrics.get("cachefs_passthrough_opens_total", 0)
            out["read_backs"] = metrics.get(READ_BACKS)
    out["load_end"] = os.getloadavg()
    return out


def _settle(pid: int, addr: str, limit: float) -> dict[str, Any] | None:
    """Wait for the read-back the first pass queued; None for a build without one."""
    start, cpu = time.monotonic(), proc_sample(pid).cpu_s  # type: ignore[union-attr]
    while True:
        m = scrape_metrics(addr)
        if READ_BACKS not in m:
            return None
        if m[READ_BACKS] >= 1 or time.monotonic() - start > limit:
            break
        time.sleep(0.25)  # (a scrape costs the daemon CPU too)
    return {"after_pass_s": round(time.monotonic() - start, 2),
            "daemon_cpu_s": round(proc_sample(pid).cpu_s - cpu, 2),  # type: ignore[union-attr]
            "done": m[READ_BACKS]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.restart", description=__doc__)
    ap.add_argument("--size-mib", type=int, default=1536)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--passthrough", choices=("auto", "off"), default="auto")
    ap.add_argument("--settle", type=float, default=120.0)
    ap.add_argument("--first", choices=("read", "open"), default="read",
                    help="after the restart, the first pass is a read (default), or an open "
                    "that reads nothing first (the read-back alone is timed)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where the object, the origin and the cache go (default: a "
                    "temporary directory, removed after)")
    args = ap.parse_args(argv)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="restart-", dir=args.workdir))
    try:
        print(json.dumps(run(args, work)), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

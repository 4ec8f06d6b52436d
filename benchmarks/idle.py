"""What an idle mount costs: the daemon's CPU and wake-ups while nothing reads.

    python -m benchmarks.idle [--seconds 20] [--files 50]

Starts a SeaweedFS origin on loopback with ``--files`` small objects, mounts them
with cachefs, reads each once (so the mount has listings, cache entries and
metrics, as after a job), waits 3 s, then measures the daemon over ``--seconds``
of idleness: CPU (user + system, every thread, from ``/proc``), as a share of
one core, and the context switches of each thread that woke up. A node of a
training cluster runs one such daemon per mount all the time, between jobs too.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from benchmarks.origin import SeaweedOrigin
from benchmarks.systems import mount_cachefs
from benchmarks.util import CLK_TCK, fuse_usable, proc_sample, thread_samples

BUCKET = "idle"


def thread_wakeups(pid: int) -> dict[str, tuple[int, float]]:
    """(context switches, CPU seconds) so far of each thread, by ``tid:name``."""
    return {f"{t.tid}:{t.name}": (t.voluntary + t.involuntary, t.cpu_s)
            for t in thread_samples(pid)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.idle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--files", type=int, default=50)
    args = ap.parse_args(argv)
    ok, why = fuse_usable()
    if not ok:
        print(f"FUSE is not usable here: {why}")
        return 1
    with tempfile.TemporaryDirectory(prefix="cachefs-idle-") as tmp:
        work = Path(tmp)
        with SeaweedOrigin(work / "s3") as origin:
            origin.ensure_bucket(BUCKET)
            s3 = origin.client()
            for i in range(args.files):
                s3.put_object(Bucket=BUCKET, Key=f"ds/c{i % 5}/f{i}.bin", Body=os.urandom(4096))
            with mount_cachefs(origin.endpoint, BUCKET, "ds", work / "run") as m:
                for i in range(args.files):
                    (m.root / f"c{i % 5}" / f"f{i}.bin").read_bytes()
                time.sleep(3.0)
                assert m.pid is not None
                cpu0, threads0, t0 = proc_sample(m.pid).cpu_s, thread_wakeups(m.pid), time.monotonic()  # type: ignore[union-attr]
                time.sleep(args.seconds)
                cpu1, threads1 = proc_sample(m.pid).cpu_s, thread_wakeups(m.pid)  # type: ignore[union-attr]
                wall = time.monotonic() - t0
    print(f"idle daemon: {100 * (cpu1 - cpu0) / wall:.2f}% of one core over {wall:.0f} s "
          f"(/proc ticks of {1000 / CLK_TCK:.0f} ms)")
    for key, (switches, cpu) in sorted(threads1.items()):
        s0, c0 = threads0.get(key, (0, 0.0))
        if switches - s0 or cpu - c0:
            print(f"  {key.split(':', 1)[1]:<32} {(switches - s0) / wall:6.1f} wake-ups/s "
                  f"{(cpu - c0) * 1000 / wall:6.1f} ms CPU/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

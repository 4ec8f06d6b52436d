"""The C heap kept small (cachefs.heap): few arenas, and freed memory given back to the
system once a burst of reads is over, so a daemon's resident memory follows its load."""

from __future__ import annotations

import concurrent.futures
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cachefs

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def _rss_anon(pid: int | str = "self") -> int:
    """Anonymous resident memory of process ``pid``, in bytes (RssAnon: not the files it
    maps, such as the index)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def test_free_heap_memory_goes_back_to_the_system() -> None:
    """Memory freed below a live allocation stays with the process (glibc keeps it for
    reuse) until release_free_memory(), which hands its pages back. In a child interpreter:
    the allocator's state is the process's."""
    code = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from cachefs import heap
from tests.test_heap import _rss_anon
big = bytearray(16 << 20); del big  # (glibc now serves 8 MiB buffers from its heap)
freed = [bytearray(8 << 20) for _ in range(8)]
pin = bytearray(256 << 10)  # (allocated after them: the heap's top is in use)
del freed
before = _rss_anon()
took = heap.release_free_memory()
print(before, _rss_anon(), took, heap.limit_arenas())
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    before, after = int(out[0]), int(out[1])
    assert before - after >= 48 * MiB, (before >> 20, after >> 20)  # most of the 64 MiB
    assert out[2:] == ["True", "True"]


@pytest.mark.fuse
@pytest.mark.slow
def test_a_burst_of_reads_leaves_no_memory_behind_once_the_mount_is_quiet(
        bucket: Any, mount_factory: Any) -> None:
    """Sixteen readers at once, each loading 16 MiB blocks (256 MiB of buffers), with a
    64 MiB memory budget: once the reads are over and the mount is quiet, the daemon holds
    no more anonymous memory than before them plus that budget (what the memory tier may
    keep) and a little. Before, glibc kept the freed buffers in up to 8 arenas per core:
    the daemon stayed 160 MiB above where it started, for good."""
    client, name = bucket
    data = random.Random(9).randbytes(16 * MiB)
    keys = [f"d/{i:02d}.bin" for i in range(16)]
    for key in keys:
        client.put_object(Bucket=name, Key=key, Body=data)
    budget = 64 * MiB
    m = mount_factory(f"s3://{name}", "--block-size", "16M", "--passthrough", "off",
                      "--memory-budget", str(budget))
    pid = json.loads(run_cachefs("status", "--json", str(m.path)).stdout)["pid"]
    time.sleep(2)  # (quiet: the start-up's own memory was given back)
    baseline = _rss_anon(pid)

    def read(key: str) -> None:
        with open(m.path / key, "rb", buffering=0) as f:
            assert f.read() == data, key

    for _ in range(2):  # (a second round reads the same files from the disk cache)
        with concurrent.futures.ThreadPoolExecutor(len(keys)) as pool:
            list(pool.map(read, keys))
    bound = budget + 16 * MiB
    deadline = time.monotonic() + 20  # (the maintenance loop looks every second)
    while _rss_anon(pid) - baseline > bound and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _rss_anon(pid) - baseline
    assert left <= bound, f"{left >> 20} MiB above the start, {bound >> 20} allowed"

"""The daemon's garbage-collector settings (cachefs.gcpolicy): applied once the mount is
up, and the collector's pauses visible on /metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import rss, run_cachefs

REPO = Path(__file__).resolve().parent.parent


def test_settle_after_startup_freezes_what_startup_made_and_spaces_young_collections() -> None:
    # In a child interpreter: the settings are process-wide, and pytest's own are left alone.
    code = ("import gc; from cachefs import gcpolicy, metrics; "
            "before = gc.get_freeze_count(); gcpolicy.settle_after_startup(); "
            "print(before, gc.get_freeze_count(), *gc.get_threshold(), gc.isenabled())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    before, frozen, young, middle, old, enabled = out
    assert int(before) == 0 and int(frozen) > 10_000  # the modules and their state
    from cachefs import gcpolicy
    assert (int(young), int(middle), int(old)) == (
        gcpolicy.YOUNG_THRESHOLD, gcpolicy.OLDER_THRESHOLD, gcpolicy.OLDER_THRESHOLD)
    assert enabled == "True"  # cycles are still freed


@pytest.mark.fuse
def test_a_mount_collects_rarely_while_it_serves(bucket, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """Reads through a live mount: the collector's counts are on /metrics, and the young
    generation is collected about once per hundred requests, not every few (CPython's
    default threshold of 700 allocations ran ~0.1 young collections per small file
    read cold, each holding the interpreter lock)."""
    client, name = bucket
    files = {f"d/{i:03d}.bin": bytes([i]) * 20_000 for i in range(200)}
    for key, body in files.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    m = mount_factory(f"s3://{name}")
    young = 'python_gc_collections_total{generation="0"}'
    before = m.metric(young)
    for key, body in files.items():
        assert (m.path / key).read_bytes() == body
    collections = m.metric(young) - before
    assert collections < len(files) / 40, collections


@pytest.mark.fuse
def test_blocks_read_cold_are_freed_without_waiting_for_a_full_collection(  # type: ignore[no-untyped-def]
        bucket, mount_factory) -> None:
    """A GET's answer is freed once the reader has it, by reference counting: nothing in
    the request path (a job and what it waits on) holds it in a cycle. With the young
    generation collected every 5,000 net container allocations (gcpolicy) such a cycle
    lived for hundreds of GETs: a cold sequential read of 1.5 GiB with --memory-budget 64M
    left the daemon at 1.17 GiB RSS, a read of 128 MiB here grew it by ~128 MiB."""
    client, name = bucket
    size = 128 << 20
    data = os.urandom(size)
    client.put_object(Bucket=name, Key="big.bin", Body=data)
    m = mount_factory(f"s3://{name}", "--block-size", "1M", "--memory-budget", "16M",
                      "--passthrough", "off")
    pid = json.loads(run_cachefs("status", "--json", str(m.path)).stdout)["pid"]
    assert (m.path / "big.bin").stat().st_size == size
    before = rss(pid)
    with open(m.path / "big.bin", "rb", buffering=0) as f:
        for off in range(0, size, 1 << 20):
            assert f.read(1 << 20) == data[off:off + (1 << 20)], off
    grown = rss(pid) - before
    # the memory budget (16 MiB, a quarter of it the memory tier) and the allocator's
    # slack, far from the 128 MiB read
    assert grown < 64 << 20, f"RSS grew by {grown >> 20} MiB reading {size >> 20} MiB"

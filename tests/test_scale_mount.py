"""Real mounts against the synthetic S3 endpoint: a large flat directory streams to readdir,
and an expired listing is served while its refresh waits on S3 (stale-while-revalidate)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.synthetic_s3 import SyntheticS3, content, serve, size_of
from tests.conftest import free_port, fuse_unusable_reason, is_mounted, scrape

pytestmark = pytest.mark.fuse


@pytest.fixture
def synthetic() -> Iterator[SyntheticS3]:
    with serve() as server:
        yield server


@pytest.fixture
def mount(tmp_path: Path, synthetic: SyntheticS3) -> Iterator[Any]:
    reason = fuse_unusable_reason()
    if reason:
        pytest.skip(reason)
    made: list[Path] = []

    def make(bucket: str, *extra: str) -> tuple[Path, str]:
        mp = tmp_path / f"mnt{len(made)}"
        mp.mkdir()
        made.append(mp)
        addr = f"127.0.0.1:{free_port()}"
        proc = subprocess.run(
            [sys.executable, "-m", "cachefs", "mount", f"s3://{bucket}", str(mp), "--cache-dir",
             str(tmp_path / f"cache{len(made)}"), "--endpoint-url", synthetic.url,
             "--metrics-addr", addr, *extra], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return mp, addr

    yield make
    for mp in made:
        if is_mounted(mp):
            subprocess.run([sys.executable, "-m", "cachefs", "unmount", str(mp)], timeout=60)
        if is_mounted(mp):
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], check=False)


@pytest.mark.slow
def test_a_large_flat_directory_streams_to_readdir(synthetic: SyntheticS3, mount: Any) -> None:
    n = 30_000
    synthetic.list_delay = 0.1
    # (--list-ahead 0: the mount does not list its first path, flat/, itself; this readdir
    # starts the listing, as the first access to a directory off that path does)
    mp, addr = mount(f"flat-{n}", "--list-ahead", "0")
    synthetic.counts.clear()
    names: list[str] = []
    lists_at_first = -1
    with os.scandir(mp / "flat") as it:
        for entry in it:
            if lists_at_first < 0:
                lists_at_first = synthetic.counts["list_v2"]
            names.append(entry.name)
    # The first names came while most of the listing (30 pages at least) was still to come.
    assert 0 < lists_at_first < 15, lists_at_first
    assert names == [f"f{i:07d}.jpg" for i in range(n)]  # all, once each, in order
    assert synthetic.counts["list_v2"] >= n // 1000  # (and some ranges came back empty)
    key = "flat/f0012345.jpg"
    p = mp / "flat" / "f0012345.jpg"
    assert p.stat().st_size == size_of(key)
    assert p.read_bytes() == content(key)
    lists = synthetic.counts["list_v2"]
    assert sorted(os.listdir(mp / "flat")) == names  # from the index: no new listing
    assert synthetic.counts["list_v2"] == lists
    assert scrape(addr)["cachefs_metadata_listings_total"] >= 2  # the root and flat/


def test_expired_listing_is_served_while_the_refresh_waits(synthetic: SyntheticS3, mount: Any) -> None:
    mp, addr = mount("tree-3x5", "--metadata-ttl", "1s", "--list-ahead", "0")
    f = mp / "d00001" / "f0000002.jpg"
    assert f.read_bytes() == content("d00001/f0000002.jpg")
    time.sleep(1.5)  # the listings (and the kernel's entries) expire
    synthetic.list_gate = gate = threading.Event()  # S3 stops answering listings
    try:
        before = synthetic.counts["list_v2"]
        done = threading.Event()
        result: dict[str, Any] = {}

        def use() -> None:
            result["names"] = sorted(os.listdir(mp / "d00001"))
            result["size"] = f.stat().st_size
            result["data"] = f.read_bytes()
            done.set()

        t = threading.Thread(target=use, daemon=True)
        t.start()
        # Answered from the old listings while their refreshes are held at S3.
        assert done.wait(30), "a lookup waited on S3 for a directory it had a listing of"
        assert result["names"] == [f"f{i:07d}.jpg" for i in range(5)]
        assert result["size"] == size_of("d00001/f0000002.jpg")
        assert result["data"] == content("d00001/f0000002.jpg")
        deadline = time.monotonic() + 10
        while synthetic.counts["list_v2"] == before:  # a refresh was started in the background
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        gate.set()
    deadline = time.monotonic() + 20
    while scrape(addr).get("cachefs_metadata_listings_total", 0) < 3:
        assert time.monotonic() < deadline, "the refresh never completed"
        time.sleep(0.1)

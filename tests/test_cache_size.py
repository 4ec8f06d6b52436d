"""``--cache-size`` bounds the disk the cache's files take, through a real mount."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

pytestmark = pytest.mark.fuse

CAP = 1 << 20


@pytest.mark.parametrize("policy", ["keep", "lru"])
def test_tiny_files_keep_the_cache_files_within_the_cache_size(
        bucket: Any, mount_factory: Any, policy: str) -> None:
    """400 files of 100-1,500 bytes (320 KB of data) read through a mount with a 1 MiB
    cache: each cache file takes at least a file-system block, 1.6 MiB in all had every
    file been cached. The cache counts what its files take on disk, so they stay within
    the cap, and ``cachefs_cache_used_bytes`` is never less than that disk use."""
    client, name = bucket
    rng = random.Random(7)
    files = {f"ds/f{i:03d}.bin": rng.randbytes(rng.randint(100, 1500)) for i in range(400)}
    for key, body in files.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--cache-size", str(CAP),
                      "--cache-policy", policy)
    for key, body in files.items():
        assert (m.path / key).read_bytes() == body

    # Once the reads are done and every write-back has landed (and, under lru, the bytes
    # of evicted blocks that a registration held are released: at the next maintenance
    # pass), the files take no more than the index counts. The deadline is a hang guard.
    deadline = time.monotonic() + 60
    while True:
        used = m.metric("cachefs_cache_used_bytes")
        disk = m.cache_bytes_on_disk()
        if m.metric("cachefs_open_file_handles") == 0 and disk <= used <= CAP:
            break
        assert time.monotonic() < deadline, (
            f"the cache files take {disk} bytes; used bytes {used:.0f}, cap {CAP}")
        time.sleep(0.1)
    assert used > CAP // 2, "the cache was not filled"
    if policy == "lru":
        assert m.metric("cachefs_cache_evictions_total") > 0


@pytest.mark.parametrize("policy", ["keep", "lru"])
def test_a_lower_cache_size_trims_the_cache_down_to_it(
        bucket: Any, mount_factory: Any, policy: str) -> None:
    """A cache filled under one --cache-size and mounted again under a lower one is
    evicted down to the new cap while the mount serves, under either policy (keep,
    which never evicts to admit, stayed over the cap for good), least recently used
    first; every byte read after is still right."""
    client, name = bucket
    rng = random.Random(11)
    files = {f"ds/f{i:03d}.bin": rng.randbytes(20_000) for i in range(100)}  # ~2 MB
    for key, body in files.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--cache-size", "4M",
                      "--cache-policy", policy)
    for key, body in files.items():
        assert (m.path / key).read_bytes() == body
    deadline = time.monotonic() + 30
    while m.metric("cachefs_cache_blocks") < len(files):  # (written behind the reads)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    filled = m.metric("cachefs_cache_used_bytes")
    m.stop()
    m.extra[m.extra.index("4M")] = str(CAP)
    m.start()
    deadline = time.monotonic() + 30
    while not (m.metric("cachefs_cache_used_bytes") <= CAP
               and m.cache_bytes_on_disk() <= CAP):
        assert time.monotonic() < deadline, (m.metric("cachefs_cache_used_bytes"),
                                             m.cache_bytes_on_disk())
        time.sleep(0.1)
    assert filled > CAP and m.metric("cachefs_cache_evictions_total") > 0
    for key, body in files.items():
        assert (m.path / key).read_bytes() == body

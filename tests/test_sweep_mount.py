"""The sweep on a real mount (moto on loopback): a directory of small files read in an order
nothing predicts is fetched ahead into free cache space, never evicting, never far ahead
of a reader of a small subset. Outcomes come from the daemon's metrics; nothing here
depends on how fast anything runs (the tests wait for the sweep to settle)."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

FILE = 8_000
# 64 KiB blocks; a memory budget of 1 MiB leaves 768 KiB for fetches, so a readahead
# window (and the sweep's free-space margin) of 128 KiB, and a sweep may be 256 KiB
# (twice the readahead bound) plus twice what readers read ahead of them.
ARGS = ("--block-size", "64K", "--memory-budget", "1M")
AHEAD = 256 * 1024
MARGIN = 128 * 1024


def _body(key: str) -> bytes:
    return random.Random(key).randbytes(FILE)


def _put_dir(client: Any, bucket: str, prefix: str, n: int) -> list[str]:
    keys = [f"{prefix}img{i:04d}.jpg" for i in range(n)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: client.put_object(Bucket=bucket, Key=k, Body=_body(k)), keys))
    return keys


def _read(m: Any, key: str) -> None:
    assert (m.path / key).read_bytes() == _body(key)


def _settled(m: Any, reason: str, timeout: float = 60.0) -> dict[str, float]:
    """The metrics once the sweep stopped for ``reason`` and nothing is in flight."""
    deadline = time.monotonic() + timeout
    while True:
        got = m.metrics()
        if (got.get(f'cachefs_sweep_stops_total{{reason="{reason}"}}', 0) >= 1
                and got.get("cachefs_inflight_fetches", 0) == 0
                and got.get("cachefs_inflight_bytes", 0) == 0):
            return got
        assert time.monotonic() < deadline, f"the sweep did not stop for {reason}: {got}"
        time.sleep(0.05)


def _scattered(keys: list[str], n: int) -> list[str]:
    """``n`` keys far apart in listing order, not in order."""
    picks = keys[::max(1, len(keys) // n)][:n]
    random.Random(7).shuffle(picks)
    return picks


def test_a_shuffled_reader_of_a_folder_gets_most_files_from_the_sweep(
        bucket: Any, mount_factory: Any) -> None:
    client, name = bucket
    keys = _put_dir(client, name, "train/c000/", 60)  # 480 KB
    # A 4 MiB budget: a readahead bound of 512 KiB, so the whole folder is within the
    # sweep's reach (twice that) before the reader takes more than its first six files.
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--memory-budget", "4M")
    first = _scattered(keys, 6)
    for key in first:  # scattered misses start the sweep
        _read(m, key)
    assert m.metric('cachefs_sweep_directories_total{cause="misses"}') == 1
    got = _settled(m, "done")
    swept = got["cachefs_sweep_files_total"]
    assert swept >= 54, f"only {swept:.0f} of the 54 files not read yet were swept"
    order = keys[:]
    random.Random(3).shuffle(order)
    for key in order:
        _read(m, key)
    got = m.metrics()
    assert got['cachefs_s3_requests_total{op="get"}'] == 60, "one GET per file, none twice"
    assert got['cachefs_prefetch_used_bytes_total{policy="sweep"}'] == \
        got['cachefs_prefetch_issued_bytes_total{policy="sweep"}'] == got["cachefs_sweep_bytes_total"]
    assert got["cachefs_sweep_unread_bytes"] == 0


def test_a_sweep_never_evicts_a_nearly_full_cache(bucket: Any, mount_factory: Any) -> None:
    client, name = bucket
    old = _put_dir(client, name, "old/", 40)
    keys = _put_dir(client, name, "train/c000/", 150)
    # LRU, the policy that would evict: 768 KiB, of which the old files take 320 KB.
    m = mount_factory(f"s3://{name}", *ARGS, "--cache-size", "768K", "--cache-policy", "lru")
    for key in old:
        _read(m, key)
    for key in _scattered(keys, 6):
        _read(m, key)
    got = _settled(m, "no_space")
    # 768 KiB - 46 files cached (8 KiB each on disk) - the 128 KiB margin: room for 34 files
    swept = got["cachefs_sweep_files_total"]
    assert swept >= 30, f"{swept:.0f} files swept"
    assert got["cachefs_cache_evictions_total"] == 0, "the sweep evicted cached blocks"
    # Most of the margin stays free (the cache's count of used bytes, which the sweep
    # reads, can lag a few concurrent writes behind).
    assert got["cachefs_cache_used_bytes"] <= 768 * 1024 - MARGIN // 2
    assert got["cachefs_cache_blocks"] >= len(old) + 6 + 30, \
        f"every file is still cached: {got['cachefs_cache_blocks']:.0f} blocks, {swept:.0f} swept"
    gets = m.gets()
    for key in old:
        _read(m, key)
    assert m.gets() == gets


def test_a_subset_reader_stops_the_sweep_at_its_unread_bound(
        bucket: Any, mount_factory: Any) -> None:
    client, name = bucket
    keys = _put_dir(client, name, "train/c000/", 300)  # 2.4 MB
    m = mount_factory(f"s3://{name}", *ARGS)
    subset = _scattered(keys, 12)
    for key in subset:
        _read(m, key)
    got = _settled(m, "unread_bound")
    swept = got["cachefs_sweep_bytes_total"]
    read = len(subset) * FILE
    assert swept <= AHEAD + 2 * read, f"{swept:.0f} bytes swept for {read} read"
    assert got["cachefs_sweep_files_total"] < 100, "most of the folder was left alone"
    assert got['cachefs_sweep_stops_total{reason="done"}'] == 0

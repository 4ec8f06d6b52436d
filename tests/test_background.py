"""Housekeeping and background errors never end the daemon: contained, logged, counted."""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from cachefs import background, metrics
from cachefs.cache.blocks import BlockCache
from cachefs.cache.lmdbenv import LmdbEnv
from cachefs.config import resolve
from cachefs.daemon import Daemon
from cachefs.read.budget import MemoryBudget
from cachefs.read.fetcher import Fetcher, ObjectVersion
from cachefs.s3.memory import MemoryStore
from cachefs.s3.origin import Origin


def errors(task: str) -> float:
    return metrics.REGISTRY.get_sample_value("cachefs_background_errors_total",
                                             {"task": task}) or 0.0


@pytest.fixture(autouse=True)
def fresh_throttle() -> None:
    background.reset_log_throttle()


def test_contained_counts_and_logs_the_first_failure_with_its_traceback(caplog):
    before = errors("maintenance")
    with caplog.at_level(logging.WARNING, logger="cachefs.background"):
        for _ in range(5):
            with background.contained("maintenance", "syncing the index"):
                raise KeyError("boom")
    assert errors("maintenance") == before + 5
    assert len(caplog.records) == 1  # the rest are throttled
    record = caplog.records[0]
    assert record.exc_info is not None
    assert "maintenance" in record.getMessage() and "syncing the index" in record.getMessage()


def test_contained_lets_cancellation_and_exit_through():
    with pytest.raises(KeyboardInterrupt):
        with background.contained("maintenance"):
            raise KeyboardInterrupt

    async def main() -> None:
        with trio.CancelScope() as scope:
            scope.cancel()
            with background.contained("maintenance"):
                await trio.sleep(1)
            raise AssertionError("cancellation was swallowed")

    trio.run(main)


def daemon(tmp_path: Path) -> Daemon:
    cfg = resolve({"source": "s3://bucket/data", "mountpoint": str(tmp_path / "mnt"),
                   "cache_dir": str(tmp_path / "cache")}, environ={})
    return Daemon(cfg)


class BrokenCache:
    """A cache whose last-use batches fail with something that is not an OSError."""

    def __init__(self) -> None:
        self.calls = 0

    def take_touches(self) -> dict[bytes, float]:
        self.calls += 1
        raise RuntimeError("a bug in the last-use batch")

    def remove_orphans(self, older_than: float) -> int:
        raise KeyError("a bug in the orphan scan")


class Env:
    def sync(self) -> None:
        pass

    def keep_reserve(self, nbytes: int) -> bool:
        return True


def test_the_maintenance_loop_survives_any_exception(tmp_path: Path, monkeypatch: Any):
    import cachefs.daemon

    monkeypatch.setattr(cachefs.daemon, "STATUS_INTERVAL", 0.01)
    monkeypatch.setattr(cachefs.daemon, "MAINTENANCE_INTERVAL", 0.02)
    d = daemon(tmp_path)
    cache = BrokenCache()
    before = errors("maintenance")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(d._maintenance, cache, Env())
            with trio.fail_after(30):
                while cache.calls < 10:  # it keeps going after the first failure
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert errors("maintenance") == before + cache.calls


def test_the_orphan_scan_failure_is_contained(tmp_path: Path):
    d = daemon(tmp_path)
    before = errors("orphan_scan")
    trio.run(d._remove_orphans, BrokenCache())
    assert errors("orphan_scan") == before + 1


def test_a_failing_cache_write_after_a_fetch_does_not_end_the_fetcher(tmp_path: Path,
                                                                      monkeypatch: Any):
    store = MemoryStore()
    data = bytes(range(256)) * 4
    info = store.put("k", data)
    obj = ObjectVersion("k", info.etag, info.size)
    env = LmdbEnv(tmp_path / "meta.lmdb")
    cache = BlockCache(env, tmp_path, capacity=1 << 20)

    async def broken_put(bid: bytes, block: bytes) -> bool:
        raise RuntimeError("a bug in the cache write")

    monkeypatch.setattr(cache, "put", broken_put)
    before = errors("cache_write")

    async def main() -> None:
        fetcher = Fetcher(Origin(store, max_connections=4, deadline=0), cache, block_size=256,
                          budget=MemoryBudget(1 << 20), hot_capacity=0)
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run)
            assert await fetcher.read(obj, 0, len(data)) == data
            await fetcher.drain()
            assert await fetcher.read(obj, 0, len(data)) == data  # refetched: still serving
            await fetcher.drain()
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        env.close()
    assert errors("cache_write") == before + 8


def test_known_label_sets_name_every_task_and_reason_the_code_uses() -> None:
    import re

    texts = [p.read_text() for p in Path(metrics.__file__).parent.rglob("*.py")]
    source = "\n".join(texts)
    users = "\n".join(t for t in texts if "from cachefs.background import" in t)
    tasks = set(re.findall(r'\b(?:contained|report)\(\s*"(\w+)"', users))
    reasons = set(re.findall(r'_reject\(\s*"(\w+)"', source)
                  + re.findall(r'CONTROL_REJECTED\.labels\(\s*"(\w+)"', source)
                  + re.findall(r'RequestError\([^)]*?,\s*"(\w+)"\)', source, re.S))
    assert tasks and reasons
    assert tasks == set(metrics.BACKGROUND_TASKS)
    assert reasons <= set(metrics.CONTROL_REJECT_REASONS)
    metrics.create_known_series()
    for task in metrics.BACKGROUND_TASKS:
        assert metrics.REGISTRY.get_sample_value("cachefs_background_errors_total",
                                                 {"task": task}) is not None


def test_own_threads_carry_their_names_for_the_os_too() -> None:
    # The benchmarks split the daemon's CPU by thread from /proc/<pid>/task/<tid>/comm:
    # the passthrough layer's preparing threads and the readahead threads must show there
    # by name, not as "python" among the FUSE request workers.
    seen: dict[str, str] = {}
    lock = threading.Lock()
    release = threading.Event()

    def target() -> None:
        me = threading.current_thread()
        with open(f"/proc/self/task/{me.native_id}/comm") as f:
            comm = f.read().strip()
        with lock:
            seen[me.name] = comm
        release.wait(10)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(
                background.own_threads, target, 2, "cachefs-verify", stop=release.set))
            while len(seen) < 2:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    # (Linux keeps 15 bytes of a thread's name)
    assert seen == {"cachefs-verify-0": "cachefs-verify-", "cachefs-verify-1": "cachefs-verify-"}

"""DiskReadahead: cache files read into the page cache ahead of their reads, best-effort,
with its threads owned by run()."""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path

import trio

from cachefs import metrics
from cachefs.cache.readahead import DiskReadahead
from tests.conftest import drop_cached, resident

MiB = 1 << 20


def outcome(name: str) -> float:
    return metrics.DISK_READAHEAD.labels(name)._value.get()


def cold_file(path: Path, size: int) -> None:
    """A file of ``size`` bytes on disk and not in the page cache."""
    path.write_bytes(os.urandom(size))
    drop_cached(path)
    assert resident(path, 0, size) == 0, "the test's file system keeps files in memory"


async def wait_for(cond: object, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not cond():  # type: ignore[operator]
            await trio.sleep(0.01)


def test_advised_ranges_are_read_into_the_page_cache(tmp_path: Path) -> None:
    files = [tmp_path / f"f{i}" for i in range(3)]
    for f in files:
        cold_file(f, 4 * MiB)
    ra = DiskReadahead()
    advised0, missing0 = outcome("advised"), outcome("missing")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(ra.run)
            ra.advise(files[0], 0, 4 * MiB)
            ra.advise(files[1], MiB, MiB)  # one block in the middle of an object's file
            ra.advise(tmp_path / "evicted", 0, MiB)
            await wait_for(lambda: outcome("advised") - advised0 == 2
                           and outcome("missing") - missing0 == 1)
            await wait_for(lambda: resident(files[0], 0, 4 * MiB) == 4 * MiB
                           and resident(files[1], MiB, MiB) == MiB)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert resident(files[2], 0, 4 * MiB) == 0  # not asked for: left on disk
    assert resident(files[1], 3 * MiB, MiB) == 0  # outside the range asked for


def test_requests_outside_run_are_dropped_and_its_threads_are_joined(tmp_path: Path) -> None:
    f = tmp_path / "f"
    cold_file(f, MiB)
    ra = DiskReadahead()
    dropped0, advised0 = outcome("dropped"), outcome("advised")
    ra.advise(f, 0, MiB)  # not running: nothing would ever take it
    assert outcome("dropped") - dropped0 == 1 and ra.pending() == 0

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(ra.run)
            assert len(threads()) == 2
            ra.advise(f, 0, MiB)
            await wait_for(lambda: outcome("advised") - advised0 == 1)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert threads() == []  # stopped and joined before run() returned
    ra.advise(f, 0, MiB)
    assert outcome("dropped") - dropped0 == 2 and ra.pending() == 0


def threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("cachefs-readahead")]


def test_the_queue_is_bounded(tmp_path: Path) -> None:
    f = tmp_path / "f"
    cold_file(f, MiB)
    ra = DiskReadahead(queue_size=2)
    dropped0 = outcome("dropped")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(ra.run, threads=0))  # nothing takes them
            for _ in range(5):
                ra.advise(f, 0, MiB)
            assert ra.pending() == 2
            assert outcome("dropped") - dropped0 == 3
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert ra.pending() == 0  # cleared at the end of run()

"""Cold small files read in a shuffled order, on real mounts: what the read-order hint and
the sweep fetch ahead is registered by the S3 thread that writes it, given its open
template, and its name told to the native loop, so the shuffled readers' lookups and opens
are answered in C as a directory walk's are -- and every byte read is the object's, each
fetched once. The registrations ahead of the sweep take only free room among the idle
ones (``--registered-files``).

Both ways of reading a registered file: the kernel's passthrough, and the native loop
(``--passthrough off``). Outcomes come from the daemon's metrics; the tests wait for the
loads ahead to land, so nothing depends on how fast anything runs.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from cachefs import passthrough
from cachefs.fuse import native
from tests.conftest import read_unbuffered as _read

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.skipif(not passthrough.supported(),
                       reason="FUSE passthrough needs Linux >= 6.9"),
    pytest.mark.skipif(not native.AVAILABLE, reason="built without the native loop"),
]

WRITTEN = 'cachefs_passthrough_prepared_total{outcome="written"}'
FULL = 'cachefs_passthrough_prepared_total{outcome="full"}'
NATIVE = {op: f'cachefs_fuse_native_answers_total{{op="{op}"}}' for op in ("lookup", "open")}
EVERY = {op: f'cachefs_fuse_requests_total{{op="{op}"}}' for op in ("lookup", "open")}


def _put(bucket: Any, folders: int, per: int, size: int) -> tuple[str, dict[str, bytes]]:
    """``folders`` folders of ``per`` small files (one 64 KiB block each)."""
    client, name = bucket
    files = {f"train/c{c}/img{i:03d}.jpg": random.Random(f"{c}/{i}").randbytes(size + i)
             for c in range(folders) for i in range(per)}
    for key, body in files.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    return name, files


def _mount(mount_factory: Any, name: str, reader: str, *extra: str) -> Any:
    off = ("--passthrough", "off") if reader == "native" else ()
    return mount_factory(f"s3://{name}", "--block-size", "64K", "--memory-budget", "8M",
                         *off, *extra)


def _landed(m: Any, gets: int, timeout: float = 30.0) -> dict[str, float]:
    """The metrics once ``gets`` GETs ended, nothing is in flight and neither the open
    templates nor the registrations made ahead have moved for 0.5 s."""
    deadline = time.monotonic() + timeout
    seen, since = (-1.0, -1.0), time.monotonic()
    while True:
        got = m.metrics()
        now = (got.get("cachefs_native_open_templates", 0), got.get(WRITTEN, 0))
        if now != seen:
            seen, since = now, time.monotonic()
        if (got.get('cachefs_s3_requests_total{op="get"}', 0) >= gets
                and got.get("cachefs_inflight_fetches", 0) == 0
                and time.monotonic() - since >= 0.5):
            return got
        assert time.monotonic() < deadline, "the loads ahead did not land"
        time.sleep(0.05)


def _answered(m: Any, before: dict[str, tuple[float, float]], op: str) -> tuple[float, float]:
    """The ``op`` requests since ``before`` (by the loop, by Python)."""
    loop_answered, python_answered = before[op]
    return (m.metric(NATIVE[op]) - loop_answered,
            m.metric(EVERY[op]) - m.metric(NATIVE[op]) - python_answered)


def _counts(m: Any) -> dict[str, tuple[float, float]]:
    return {op: (m.metric(NATIVE[op]), m.metric(EVERY[op]) - m.metric(NATIVE[op]))
            for op in ("lookup", "open")}


def _start_sweep(m: Any, keys: list[str], files: dict[str, bytes]) -> list[str]:
    """Read three files far apart (two misses scattered from the first: the sweep of
    their folder starts); the files read."""
    first = [keys[30], keys[5], keys[50]]
    for key in first:
        assert _read(m.path / key) == files[key]
    return first


@pytest.mark.parametrize("reader", ["kernel", "native"])
def test_hinted_files_are_registered_by_their_writers_and_opened_in_c(
        bucket: Any, mount_factory: Any, reader: str) -> None:
    from cachefs.control.client import send_hint

    name, files = _put(bucket, folders=3, per=20, size=20_000)
    m = _mount(mount_factory, name, reader)
    order = sorted(files)
    random.Random(5).shuffle(order)
    # The folders are looked up first (their names are no hinted file's), as a reader's
    # first open of each would.
    for folder in sorted({k.rsplit("/", 1)[0] for k in files}):
        assert (m.path / folder).is_dir()
    assert send_hint([str(m.path / k) for k in order]) == len(order)
    got = _landed(m, len(order))
    assert got[WRITTEN] == len(order), f"{got[WRITTEN]:.0f} files registered by their S3 thread"
    assert got["cachefs_native_open_templates"] == len(order), "open templates ahead"
    before = _counts(m)
    for key in order:
        assert _read(m.path / key) == files[key], key
    # (one assertion each: a failure says whether the requests came, and who answered;
    # the kernel may look the four folders' names up again too, answered by either)
    loop, python = _answered(m, before, "lookup")
    assert loop >= len(order) - 4 and python <= 4 and loop + python >= len(order), \
        f"lookups by the loop {loop}, by Python {python}"
    assert _answered(m, before, "open") == (len(order), 0), "opens (by the loop, by Python)"
    assert m.gets() == len(order), "one GET per file"
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 0


@pytest.mark.parametrize("reader", ["kernel", "native"])
def test_swept_files_are_registered_by_their_writers_and_opened_in_c(
        bucket: Any, mount_factory: Any, reader: str) -> None:
    name, files = _put(bucket, folders=1, per=60, size=8_000)
    m = _mount(mount_factory, name, reader)
    keys = sorted(files)
    first = _start_sweep(m, keys, files)
    rest = [k for k in keys if k not in first]
    got = _landed(m, len(keys))
    assert got['cachefs_sweep_directories_total{cause="misses"}'] == 1
    assert got["cachefs_sweep_files_total"] == len(rest)
    assert got[WRITTEN] == len(rest), f"{got[WRITTEN]:.0f} files registered by their S3 thread"
    assert got["cachefs_native_open_templates"] >= len(rest), "open templates ahead"
    random.Random(3).shuffle(rest)
    before = _counts(m)
    for key in rest:
        assert _read(m.path / key) == files[key], key
    loop, python = _answered(m, before, "lookup")  # (and the two folders' names, perhaps)
    assert loop >= len(rest) and python <= 2, f"lookups by the loop {loop}, by Python {python}"
    assert _answered(m, before, "open") == (len(rest), 0), "opens (by the loop, by Python)"
    assert m.gets() == len(keys), "one GET per file"
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 0


@pytest.mark.parametrize("reader", ["kernel", "native"])
def test_a_sweep_registers_ahead_only_into_free_room(
        bucket: Any, mount_factory: Any, reader: str) -> None:
    """With room for 10 idle registrations, the sweep's files take what room is left and
    no more: a registration made ahead never closes another (the rest are registered at
    their opens, as before)."""
    name, files = _put(bucket, folders=1, per=60, size=8_000)
    m = _mount(mount_factory, name, reader, "--registered-files", "10")
    keys = sorted(files)
    first = _start_sweep(m, keys, files)
    rest = [k for k in keys if k not in first]
    got = _landed(m, len(keys))
    assert got["cachefs_sweep_files_total"] == len(rest)
    assert got[WRITTEN] <= 10, f"{got[WRITTEN]:.0f} registered ahead, room for 10"
    assert got[WRITTEN] + got[FULL] >= len(rest), "each swept file registered or left alone"
    assert got["cachefs_passthrough_backing_files"] <= 10
    random.Random(3).shuffle(rest)
    for key in rest:
        assert _read(m.path / key) == files[key], key
    assert m.gets() == len(keys)
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 0

"""Objects overwritten under readers (issue 16, part 1), on real mounts.

The promise checked here: every read of an open file returns bytes of the one
object version that open pinned, at that version's length, or fails with
ESTALE; never bytes of two versions, never a length from another version.
Whatever serves the bytes: the kernel's page cache (keep_cache, its
readahead), the daemon's memory tier and disk cache, or the kernel reading the
cache file itself (passthrough).

Objects are tagged: every 64-byte unit of version ``v`` of file ``f`` holds
``(v, f, unit index)``, and a version's length depends on ``v``, so a reader
can tell a correct read, a read of another version's length and a mix.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.fuse

MIB = 1 << 20
UNIT = 64
_TAG = struct.Struct("<III")


def units_of(version: int) -> int:
    """About 6 MiB; the length differs between versions (by whole 4 KiB pages and by
    odd units, so a length from another version cannot pass as this one's)."""
    return 6 * MIB // UNIT - 2048 + (version * 389) % 4096


def tagged(version: int, file: int) -> bytes:
    return b"".join(_TAG.pack(version, file, i) + bytes(UNIT - _TAG.size)
                    for i in range(units_of(version)))


def classify(data: bytes, file: int) -> str:
    """"ok", "wrong_length" (one version's bytes at another length) or "mixed"."""
    if not data or len(data) % UNIT:
        return "mixed" if data else "wrong_length"
    versions: set[int] = set()
    for i in range(0, len(data), UNIT):
        v, f, n = _TAG.unpack_from(data, i)
        if f != file or n != i // UNIT:
            return "mixed"
        versions.add(v)
    if len(versions) != 1:
        return "mixed"
    (v,) = versions
    return "ok" if len(data) == units_of(v) * UNIT else "wrong_length"


def _read_whole(path: Path) -> bytes:
    """The issue's reader: one open, 1 MiB reads with 10 ms pauses, until EOF."""
    parts = []
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = f.read(MIB)
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)
            time.sleep(0.01)


def overwrite_under_readers(client: Any, bucket: str, root: Path, *, seconds: float,
                            files: int = 6, readers: int = 4) -> Counter[str]:
    """A writer overwrites every file every 0.5 s while readers read whole files."""
    stop = threading.Event()
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    failures: list[BaseException] = []

    def writer() -> None:
        version = 1
        try:
            while not stop.is_set():
                t0 = time.monotonic()
                version += 1
                for f in range(files):
                    client.put_object(Bucket=bucket, Key=f"v/f{f}.bin", Body=tagged(version, f))
                stop.wait(max(0.0, 0.5 - (time.monotonic() - t0)))
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    def reader(seed: int) -> None:
        n = seed
        try:
            while not stop.is_set():
                f = n % files
                n += 1
                try:
                    got = classify(_read_whole(root / "v" / f"f{f}.bin"), f)
                except OSError as exc:
                    if exc.errno != errno.ESTALE:
                        raise
                    got = "estale"
                with lock:
                    outcomes[got] += 1
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    threads = [threading.Thread(target=writer)]
    threads += [threading.Thread(target=reader, args=(r * 3,)) for r in range(readers)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures
    return outcomes


@pytest.fixture
def tagged_bucket(bucket: Any) -> tuple[Any, str]:
    client, name = bucket
    for f in range(6):
        client.put_object(Bucket=name, Key=f"v/f{f}.bin", Body=tagged(1, f))
    return client, name


@pytest.mark.slow
@pytest.mark.parametrize("ttl", ["2s", "default"])
def test_overwritten_objects_are_never_mixed_or_misread(tagged_bucket, mount_factory, ttl) -> None:  # type: ignore[no-untyped-def]
    client, name = tagged_bucket
    extra = ["--block-size", "1M"] + (["--metadata-ttl", ttl] if ttl != "default" else [])
    m = mount_factory(f"s3://{name}", *extra)
    outcomes = overwrite_under_readers(client, name, m.path, seconds=20)
    print(dict(outcomes))
    assert outcomes["ok"] > 0
    assert outcomes["mixed"] == 0, outcomes
    assert outcomes["wrong_length"] == 0, outcomes

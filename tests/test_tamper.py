"""A cache file changed under a live mount is never served as the object's bytes.

The cache is best-effort and S3 is the truth: bytes that another process (or a disk)
changed in a cache file after cachefs wrote or verified it must not reach a reader.
Files read without the daemon's Python (the kernel's passthrough, the native loop) are
verified when they are registered; these tests change a cache file *after* that, while
the mount runs, and read again. What is checked: the reader gets the object's exact bytes,
the damaged block is counted corrupt and fetched again, whether the changed file was
registered ahead, opened by the native loop's template, or is read through a handle the
native loop serves.
"""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path
from typing import Any

import pytest

from cachefs import passthrough
from tests.conftest import drop_page_cache, read_unbuffered

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.drops_caches,
    pytest.mark.skipif(not passthrough.supported(),
                       reason="FUSE passthrough needs Linux >= 6.9"),
]

BLOCK = 64 * 1024
READERS = ["kernel", "native"]


@pytest.fixture
def shard(bucket: Any) -> tuple[str, bytes]:
    client, name = bucket
    data = random.Random(5).randbytes(5 * BLOCK + 777)
    client.put_object(Bucket=name, Key="shards/s0.tar", Body=data)
    return name, data


def _mount(mount_factory: Any, name: str, reader: str) -> Any:
    mode = ["--passthrough", "off"] if reader == "native" else []
    return mount_factory(f"s3://{name}", "--block-size", "64K", *mode)


def _damage(m: Any, offset: int) -> None:
    """Flip one bit of the mount's only cache file in place, the daemon running."""
    (cache_file,) = [f for f in (m.cache_dir / "objects").rglob("*") if f.is_file()]
    fd = os.open(cache_file, os.O_WRONLY)
    try:
        byte = bytearray(os.pread(os.open(cache_file, os.O_RDONLY), 1, offset) or b"\0")
        byte[0] ^= 0x40
        os.pwrite(fd, bytes(byte), offset)
    finally:
        os.close(fd)


def _damage_and_read(m: Any, path: Path, data: bytes, *, found: bool = True) -> None:
    """Damage the file, read it: the object's bytes. ``found``: the damage must have been
    found (the file was read from disk, not from the memory tier)."""
    _damage(m, 2 * BLOCK + 9)
    drop_page_cache()
    assert read_unbuffered(path) == data
    if found:
        assert m.metric("cachefs_cache_corrupt_blocks_total") == 1
    drop_page_cache()
    assert read_unbuffered(path) == data, "the mended file reads right"
    assert m.metric("cachefs_cache_corrupt_blocks_total") <= 1


@pytest.mark.parametrize("reader", READERS)
def test_a_file_changed_after_its_cold_read_is_not_served(shard, mount_factory, reader) -> None:  # type: ignore[no-untyped-def]
    """Changed after this daemon wrote it (its written marks would trust it unread)."""
    name, data = shard
    m = _mount(mount_factory, name, reader)
    path = m.path / "shards" / "s0.tar"
    assert read_unbuffered(path) == data
    # (without passthrough a small object just read is answered from the memory tier,
    # whatever its file holds)
    _damage_and_read(m, path, data, found=reader == "kernel")


@pytest.mark.parametrize("reader", READERS)
def test_a_registered_file_changed_is_not_served(shard, mount_factory, reader) -> None:  # type: ignore[no-untyped-def]
    """Changed while registered and opened by the native loop's template (no Python)."""
    name, data = shard
    m = _mount(mount_factory, name, reader)
    path = m.path / "shards" / "s0.tar"
    for _ in range(3):  # cold; registered at its open; opened by the template
        assert read_unbuffered(path) == data
        drop_page_cache()
    assert m.metric("cachefs_passthrough_opens_total") >= 2
    _damage_and_read(m, path, data)


def test_a_file_changed_under_an_open_native_handle_is_not_served(shard, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """The native loop's reads of a handle bound to the file see the change at once.
    (With the kernel's passthrough, an open handle reads the file itself: a change under
    it is not seen until it is closed; README, "Data integrity".)"""
    name, data = shard
    m = _mount(mount_factory, name, "native")
    path = m.path / "shards" / "s0.tar"
    assert read_unbuffered(path) == data
    m.stop()
    m.start()  # (an object in the memory tier is answered from there, not bound)
    drop_page_cache()
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, len(data), 0) == data
        assert m.metric("cachefs_passthrough_opens_total") == 1
        _damage(m, 2 * BLOCK + 9)
        drop_page_cache()
        assert os.pread(fd, len(data), 0) == data
    finally:
        os.close(fd)
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 1


def test_a_file_changed_under_an_open_passthrough_handle_refuses_new_opens_until_closed(shard, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """The kernel reads a passed-through handle's file itself, so a change under an open
    handle is the handle's to see; a new open of the file then fails with EIO (the kernel
    would give it the same file), and once the handle is closed the next open reads the
    object's bytes (the file verified again, the damaged block fetched again)."""
    name, data = shard
    m = _mount(mount_factory, name, "kernel")
    path = m.path / "shards" / "s0.tar"
    assert read_unbuffered(path) == data
    drop_page_cache()
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, 10, 0) == data[:10]
        assert m.metric("cachefs_passthrough_opens_total") == 1
        _damage(m, 2 * BLOCK + 9)
        with pytest.raises(OSError) as refused:
            os.close(os.open(path, os.O_RDONLY))
        assert refused.value.errno == errno.EIO
        assert m.metric("cachefs_passthrough_changed_total") == 1
    finally:
        os.close(fd)
    drop_page_cache()
    assert read_unbuffered(path) == data
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 1

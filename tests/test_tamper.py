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
import mmap
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from cachefs import passthrough
from cachefs.cache.blockid import object_id
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


def _damage(m: Any, offset: int, how: str = "write") -> None:
    """Change the mount's only cache file, the daemon running: flip one bit at ``offset``
    in place (``write``: a write; ``mmap``: through a shared map), cut the file short
    there (``truncate``), or put a copy with the bit flipped in its place (``replace``:
    a new inode at the path)."""
    (cache_file,) = [f for f in (m.cache_dir / "objects").rglob("*") if f.is_file()]
    raw = bytearray(cache_file.read_bytes())
    raw[offset] ^= 0x40
    if how == "replace":
        twin = cache_file.with_name(cache_file.name + ".new")
        twin.write_bytes(bytes(raw))
        os.chmod(twin, 0o600)
        os.replace(twin, cache_file)
        return
    fd = os.open(cache_file, os.O_RDWR)
    try:
        if how == "write":
            os.pwrite(fd, bytes(raw[offset:offset + 1]), offset)
        elif how == "mmap":
            with mmap.mmap(fd, 0) as mapped:
                mapped[offset] = raw[offset]
                mapped.flush()
        else:
            assert how == "truncate"
            os.ftruncate(fd, offset)
    finally:
        os.close(fd)


def _damage_and_read(m: Any, path: Path, data: bytes, *, found: bool = True,
                     how: str = "write") -> None:
    """Damage the file, read it: the object's bytes. ``found``: the damage must have been
    found (the file was read from disk, not from the memory tier)."""
    _damage(m, 2 * BLOCK + 9, how)
    drop_page_cache()
    assert read_unbuffered(path) == data
    if found:
        assert m.metric("cachefs_cache_corrupt_blocks_total") >= 1
    drop_page_cache()
    assert read_unbuffered(path) == data, "the mended file reads right"


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


@pytest.mark.parametrize("how", ["write", "mmap", "truncate", "replace"])
@pytest.mark.parametrize("reader", READERS)
def test_a_registered_file_changed_is_not_served(shard, mount_factory, reader, how) -> None:  # type: ignore[no-untyped-def]
    """Changed while registered and opened by the native loop's template (no Python). A
    file replaced at its path is not the registered one (the kernel and the loop read
    the file they hold, which no one changed): nothing is found then, and nothing wrong
    is served."""
    name, data = shard
    m = _mount(mount_factory, name, reader)
    path = m.path / "shards" / "s0.tar"
    for _ in range(3):  # cold; registered at its open; opened by the template
        assert read_unbuffered(path) == data
        drop_page_cache()
    assert m.metric("cachefs_passthrough_opens_total") >= 2
    _damage_and_read(m, path, data, how=how, found=how != "replace")


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


def _changed_under_an_open_handle(m: Any, path: Path, data: bytes) -> None:
    """Open ``path`` and damage its cache file while that handle reads it: a new open
    fails with EIO while the handle is open (the kernel would give it the same file);
    then the handle is closed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, 10, 0) == data[:10]
        _damage(m, 2 * BLOCK + 9)
        with pytest.raises(OSError) as refused:
            os.close(os.open(path, os.O_RDONLY))
        assert refused.value.errno == errno.EIO
        assert m.metric("cachefs_passthrough_changed_total") == 1
    finally:
        os.close(fd)


def _read_once_released(path: Path, timeout: float = 10.0) -> bytes:
    """``path``'s bytes once the closed handle is gone: the kernel sends its RELEASE
    after close() returned, and an open before the daemon had it still fails EIO."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return read_unbuffered(path)
        except OSError as exc:
            assert exc.errno == errno.EIO and time.monotonic() < deadline, exc
            time.sleep(0.05)


def _wait_metric(m: Any, metric: str, value: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while m.metric(metric) != value:
        assert time.monotonic() < deadline, f"{metric} stayed {m.metric(metric)}, not {value}"
        time.sleep(0.02)


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
    _changed_under_an_open_handle(m, path, data)
    assert m.metric("cachefs_passthrough_opens_total") == 1  # (the refused open not counted)
    drop_page_cache()
    assert _read_once_released(path) == data
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 1


def test_a_file_changed_under_a_handle_its_template_opened_is_read_right_once_closed(shard, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """A registered file with an open template (its inode's opens answered by the native
    loop, passed through to the kernel's backing) changed while a handle the loop opened
    reads it: new opens fail EIO while that handle is open, and once it is closed the
    next open verifies the file afresh and reads the object's bytes (the registration,
    which the loop's handle kept from being closed at the change, is closed then)."""
    name, data = shard
    m = _mount(mount_factory, name, "kernel")
    path = m.path / "shards" / "s0.tar"
    for _ in range(2):  # (cold, then registered: the inode has a template by the second)
        assert read_unbuffered(path) == data
        drop_page_cache()
    _wait_metric(m, "cachefs_native_open_templates", 1)
    opens = 'cachefs_fuse_native_answers_total{op="open"}'
    before = m.metric(opens)
    _changed_under_an_open_handle(m, path, data)
    assert m.metric(opens) == before + 1, "the loop did not answer the open"
    drop_page_cache()
    assert _read_once_released(path) == data
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 1


@pytest.mark.parametrize("reader", READERS)
def test_files_registered_by_their_writers_and_changed_are_not_served(bucket, mount_factory, reader) -> None:  # type: ignore[no-untyped-def]
    """A cold walk's small files are registered by the S3 threads that wrote them, with
    open templates ahead: a file of them changed afterwards is not served as written."""
    client, name = bucket
    files = {f"walk/f{i:03d}.bin": random.Random(900 + i).randbytes(30_000 + i)
             for i in range(40)}
    for key, body in files.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    m = _mount(mount_factory, name, reader)
    for key in sorted(files):
        assert read_unbuffered(m.path / key) == files[key]
    assert m.metric('cachefs_passthrough_prepared_total{outcome="written"}') > 0
    victim = sorted(files)[-5]
    oid = object_id(name, victim, _etag(client, name, victim), 64 * 1024)
    path = next(p for p in (m.cache_dir / "objects").rglob("*") if p.name == oid.hex())
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\0" * 7, 100)
    finally:
        os.close(fd)
    for _ in range(2):
        drop_page_cache()
        for key in sorted(files):
            assert read_unbuffered(m.path / key) == files[key], key
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 1


def _etag(client: Any, name: str, key: str) -> str:
    return str(client.head_object(Bucket=name, Key=key)["ETag"]).strip('"')

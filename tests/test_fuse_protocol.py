"""The FUSE protocol at its edges, on real mounts: requests ordinary programs seldom
send (file handles, ...), answered as the kernel expects."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import time

import pytest

from tests.conftest import drop_page_cache

pytestmark = pytest.mark.fuse

_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD = -100
_GETDENTS64 = {"x86_64": 217, "aarch64": 61}[platform.machine()]  # the system call number


def _name_to_handle(path: str) -> bytes:
    buf = ctypes.create_string_buffer(struct.pack("Ii", 128, 0) + b"\0" * 128)
    mount_id = ctypes.c_int()
    if _libc.name_to_handle_at(_AT_FDCWD, path.encode(), buf, ctypes.byref(mount_id), 0):
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), path)
    size = struct.unpack_from("I", buf.raw)[0]
    return buf.raw[:8 + size]


def _open_by_handle(mount_fd: int, handle: bytes) -> int:
    fd = _libc.open_by_handle_at(mount_fd, ctypes.create_string_buffer(handle, len(handle)),
                                 os.O_RDONLY)
    if fd < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return int(fd)


def _drop_dentries_and_inodes() -> None:
    drop_page_cache(2)


@pytest.mark.drops_caches
def test_a_file_handle_opens_its_file_after_the_kernel_forgot_the_inode(bucket, mount_factory):  # type: ignore[no-untyped-def]
    """cachefs grants export support: for a file handle whose inode the kernel no
    longer holds, the kernel looks up "." in the handle's inode, a file or a directory
    (what NFS re-export and open_by_handle_at do)."""
    client, name = bucket
    client.put_object(Bucket=name, Key="d/f.txt", Body=b"by handle\n")
    client.put_object(Bucket=name, Key="d/e/g/h.txt", Body=b"deeper\n")
    m = mount_factory(f"s3://{name}")
    handles = {p: _name_to_handle(str(m.path / p)) for p in ("d/f.txt", "d", "d/e/g")}
    mount_fd = os.open(m.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _drop_dentries_and_inodes()
        fd = _open_by_handle(mount_fd, handles["d/f.txt"])
        try:
            assert os.pread(fd, 100, 0) == b"by handle\n"
        finally:
            os.close(fd)
        os.close(_open_by_handle(mount_fd, handles["d"]))
        _drop_dentries_and_inodes()
        fd = _open_by_handle(mount_fd, handles["d/e/g"])  # reconnected through ".."
        try:
            assert os.listdir(fd) == ["h.txt"]
            assert os.readlink(f"/proc/self/fd/{fd}") == str(m.path / "d/e/g")
        finally:
            os.close(fd)
    finally:
        os.close(mount_fd)
    m.stop()


def test_open_flags_refuse_writes_only(bucket, mount_factory):  # type: ignore[no-untyped-def]
    """As on any read-only mount: opens that may write fail EROFS; a read-only open with
    O_APPEND or O_CREAT (of an existing file) reads, since neither writes anything."""
    client, name = bucket
    client.put_object(Bucket=name, Key="f.txt", Body=b"read me\n")
    m = mount_factory(f"s3://{name}")
    path = m.path / "f.txt"
    for flags in (os.O_RDONLY | os.O_APPEND, os.O_RDONLY | os.O_CREAT, os.O_RDONLY | os.O_DIRECT,
                  os.O_RDONLY | os.O_NOATIME | os.O_CLOEXEC | os.O_NONBLOCK):
        fd = os.open(path, flags)
        try:
            assert os.pread(fd, 100, 0) == b"read me\n", flags
        finally:
            os.close(fd)
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC, os.O_WRONLY | os.O_APPEND,
                  os.O_RDWR | os.O_CREAT):
        with pytest.raises(OSError) as exc:
            os.close(os.open(path, flags))
        assert exc.value.errno == errno.EROFS, flags
    m.stop()


def _getdents(fd: int, size: int) -> list[bytes]:
    """One getdents64 call with a buffer of ``size`` bytes: the names it returned."""
    buf = ctypes.create_string_buffer(size)
    n = _libc.syscall(_GETDENTS64, fd, buf, size)
    if n < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    names, i = [], 0
    while i < n:
        reclen = int.from_bytes(buf.raw[i + 16:i + 18], "little")
        names.append(buf.raw[i + 19:i + reclen].split(b"\0")[0])
        i += reclen
    return names


def test_a_reader_with_a_small_buffer_sees_unchanged_entries_once_across_a_refresh(
        bucket, mount_factory):  # type: ignore[no-untyped-def]
    """A reader whose getdents buffer takes only part of a READDIRPLUS answer makes the
    kernel continue from an entry inside that answer. When the listing was refreshed
    meanwhile (names added and removed before that entry), the continuation must still
    follow names: every entry present throughout comes exactly once."""
    client, name = bucket
    for i in range(0, 200, 2):
        client.put_object(Bucket=name, Key=f"d/n{i:04d}", Body=b"1")
    m = mount_factory(f"s3://{name}", "--metadata-ttl", "1s")
    fd = os.open(m.path / "d", os.O_RDONLY | os.O_DIRECTORY)
    try:
        got = _getdents(fd, 700) + _getdents(fd, 700)  # part of the directory
        assert got and got[-1] < b"n0100"
        for i in range(1, 200, 2):
            client.put_object(Bucket=name, Key=f"d/n{i:04d}", Body=b"1")
        for i in (0, 2, 4):
            client.delete_object(Bucket=name, Key=f"d/n{i:04d}")
        deadline = time.monotonic() + 60
        while not (m.path / "d" / "n0001").exists():  # a lookup starts the refresh
            assert time.monotonic() < deadline, "the listing was never refreshed"
            time.sleep(0.2)
        while chunk := _getdents(fd, 700):
            got += chunk
    finally:
        os.close(fd)
    stable = {f"n{i:04d}".encode() for i in range(6, 200, 2)}
    assert sorted(n for n in got if got.count(n) > 1) == []
    assert stable <= set(got)
    m.stop()

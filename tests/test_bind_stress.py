"""Handles bound late to the native loop, under load, on real mounts.

A handle opened while its object was not cached whole is served by the daemon; once the
object is cached whole it is bound to the native loop at a later READ
(:meth:`cachefs.passthrough.Passthrough.upgrade`, :meth:`cachefs.fs.FileSystem.bind_later`):
with ``--passthrough off`` it takes a use of the loop's registration, with the kernel's
passthrough the file is registered with the loop beside the kernel. These tests open,
read (``pread`` at random offsets by several threads, and memory maps faulted in child
processes: the test's S3 server runs in this process, and a page fault holds the GIL) and
close handles of a few files while they are being cached and evicted (a cache smaller than
the files), in both modes. Every byte read is checked against the object; at the end no
handle and no registration is left (a registration still used cannot be evicted: reading
other data through the small cache must close every one), the daemon unmounts cleanly, and
its log holds no traceback. So does a daemon whose mount is detached, or that is stopped,
while bound handles are read.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cachefs import passthrough as passthrough_mod
from cachefs.control import registry
from cachefs.fuse import native
from tests.conftest import daemon_holds, is_mounted, run_cachefs

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.skipif(not native.AVAILABLE, reason="cachefs was built without its native loop"),
]

MODES = ["off", "kernel"]
MiB = 1 << 20


def _data(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _mount(mount_factory: Any, name: str, mode: str, *extra: str) -> Any:
    if mode == "kernel" and not passthrough_mod.supported():
        pytest.skip("FUSE passthrough needs Linux >= 6.9")
    m = mount_factory(f"s3://{name}", "--block-size", "1M", "--fuse-workers", "4",
                      *(["--passthrough", "off"] if mode == "off" else []), *extra)
    if mode == "kernel":
        assert m.metric("cachefs_passthrough_enabled") == 1
    else:
        assert m.metric("cachefs_native_reads_enabled") == 1
    return m


def _check_pread(fd: int, data: bytes, rng: random.Random, drop: bool = True) -> None:
    if drop:  # (the page cache would answer: the read must reach the daemon or the loop)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    offset = rng.randrange(len(data))
    size = rng.choice((1, 4096, 65536, 300_000))
    got = os.pread(fd, size, offset)
    assert got == data[offset:offset + size], f"wrong bytes at {offset} (+{size})"


def _wait_for(what: Any, deadline_s: float = 20.0) -> bool:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.05)
    return bool(what())


def _put_filler(client: Any, name: str, cache_size: int) -> bytes:
    """An object larger than the cache (and than what is registered ahead of an open)."""
    filler = _data(99, cache_size + 3 * MiB)
    client.put_object(Bucket=name, Key="filler.bin", Body=filler)
    return filler


def _no_registration_left(m: Any, filler: bytes) -> None:
    """Every handle is closed: no handle may be left open, and reading ``filler`` (see
    :func:`_put_filler`) must evict and close every idle registration -- one still used by
    a handle (a use never let go) is pinned for good."""
    assert _wait_for(lambda: m.metric("cachefs_open_file_handles") == 0)
    with open(m.path / "filler.bin", "rb", buffering=0) as f:
        assert f.read() == filler
    assert _wait_for(lambda: m.metric("cachefs_passthrough_backing_files") == 0), (
        f"{m.metric('cachefs_passthrough_backing_files')} registrations left "
        "after every handle was closed and the cache was filled with other data")


def _unmount_cleanly(m: Any) -> None:
    proc = run_cachefs("unmount", str(m.path))
    assert proc.returncode == 0, proc.stderr
    assert _wait_for(lambda: not is_mounted(m.path), 30)
    log = m.log()
    assert "Traceback" not in log, log[-6000:]


_MMAP_READER = r"""
import mmap, os, random, sys, time
path, seed, size, seconds, rseed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
data = random.Random(seed).randbytes(size)
rng = random.Random(rseed)
end = time.monotonic() + seconds
maps = 0
while time.monotonic() < end:
    fd = os.open(path, os.O_RDONLY)
    try:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            maps += 1
            for _ in range(rng.randrange(5, 60)):
                if rng.random() < 0.3:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                off = rng.randrange(size)
                n = rng.choice((1, 100, 4096, 20000))
                if mm[off:off + n] != data[off:off + n]:
                    print(f"mmap: wrong bytes at {off} (+{n})", flush=True)
                    sys.exit(1)
            if rng.random() < 0.5:
                time.sleep(rng.uniform(0, 1.5))  # (a handle that lives until it is bound)
    finally:
        os.close(fd)
print(f"ok {maps}")
"""


def _start_mmap_readers(path: Path, seed: int, size: int, seconds: float,
                        n: int) -> list[subprocess.Popen[str]]:
    return [subprocess.Popen([sys.executable, "-c", _MMAP_READER, str(path), str(seed),
                              str(size), str(seconds), str(i)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(n)]


def _join_mmap_readers(procs: list[subprocess.Popen[str]]) -> int:
    """Wait for the readers; the handles they opened."""
    maps = 0
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out
        maps += int(out.split()[-1])
    return maps


@pytest.mark.parametrize("mode", MODES)
def test_concurrent_reads_of_one_handle_bind_it_once(bucket: Any, mount_factory: Any,
                                                     mode: str) -> None:
    """Several threads read through one descriptor each of three handles opened before the
    file was cached (a data loader's workers sharing a file): the kernel sends READs of one
    handle at once, to several request workers, and the handle is bound at one of them.
    Each handle takes one use of the registration, however many of its READs were under
    way at the bind: the upgrades counted are the handles, and once they are closed the
    registration is idle (the cache may evict it) and nothing is left registered."""
    client, name = bucket
    data = _data(7, 6 * MiB + 333)
    client.put_object(Bucket=name, Key="tokens.bin", Body=data)
    filler = _put_filler(client, name, 16 * MiB)
    m = _mount(mount_factory, name, mode, "--cache-size", "16M", "--cache-policy", "lru")
    path = m.path / "tokens.bin"
    fds = [os.open(path, os.O_RDONLY) for _ in range(3)]
    try:
        assert os.pread(fds[0], len(data) + 1, 0) == data  # cold: cached through Python
        assert _wait_for(lambda: m.metric("cachefs_cache_blocks") >= 7)
        errors: list[BaseException] = []
        stop = threading.Event()

        def reader(fd: int, seed: int) -> None:
            rng = random.Random(seed)
            try:
                while not stop.is_set():
                    _check_pread(fd, data, rng, drop=rng.random() < 0.5)
            except BaseException as exc:  # (reported by the test's thread)
                errors.append(exc)
                stop.set()

        threads = [threading.Thread(target=reader, args=(fd, 10 * i + j))
                   for i, fd in enumerate(fds) for j in range(4)]
        for t in threads:
            t.start()
        # (a handle is bound at a READ at least a second after its first)
        _wait_for(lambda: m.metric("cachefs_passthrough_upgraded_total") >= 3 or stop.is_set())
        time.sleep(1.0)  # (reads of bound handles, still concurrent)
        stop.set()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert m.metric("cachefs_passthrough_upgraded_total") == 3
        for fd in fds:
            for offset in (0, MiB - 7, len(data) - 100):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                assert os.pread(fd, 4096, offset) == data[offset:offset + 4096]
    finally:
        for fd in fds:
            os.close(fd)
    with open(path, "rb", buffering=0) as f:  # (the one-mode rule held: opens work)
        assert f.read() == data
    _no_registration_left(m, filler)
    _unmount_cleanly(m)


@pytest.mark.parametrize("mode", MODES)
def test_handles_opened_read_and_closed_while_files_are_cached_and_evicted(
        bucket: Any, mount_factory: Any, mode: str) -> None:
    """Threads open, read at random offsets and close handles of three files (some kept
    open for seconds, so they are bound once their file is cached whole), and child
    processes memory-map one of them, while the files are being fetched and, the cache being
    smaller than the three, evicted: every byte read is the object's, and at the end
    nothing is left open or registered."""
    client, name = bucket
    sizes = {f"f{i}.bin": 3 * MiB + 1000 * i + 17 for i in range(3)}
    seeds = {key: 20 + i for i, key in enumerate(sizes)}
    datas = {key: _data(seeds[key], size) for key, size in sizes.items()}
    for key, body in datas.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    filler = _put_filler(client, name, 7 * MiB)  # (room for two of the three: eviction runs)
    m = _mount(mount_factory, name, mode, "--cache-size", "7M", "--cache-policy", "lru",
               "--memory-budget", "4M")
    seconds = 10.0
    procs = _start_mmap_readers(m.path / "f0.bin", seeds["f0.bin"], sizes["f0.bin"],
                                seconds, 2)
    errors: list[BaseException] = []
    stop = threading.Event()
    start = time.monotonic()

    def hot() -> list[str]:
        # f0 all along (the memory maps), and f1 or f2 in turns of two seconds: the two fit
        # in the cache, so they are cached whole and handles of them are bound, until the
        # turn moves on and the other's blocks evict the idle ones'.
        return ["f0.bin", "f1.bin" if int((time.monotonic() - start) / 2) % 2 else "f2.bin"]

    opened: list[int] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        held: list[tuple[int, bytes]] = []
        try:
            while not stop.is_set():
                if len(held) < 3 and rng.random() < 0.2:
                    key = rng.choice(hot())
                    held.append((os.open(m.path / key, os.O_RDONLY), datas[key]))
                    opened.append(1)
                if held:
                    fd, data = rng.choice(held)
                    _check_pread(fd, data, rng, drop=rng.random() < 0.3)
                if held and rng.random() < 0.01:
                    fd, _ = held.pop(rng.randrange(len(held)))
                    os.close(fd)
        except BaseException as exc:  # (reported by the test's thread)
            errors.append(exc)
            stop.set()
        finally:
            for fd, _ in held:
                os.close(fd)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join()
    maps = _join_mmap_readers(procs)
    assert not errors, errors[0]
    assert m.metric("cachefs_cache_evictions_total") > 0
    # (each handle bound once at most: a second bind is a use never let go of)
    assert m.metric("cachefs_passthrough_upgraded_total") <= len(opened) + maps
    _no_registration_left(m, filler)
    _unmount_cleanly(m)


@pytest.mark.parametrize("mode", MODES)
def test_a_read_of_a_handle_being_bound_does_not_bind_it_again(
        bucket: Any, mount_factory: Any, mode: str, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """The race the test above hopes for, held open: a READ of a handle is held (a
    failpoint) after its bind took a use of the registration and before the handle
    records it; another READ of the same handle, on another request worker, meanwhile
    must not bind it again (a second use, which its one release never lets go of: the
    registration stays used and pinned for good, and with the kernel's passthrough the
    file stays registered with the loop too). It is answered, by Python."""
    holds = daemon_holds(tmp_path, monkeypatch, "upgrade.bound").dir
    client, name = bucket
    data = _data(8, 4 * MiB + 55)
    client.put_object(Bucket=name, Key="rows.arrow", Body=data)
    filler = _put_filler(client, name, 12 * MiB)
    m = _mount(mount_factory, name, mode, "--cache-size", "12M", "--cache-policy", "lru")
    path = m.path / "rows.arrow"
    fds = [os.open(path, os.O_RDONLY) for _ in range(2)]  # (two served by the daemon)
    try:
        assert os.pread(fds[0], len(data) + 1, 0) == data  # cold: its first READs
        assert _wait_for(lambda: m.metric("cachefs_cache_blocks") >= 5)
        time.sleep(1.2)  # (a handle is bound at a READ a second after its first at least)
        (holds / "upgrade.bound.hold").touch()
        results: dict[str, bytes] = {}

        def read(label: str, offset: int) -> None:
            os.posix_fadvise(fds[0], 0, 0, os.POSIX_FADV_DONTNEED)
            results[label] = os.pread(fds[0], 4096, offset)

        first = threading.Thread(target=read, args=("first", 0))
        first.start()
        assert _wait_for(lambda: (holds / "upgrade.bound.reached").exists())
        (holds / "upgrade.bound.reached").unlink()
        second = threading.Thread(target=read, args=("second", 2 * MiB + 1))
        second.start()
        second.join(5)
        (holds / "upgrade.bound.hold").unlink()
        first.join()
        second.join()
        assert results["first"] == data[:4096]
        assert results["second"] == data[2 * MiB + 1:2 * MiB + 4097]
        assert m.metric("cachefs_passthrough_upgraded_total") == 1
    finally:
        for fd in fds:
            os.close(fd)
    _no_registration_left(m, filler)
    _unmount_cleanly(m)


def test_a_bind_beside_the_kernel_that_fails_is_undone_and_its_read_answered(
        bucket: Any, mount_factory: Any, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """A handle's bind to the native loop beside the kernel's passthrough fails with an
    exception no path expects (failpoint ``beside.registered``, raising once: as a
    MemoryError in the loop's table would), after the file was registered with the loop.
    Before: the READ that tried it was answered EIO (unseen by a buffered reader: the
    kernel reads the page again), and the try's placeholder and use
    stayed behind, so the handle was never bound and the file stayed registered (and
    pinned) for good after every handle closed. Now the READ is answered, the try is
    undone, a later READ binds the handle, and nothing is left once it is closed."""
    if not passthrough_mod.supported():
        pytest.skip("FUSE passthrough needs Linux >= 6.9")
    holds = daemon_holds(tmp_path, monkeypatch, "beside.registered").dir
    client, name = bucket
    data = _data(9, 3 * MiB + 99)
    client.put_object(Bucket=name, Key="rows.arrow", Body=data)
    filler = _put_filler(client, name, 12 * MiB)
    m = _mount(mount_factory, name, "kernel", "--cache-size", "12M", "--cache-policy", "lru")
    fd = os.open(m.path / "rows.arrow", os.O_RDONLY)  # (served by the daemon)
    try:
        assert os.pread(fd, len(data) + 1, 0) == data  # cold: its first READs
        assert _wait_for(lambda: m.metric("cachefs_cache_blocks") >= 4)
        time.sleep(1.2)  # (a handle is bound at a READ a second after its first at least)
        (holds / "beside.registered.raise").touch()
        rng = random.Random(3)
        # The READ whose bind fails, answered all the same (the one READ of this pread:
        # no readahead, whose READs may fail unseen)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        assert os.pread(fd, 4096, MiB) == data[MiB:MiB + 4096]
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL)
        assert (holds / "beside.registered.reached").exists(), "the failpoint was not hit"
        assert m.metric("cachefs_passthrough_upgraded_total") == 0
        # A later READ binds it (tried again a second later at most).
        deadline = time.monotonic() + 20
        while m.metric("cachefs_passthrough_upgraded_total") < 1:
            assert time.monotonic() < deadline, "the handle was never bound"
            _check_pread(fd, data, rng)
            time.sleep(0.05)
        for _ in range(20):
            _check_pread(fd, data, rng)
    finally:
        os.close(fd)
    _no_registration_left(m, filler)
    proc = run_cachefs("unmount", str(m.path))
    assert proc.returncode == 0, proc.stderr
    assert _wait_for(lambda: not is_mounted(m.path), 30)
    log = m.log()
    assert "answering EIO" not in log, "the READ whose bind failed was answered EIO"
    assert log.count("Traceback") == 1 and "failpoint beside.registered" in log, log[-6000:]


def _daemon_pid(m: Any) -> int:
    proc = run_cachefs("status", "--json", str(m.path))
    assert proc.returncode == 0, proc.stderr
    return int(json.loads(proc.stdout)["pid"])


@pytest.mark.parametrize("mode", MODES)
def test_a_daemon_detached_while_bound_handles_read_ends_cleanly(
        bucket: Any, mount_factory: Any, mode: str) -> None:
    """Handles bound late are read by threads when the mount is detached (``cachefs
    unmount --lazy``, the way out of a busy mount): their reads go on from the cache
    files, with the object's bytes (or fail; never other bytes), and once they are closed
    the daemon ends by itself, without a traceback."""
    client, name = bucket
    data = _data(9, 5 * MiB + 99)
    client.put_object(Bucket=name, Key="shard.bin", Body=data)
    m = _mount(mount_factory, name, mode, "--cache-size", "32M")
    pid = _daemon_pid(m)
    path = m.path / "shard.bin"
    fds = [os.open(path, os.O_RDONLY) for _ in range(2)]
    errors: list[BaseException] = []
    stop = threading.Event()
    reads = [0]

    def reader(fd: int, seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                try:
                    _check_pread(fd, data, rng, drop=rng.random() < 0.5)
                    reads[0] += 1
                except OSError:  # (detached: reads that reach the daemon may fail)
                    time.sleep(0.01)
        except BaseException as exc:  # (reported by the test's thread)
            errors.append(exc)
            stop.set()

    threads: list[threading.Thread] = []
    try:
        assert os.pread(fds[0], len(data) + 1, 0) == data
        assert _wait_for(lambda: m.metric("cachefs_cache_blocks") >= 6)
        threads = [threading.Thread(target=reader, args=(fd, 40 + i + 2 * j))
                   for i, fd in enumerate(fds) for j in range(2)]
        for t in threads:
            t.start()
        assert _wait_for(lambda: m.metric("cachefs_passthrough_upgraded_total") >= 2
                         or stop.is_set())
        # (what 'cachefs unmount --lazy' does, without waiting for the daemon to end)
        subprocess.run(["fusermount3", "-u", "-z", str(m.path)], check=True)
        assert not is_mounted(m.path)
        before = reads[0]
        # (the bound handles are read from their files after the detach)
        assert _wait_for(lambda: reads[0] >= before + 100 or stop.is_set())
        stop.set()
        for t in threads:
            t.join()
        assert not errors, errors[0]
    finally:
        stop.set()
        for t in threads:
            t.join()
        for fd in fds:
            os.close(fd)
    assert _wait_for(lambda: not registry.pid_alive(pid), 30), "the daemon did not end"
    log = m.log()
    assert "Traceback" not in log, log[-6000:]


@pytest.mark.parametrize("mode", MODES)
def test_a_daemon_stopped_while_a_bound_handle_is_open_ends_cleanly(
        bucket: Any, mount_factory: Any, mode: str) -> None:
    """SIGTERM while a handle bound late is open (a training process still holding its
    file): the daemon unmounts, waits for the handle, then aborts its connection (the
    kernel's /dev/fuse then answers ECONNABORTED, not ENODEV) and ends -- the end of its
    connection, not a request worker's failure: no traceback in its log."""
    client, name = bucket
    data = _data(10, 3 * MiB + 5)
    client.put_object(Bucket=name, Key="held.bin", Body=data)
    m = _mount(mount_factory, name, mode)
    pid = _daemon_pid(m)
    path = m.path / "held.bin"
    fds = [os.open(path, os.O_RDONLY) for _ in range(2)]
    try:
        assert os.pread(fds[0], len(data) + 1, 0) == data
        assert _wait_for(lambda: m.metric("cachefs_cache_blocks") >= 4)
        rng = random.Random(3)
        assert _wait_for(lambda: _check_pread(fds[0], data, rng) is None
                         and m.metric("cachefs_passthrough_upgraded_total") >= 1)
        os.kill(pid, signal.SIGTERM)
        assert _wait_for(lambda: not registry.pid_alive(pid), 30), "the daemon did not end"
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):  # (ENOTCONN: the connection is gone)
                os.close(fd)
    log = m.log()
    assert "Traceback" not in log, log[-6000:]


def test_a_read_of_the_device_that_finds_the_connection_ended_ends_the_worker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A read of /dev/fuse that was taking a request when the connection ended (the last
    file of a detached mount closed) fails with ECONNABORTED, not ENODEV: the end of the
    connection (the C loop alike, see test_a_daemon_detached_while_bound_handles_read_ends_
    cleanly), not a failure logged with a traceback."""
    from cachefs.fuse import server

    def ended(fd: int, bufs: Any) -> int:
        raise OSError(errno.ECONNABORTED, os.strerror(errno.ECONNABORTED))

    monkeypatch.setattr(server.os, "readv", ended)
    assert server._read(0, bytearray(16)) is None

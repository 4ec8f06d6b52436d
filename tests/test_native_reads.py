"""The native request loop (cachefs/fuse/_native.c, cachefs/fuse/native.py).

Unit tests drive ``serve`` over a SOCK_SEQPACKET socket pair, which keeps message
boundaries as /dev/fuse does: a READ of a bound handle is answered from its file (exact
bytes, clipped to the object), an IOCTL with ENOTTY, everything else reaches the Python
handler with the request in the worker's buffer; a file that cannot answer a read in full
hands it to Python. Mount tests check the same on a real mount without passthrough: a
verified cache file's reads are answered by the loop with the object's bytes, and
``--native-reads off`` serves every read in Python (that a corrupt cache file is never
registered: tests/test_passthrough.py, for both readers).
"""

from __future__ import annotations

import errno
import os
import random
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from cachefs import passthrough as passthrough_mod
from cachefs.fuse import abi, native
from tests.conftest import drop_cached, reread_cold, resident
from tests.conftest import drop_page_cache as _drop_page_cache
from tests.conftest import read_unbuffered as _read

pytestmark = pytest.mark.skipif(not native.AVAILABLE and not os.environ.get("CI"),
                                reason="cachefs was built without its native loop")

IN_HEADER = abi.IN_HEADER
READ_IN_FULL = struct.Struct("<QQIIQII")  # fh, offset, size, read_flags, lock_owner, flags, pad


def test_the_native_loop_is_built_wherever_a_compiler_is() -> None:
    """CI builds cachefs from source with gcc: the extension must be there (a build that
    silently fell back to Python would make every read cost a Python request)."""
    assert native.AVAILABLE


def _request(opcode: int, unique: int, body: bytes, nodeid: int = 1) -> bytes:
    return IN_HEADER.pack(IN_HEADER.size + len(body), opcode, unique, nodeid, 0, 0, 0, 0, 0) + body


def _read_request(unique: int, fh: int, offset: int, size: int) -> bytes:
    return _request(abi.READ, unique, READ_IN_FULL.pack(fh, offset, size, 0, 0, 0, 0))


# (answers stay under the socket pair's message limit, about 200 KB; /dev/fuse has none)
def _answer(sock: socket.socket) -> tuple[int, int, bytes]:
    msg = sock.recv(abi.MAX_READ + 64)
    length, error, unique = abi.OUT_HEADER.unpack_from(msg)
    assert length == len(msg)
    return unique, error, msg[abi.OUT_HEADER.size:]


class Loop:
    """One worker running ``serve`` on one end of a socket pair; the test speaks on the
    other. Requests the loop gives to Python are recorded and answered with their
    opcode as a 4-byte body; opcode DESTROY ends the loop."""

    def __init__(self, reads: native.NativeReads) -> None:
        self.reads = reads
        self.kernel, self._worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.kernel.settimeout(10)
        self.handed: list[tuple[int, int]] = []  # (opcode, unique) given to Python
        self._buf = bytearray(abi.BUFFER_SIZE)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _handle(self, n: int) -> bool:
        _, opcode, unique, *_ = IN_HEADER.unpack_from(self._buf)
        assert IN_HEADER.unpack_from(self._buf)[0] == n
        self.handed.append((opcode, unique))
        if opcode == abi.DESTROY:
            return True
        body = struct.pack("<I", opcode)
        os.write(self._worker.fileno(),
                 abi.OUT_HEADER.pack(abi.OUT_HEADER.size + 4, 0, unique) + body)
        return False

    def _run(self) -> None:
        try:
            self.reads.serve(self._worker.fileno(), self._buf, self._handle, abi.MAX_READ)
        except BaseException as exc:  # reported by the test
            self.error = exc

    def ask(self, request: bytes) -> tuple[int, int, bytes]:
        self.kernel.send(request)
        return _answer(self.kernel)

    def close(self) -> None:
        self.kernel.send(_request(abi.DESTROY, 999_999, b""))
        self._thread.join(10)
        assert not self._thread.is_alive()
        self.kernel.close()
        self._worker.close()


@pytest.fixture
def loop() -> Iterator[Loop]:
    lp = Loop(native.NativeReads())
    try:
        yield lp
    finally:
        lp.close()
    assert lp.error is None, lp.error


@pytest.fixture
def cache_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = random.Random(5).randbytes(300_000)
    path = tmp_path / "object"
    path.write_bytes(data)
    return path, data


def _stats_after(reads: native.NativeReads, kind: str, count: int) -> dict[str, Any]:
    """The loop's stats once ``count`` requests of ``kind`` are counted: a worker counts a
    request after writing its answer (its time includes the write), so the answer can
    reach the test first."""
    deadline = time.monotonic() + 5
    while (st := reads.stats())[kind][0] < count and time.monotonic() < deadline:
        time.sleep(0.001)
    return st


def _register(reads: native.NativeReads, path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return reads.backing_open(fd)
    finally:
        os.close(fd)  # the registration keeps its own descriptor


def test_reads_of_a_bound_handle_are_answered_from_its_file(loop: Loop, cache_file: Any) -> None:
    path, data = cache_file
    backing = _register(loop.reads, path)
    assert loop.reads.bind(7, backing, len(data))
    for unique, (offset, size) in enumerate([(0, 4096), (12_345, 100_000), (299_990, 4096),
                                             (len(data), 4096), (0, 150_000)], start=1):
        got_unique, error, body = loop.ask(_read_request(unique, 7, offset, size))
        assert (got_unique, error) == (unique, 0)
        assert body == data[offset:offset + size]
    assert loop.handed == []
    st = _stats_after(loop.reads, "read", 5)
    reads, _, buckets = st["read"]
    assert reads == 5 and st["fallbacks"] == 0 and st["bound"] == 1 and sum(buckets) == 5
    assert st["read_bytes"] == 4096 + 100_000 + 10 + 0 + 150_000


def _cached_pages(path: Path) -> int:
    """Bytes of ``path`` in the page cache."""
    return resident(path, 0, path.stat().st_size)


def _evict_pages(path: Path) -> None:
    """Write ``path`` back and drop its pages from the page cache."""
    drop_cached(path)
    assert _cached_pages(path) == 0


def test_an_objects_last_bytes_not_in_the_page_cache_are_read_direct(
        loop: Loop, cache_file: Any) -> None:
    """A read that reaches the object's end (a small file's only READ) none of whose bytes
    are in the page cache is made with O_DIRECT (the kernel caches the answer for the
    FUSE file; a second copy in the cache file's pages would double the memory): exact
    bytes, clipped to the object, and the cache file's pages stay out of the page cache.
    Reads short of the object's end (the cache file's readahead serves a large file read
    in order), unaligned reads, and reads of bytes in the page cache (a file just
    written, not yet written back) are plain reads."""
    path, data = cache_file
    obj = data[:-5]  # the object ends 5 bytes before the file
    _evict_pages(path)
    backing = _register(loop.reads, path)
    loop.reads.bind(7, backing, len(obj))
    assert loop.ask(_read_request(1, 7, 262_144, 131_072)) == (1, 0, obj[262_144:])
    assert loop.reads.stats()["direct_reads"] == 1
    assert _cached_pages(path) == 0, "a direct read left the cache file's pages cached"
    assert loop.ask(_read_request(2, 7, 0, 131_072)) == (2, 0, obj[:131_072])
    assert loop.reads.stats()["direct_reads"] == 1  # (short of the end: a plain read)
    assert _cached_pages(path) > 0
    _evict_pages(path)
    assert loop.ask(_read_request(3, 7, 150_001, 200_000)) == (3, 0, obj[150_001:])
    assert loop.reads.stats()["direct_reads"] == 1  # (unaligned: a plain read)
    # A file just written: its pages are dirty in the page cache, a direct read would
    # first write them back.
    fresh = path.with_name("fresh")
    fresh.write_bytes(data[::-1])
    loop.reads.bind(8, _register(loop.reads, fresh), len(data))
    assert loop.ask(_read_request(4, 8, 200_704, 131_072)) == (4, 0, data[::-1][200_704:])
    assert loop.reads.stats()["direct_reads"] == 1
    assert loop.handed == [] and loop.reads.stats()["fallbacks"] == 0


def test_a_read_is_clipped_to_the_object_not_the_file(loop: Loop, cache_file: Any) -> None:
    path, data = cache_file
    backing = _register(loop.reads, path)
    loop.reads.bind(3, backing, 1000)  # the object is shorter than the file
    assert loop.ask(_read_request(1, 3, 900, 4096))[2] == data[900:1000]
    assert loop.ask(_read_request(2, 3, 5000, 4096))[2] == b""


def test_unbound_handles_and_other_requests_go_to_python(loop: Loop, cache_file: Any) -> None:
    path, data = cache_file
    loop.reads.bind(5, _register(loop.reads, path), len(data))
    assert loop.ask(_read_request(1, 6, 0, 10)) == (1, 0, struct.pack("<I", abi.READ))
    assert loop.ask(_request(abi.LOOKUP, 2, b"name\0")) == (2, 0, struct.pack("<I", abi.LOOKUP))
    assert loop.ask(_request(abi.IOCTL, 3, b"\0" * 32)) == (3, -errno.ENOTTY, b"")
    assert loop.reads.unbind(5) and not loop.reads.unbind(5)
    assert loop.ask(_read_request(4, 5, 0, 10))[2] == struct.pack("<I", abi.READ)
    assert loop.handed == [(abi.READ, 1), (abi.LOOKUP, 2), (abi.READ, 4)]
    assert loop.reads.stats()["ioctls"] == 1


def test_a_file_shorter_than_its_object_hands_the_read_to_python(loop: Loop, tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"x" * 1000)
    loop.reads.bind(9, _register(loop.reads, path), 5000)  # 4,000 bytes missing
    assert loop.ask(_read_request(1, 9, 0, 4096))[2] == struct.pack("<I", abi.READ)
    assert loop.ask(_read_request(2, 9, 0, 500))[2] == b"x" * 500  # what it has, it answers
    assert loop.reads.stats()["fallbacks"] == 1


def test_a_handle_keeps_its_file_after_the_registration_is_closed(loop: Loop, cache_file: Any) -> None:
    """A handle's own descriptor: closing the registration (an idle backing dropped) or
    reusing its descriptor number never makes a bound handle read another file."""
    path, data = cache_file
    backing = _register(loop.reads, path)
    loop.reads.bind(11, backing, len(data))
    loop.reads.backing_close(backing)
    other = os.open(os.devnull, os.O_RDONLY)  # may take the closed descriptor's number
    try:
        assert loop.ask(_read_request(1, 11, 100, 50))[2] == data[100:150]
    finally:
        os.close(other)
    assert not loop.reads.bind(12, backing, len(data)), "a closed registration was bound"


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_registered_file_holds_one_descriptor_however_many_read_it(loop: Loop, cache_file: Any) -> None:
    """Handles and templates share their registration's descriptor (cachefs/descriptors.py
    counts one per registered file): 50 handles and 10 templates add none, and the
    descriptor is closed only once the registration and the last of them are gone."""
    path, data = cache_file
    before = _open_descriptors()
    backing = _register(loop.reads, path)
    assert _open_descriptors() == before + 1
    for fh in range(1, 51):
        assert loop.reads.bind(fh, backing, len(data) - fh)  # (each its own size)
    for ino in range(100, 110):
        assert loop.reads.add_template(ino, token=loop.reads.lookup_epoch("d/"), prefix="d/",
                                       native_backing=backing, size=len(data))
    assert _open_descriptors() == before + 1
    loop.reads.backing_close(backing)
    assert _open_descriptors() == before + 1, "handles and templates still read it"
    assert loop.ask(_read_request(1, 7, 0, 100))[2] == data[:100]
    assert loop.ask(_read_request(2, 50, len(data) - 60, 100))[2] == data[-60:-50]  # its size
    for fh in range(1, 51):
        assert loop.reads.unbind(fh)
    assert _open_descriptors() == before + 1
    for ino in range(100, 110):
        assert loop.reads.drop_template(ino)
    assert _open_descriptors() == before, "the last user closed it"
    assert not loop.reads.bind(1, backing, len(data))
    assert not loop.reads.add_template(100, token=loop.reads.lookup_epoch("d/"), prefix="d/",
                                       native_backing=backing, size=len(data))


def test_registrations_come_and_go_while_their_handles_are_read(loop: Loop, tmp_path: Path) -> None:
    """A thread registers files, binds handles to them and drops the registrations (and
    later the handles) while the loop answers reads of those handles: every answer is its
    file's bytes, and once all are gone every descriptor is closed (the shared count)."""
    bodies = []
    for i in range(8):
        p = tmp_path / f"f{i}"
        body = random.Random(100 + i).randbytes(6000 + i)
        p.write_bytes(body)
        bodies.append((p, body))
    before = _open_descriptors()
    live: dict[int, int] = {}  # bound handle -> file index
    lock = threading.Lock()
    stop = threading.Event()

    failed: list[BaseException] = []

    def churn() -> None:
        try:
            _churn()
        except BaseException as exc:  # reported by the test
            failed.append(exc)

    def _churn() -> None:
        rnd = random.Random(1)
        fh = 0
        while not stop.is_set():
            i = rnd.randrange(len(bodies))
            backing = _register(loop.reads, bodies[i][0])
            fh += 1
            assert loop.reads.bind(fh, backing, len(bodies[i][1]))
            loop.reads.backing_close(backing)  # the handle keeps the descriptor
            with lock:
                live[fh] = i
                if len(live) > 40:
                    old = next(iter(live))
                    del live[old]
                    assert loop.reads.unbind(old)

    mutator = threading.Thread(target=churn)
    mutator.start()
    try:
        checked = 0
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            with lock:
                if not live:
                    continue
                fh, i = random.choice(list(live.items()))
            _, error, answer = loop.ask(_read_request(checked + 1, fh, 100, 200))
            # (unbound meanwhile: the read went to Python)
            assert (error, answer) in ((0, bodies[i][1][100:300]), (0, struct.pack("<I", abi.READ)))
            checked += 1
    finally:
        stop.set()
        mutator.join(10)
    assert not failed, failed
    assert checked > 100
    for fh in list(live):
        assert loop.reads.unbind(fh)
    assert _open_descriptors() == before


def test_many_handles_bound_and_unbound_while_reads_run(loop: Loop, tmp_path: Path) -> None:
    """The handle table grows and shrinks (open addressing with deletions) without losing
    a live handle: 3,000 handles over 30 files, every other one unbound, all checked."""
    files = []
    for i in range(30):
        p = tmp_path / f"f{i}"
        body = random.Random(i).randbytes(2000 + i)
        p.write_bytes(body)
        files.append((_register(loop.reads, p), body))
    for fh in range(1, 3001):
        backing, body = files[fh % 30]
        loop.reads.bind(fh, backing, len(body))
    for fh in range(2, 3001, 2):
        assert loop.reads.unbind(fh)
    assert loop.reads.stats()["bound"] == 1500
    for fh in range(1, 3001, 7):
        _, error, answer = loop.ask(_read_request(fh, fh, 10, 100))
        if fh % 2:
            assert (error, answer) == (0, files[fh % 30][1][10:110]), fh
        else:
            assert answer == struct.pack("<I", abi.READ), fh


def _lookup(loop: Loop, unique: int, parent: int, name: bytes) -> tuple[int, int, bytes]:
    return loop.ask(_request(abi.LOOKUP, unique, name + b"\0", nodeid=parent))


def test_a_remembered_lookup_is_answered_while_fresh_and_in_its_epoch(loop: Loop) -> None:
    reads = loop.reads
    answer = bytes(range(128))
    python = struct.pack("<I", abi.LOOKUP)  # what the test's Python handler answers
    token = reads.lookup_epoch("d/")
    assert reads.remember_lookup(token, "d/", 5, b"img.jpg", answer, 60.0)
    assert _lookup(loop, 1, 5, b"img.jpg") == (1, 0, answer)
    # another directory, another name, a longer or shorter name: Python answers
    assert _lookup(loop, 2, 6, b"img.jpg")[2] == python
    assert _lookup(loop, 3, 5, b"img.jpeg")[2] == python
    assert _lookup(loop, 4, 5, b"img.jp")[2] == python
    assert loop.handed == [(abi.LOOKUP, 2), (abi.LOOKUP, 3), (abi.LOOKUP, 4)]
    assert reads.stats()["lookup"][0] == 1
    # another directory's listing changed: still answered
    reads.forget_dir("e/")
    assert _lookup(loop, 5, 5, b"img.jpg")[2] == answer
    # its own directory's listing changed: never again, and an answer read before is refused
    reads.forget_dir("d/")
    assert _lookup(loop, 6, 5, b"img.jpg")[2] == python
    assert not reads.remember_lookup(token, "d/", 5, b"img.jpg", answer, 60.0)
    # a new table epoch: the same
    token = reads.lookup_epoch("d/")
    assert reads.remember_lookup(token, "d/", 5, b"img.jpg", answer, 60.0)
    reads.forget_lookups()
    assert _lookup(loop, 7, 5, b"img.jpg")[2] == python
    assert not reads.remember_lookup(token, "d/", 5, b"img.jpg", answer, 60.0)
    # expiry: an answer fresh for 50 ms is given now, not after
    assert reads.remember_lookup(reads.lookup_epoch("d/"), "d/", 5, b"img.jpg", answer, 0.05)
    assert _lookup(loop, 8, 5, b"img.jpg")[2] == answer
    time.sleep(0.1)
    assert _lookup(loop, 9, 5, b"img.jpg")[2] == python
    assert not reads.remember_lookup(reads.lookup_epoch("d/"), "d/", 5, b"x", answer, 0.0)


def _answered(lp: Loop, parent: int, names: list[bytes], answers: list[bytes]) -> list[bytes]:
    """The names of ``names`` the loop answers itself, each with its own answer."""
    python = struct.pack("<I", abi.LOOKUP)
    answered = []
    for i, (name, expected) in enumerate(zip(names, answers, strict=True)):
        _, error, body = _lookup(lp, 100_000 + i, parent, name)
        if body != python:
            assert (error, body) == (0, expected), name
            answered.append(name)
    return answered


def test_remembered_lookups_are_bounded_by_their_slots() -> None:
    """A table of 4 slots holds at most 4 answers; with every answer as fresh, a newer one
    replaces the one expiring first (the oldest), and whatever a slot holds is the answer
    of its own name."""
    reads = native.NativeReads(lookup_slots=4)
    lp = Loop(reads)
    try:
        token = reads.lookup_epoch("")
        names = [f"n{i}".encode() for i in range(64)]
        answers = [bytes([i]) * 128 for i in range(64)]
        for name, answer in zip(names, answers, strict=True):
            assert reads.remember_lookup(token, "", 1, name, answer, 60.0)
        assert _answered(lp, 1, names, answers) == names[-4:]
        with pytest.raises(ValueError):
            native.NativeReads(lookup_slots=3)
    finally:
        lp.close()


def test_a_new_lookup_answer_takes_a_useless_slot_before_a_fresh_one() -> None:
    """In a full set, a new answer replaces its own name's answer if there is one (never a
    second answer of one name), else an expired one, else the one expiring first."""
    reads = native.NativeReads(lookup_slots=4)  # (one set of four)
    lp = Loop(reads)
    try:
        token = reads.lookup_epoch("")
        names = [f"n{i}".encode() for i in range(6)]
        answers = [bytes([i]) * 128 for i in range(6)]

        def remember(i: int, fresh_for: float = 60.0, answer: bytes | None = None) -> None:
            assert reads.remember_lookup(token, "", 1, names[i], answer or answers[i],
                                         fresh_for)

        remember(0, fresh_for=0.05)
        for i in (1, 2, 3):
            remember(i)
        remember(1, answer=b"\x11" * 128)  # its own slot again: n0..n3 all kept
        answers[1] = b"\x11" * 128
        time.sleep(0.1)  # n0's answer expires
        assert _answered(lp, 1, names[:4], answers[:4]) == names[1:4]
        remember(4)  # takes n0's expired slot
        assert _answered(lp, 1, names[:5], answers[:5]) == names[1:5]
        remember(5)  # takes the slot expiring first: n2's (n1's was renewed after it)
        assert _answered(lp, 1, names, answers) == [names[1], names[3], names[4], names[5]]
    finally:
        lp.close()


def test_remembered_lookups_keep_most_names_of_a_table_twice_their_number() -> None:
    """Answers sharing a hash share a set of slots rather than pushing each other out: a
    table of 1,024 slots keeps at least nine in ten of 512 names (direct-mapped, it kept
    about eight)."""
    reads = native.NativeReads(lookup_slots=1024)
    lp = Loop(reads)
    try:
        token = reads.lookup_epoch("d/")
        names = [f"img_{i:06d}.jpg".encode() for i in range(512)]
        answers = [i.to_bytes(2, "little") * 64 for i in range(512)]
        for name, answer in zip(names, answers, strict=True):
            assert reads.remember_lookup(token, "d/", 7, name, answer, 60.0)
        kept = len(_answered(lp, 7, names, answers))
        assert kept >= 0.9 * len(names), f"{kept} of {len(names)} answers kept"
    finally:
        lp.close()


def test_an_exception_in_the_python_handler_ends_serve_with_it(cache_file: Any) -> None:
    reads = native.NativeReads()
    kernel, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    buf = bytearray(abi.BUFFER_SIZE)

    def handle(n: int) -> bool:
        raise ValueError("a bug in a handler")

    kernel.send(_request(abi.LOOKUP, 1, b"x\0"))
    with pytest.raises(ValueError, match="a bug"):
        reads.serve(worker.fileno(), buf, handle, abi.MAX_READ)
    kernel.close()
    # the peer is gone: the loop's read ends (0 bytes) and serve returns
    reads.serve(worker.fileno(), buf, handle, abi.MAX_READ)
    worker.close()


# -- on a real mount, without passthrough ------------------------------------------------
BLOCK = 64 * 1024


def _python_reads(m: Any) -> float:
    """Bytes the Python handlers read from the daemon's tiers (the native loop's are not)."""
    s = m.metrics()
    return sum(v for k, v in s.items() if k.startswith("cachefs_tier_read_bytes_total"))


@pytest.fixture
def shard(bucket: Any) -> tuple[str, bytes]:
    client, name = bucket
    data = random.Random(7).randbytes(5 * BLOCK + 777)
    client.put_object(Bucket=name, Key="shards/s0.tar", Body=data)
    return name, data


@pytest.mark.drops_caches
@pytest.mark.fuse
def test_without_passthrough_a_verified_file_is_read_by_the_native_loop(shard, mount_factory) -> None:  # type: ignore[no-untyped-def]
    name, data = shard
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--passthrough", "off")
    path = m.path / "shards" / "s0.tar"
    assert _read(path) == data  # cold: through the daemon's Python, fills the cache
    assert m.metric("cachefs_native_reads_enabled") == 1
    assert m.metric("cachefs_passthrough_enabled") == 0
    # Its reader closed it: the file is registered and its inode given an open template,
    # so the next open is the loop's, bound to the verified file (as an open in Python of
    # an object the memory tier holds gives its inode one: the loop's opens reading the
    # file cost less than Python's reading memory).
    _wait_metric(m, "cachefs_native_open_templates", 1)
    python_before = _python_reads(m)
    _drop_page_cache()
    assert _read(path) == data
    assert _python_reads(m) == python_before, "the next open was not the loop's"
    m.stop()
    m.start()  # an empty memory tier: the verified file is read by the native loop
    assert _read(path) == data
    assert m.metric("cachefs_native_reads_enabled") == 1
    python_before = _python_reads(m)
    read_before = m.metric("cachefs_read_bytes_total")
    native_before = m.metric('cachefs_fuse_requests_total{op="read"}')
    reread_cold(path, data, (0, BLOCK - 3, 3 * BLOCK + 5, len(data) - 10))
    assert _python_reads(m) == python_before, "reads of a verified file reached Python"
    assert m.metric("cachefs_read_bytes_total") >= read_before + 2 * len(data)
    assert m.metric('cachefs_fuse_requests_total{op="read"}') > native_before
    assert m.gets() == 0
    assert m.metric("cachefs_passthrough_opens_total") == 5
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 0


@pytest.mark.drops_caches
@pytest.mark.fuse
def test_native_reads_off_serves_every_read_in_python(shard, mount_factory) -> None:  # type: ignore[no-untyped-def]
    name, data = shard
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--passthrough", "off",
                      "--native-reads", "off")
    path = m.path / "shards" / "s0.tar"
    assert _read(path) == data
    _drop_page_cache()
    python_before = _python_reads(m)
    assert _read(path) == data
    assert m.metric("cachefs_native_reads_enabled") == 0
    assert m.metric("cachefs_passthrough_opens_total") == 0
    assert _python_reads(m) == python_before + len(data)


def _drop_dentries() -> None:
    _drop_page_cache(2)  # dentries and inodes: the next stat looks the name up again


@pytest.mark.drops_caches
@pytest.mark.fuse
@pytest.mark.parametrize("reader", ["kernel", "native"])
def test_a_name_looked_up_again_is_answered_by_the_native_loop_while_its_listing_is_fresh(
        bucket, mount_factory, reader) -> None:  # type: ignore[no-untyped-def]
    """After the kernel dropped its entry, a name looked up again is answered by the
    native loop (no Python) -- and only while its listing is fresh: once it is not, the
    lookup reaches Python again, which refreshes the listing, and a changed object is
    seen with its new size."""
    client, name = bucket
    client.put_object(Bucket=name, Key="d/a.bin", Body=b"1" * 100)
    extra = ("--passthrough", "off") if reader == "native" else ()
    m = mount_factory(f"s3://{name}", "--metadata-ttl", "2s", *extra)
    path = m.path / "d" / "a.bin"
    native_lookups = 'cachefs_fuse_native_answers_total{op="lookup"}'
    assert path.stat().st_size == 100  # (waits for the first listing)
    _drop_dentries()
    assert path.stat().st_size == 100  # looked up in Python, remembered in the loop
    before = m.metric(native_lookups)
    python_before = m.metric('cachefs_fuse_requests_total{op="lookup"}') - before
    _drop_dentries()
    assert path.read_bytes() == b"1" * 100
    assert m.metric(native_lookups) > before
    assert m.metric('cachefs_fuse_requests_total{op="lookup"}') - m.metric(native_lookups) \
        == python_before, "a remembered lookup reached Python"
    client.put_object(Bucket=name, Key="d/a.bin", Body=b"2" * 300)
    deadline = time.monotonic() + 60
    while True:
        _drop_dentries()
        if path.stat().st_size == 300:
            break
        assert time.monotonic() < deadline, "a remembered lookup outlived its listing"
        time.sleep(0.3)
    assert path.read_bytes() == b"2" * 300
    m.stop()


# -- opens answered by the loop (open templates) ------------------------------------------
def _open_request(unique: int, ino: int, flags: int = os.O_RDONLY, pid: int = 77) -> bytes:
    body = abi.OPEN_IN.pack(flags, 0)
    return IN_HEADER.pack(IN_HEADER.size + len(body), abi.OPEN, unique, ino, 0, 0, pid, 0, 0) + body


def _release_request(unique: int, fh: int) -> bytes:
    return _request(abi.RELEASE, unique, abi.RELEASE_IN.pack(fh, 0, 0) + b"\0" * 8)


def _events(reads: native.NativeReads) -> list[tuple[int, int, int, int]]:
    got: list[tuple[int, int, int, int]] = []
    reads.drain(lambda events: got.extend((kind, fh, ino, pid) for kind, pid, fh, ino in events))
    return got


def test_an_inode_with_a_template_is_opened_and_released_by_the_loop(loop: Loop) -> None:
    reads = loop.reads
    python_open = struct.pack("<I", abi.OPEN)
    assert reads.add_template(10, token=reads.lookup_epoch("d/"), prefix="d/", kernel_backing=7)
    assert reads.add_template(10, token=reads.lookup_epoch("d/"), prefix="d/", kernel_backing=8)  # renewed
    _, error, body = loop.ask(_open_request(1, 10))
    fh, flags, backing = abi.OPEN_OUT.unpack(body)
    assert error == 0 and fh >= native.FIRST_LOOP_FH
    assert (flags, backing) == (abi.FOPEN_PASSTHROUGH, 7), "renewing replaced the template"
    # what the loop does not answer: another inode, O_DIRECT, a write
    assert loop.ask(_open_request(2, 11))[2] == python_open
    assert loop.ask(_open_request(3, 10, os.O_RDONLY | os.O_DIRECT))[2] == python_open
    assert loop.ask(_open_request(4, 10, os.O_RDWR))[2] == python_open
    assert _events(reads) == [(native.OPENED, fh, 10, 77)]
    assert _events(reads) == []
    # the template stays while the handle is open
    assert not reads.drop_template(10)
    assert loop.ask(_release_request(5, fh)) == (5, 0, b"")
    assert loop.ask(_release_request(6, 12345))[2] == struct.pack("<I", abi.RELEASE)  # Python's
    assert _events(reads) == [(native.RELEASED, fh, 10, 0)]
    assert reads.drop_template(10) and reads.drop_template(10)
    assert loop.ask(_open_request(7, 10))[2] == python_open
    # a template lasts while its directory's epoch does; a token read before a change is
    # refused, a renewal with a current one brings it back
    token = reads.lookup_epoch("d/")
    assert reads.add_template(10, token=token, prefix="d/", kernel_backing=7)
    reads.forget_dir("d/")
    assert loop.ask(_open_request(8, 10))[2] == python_open
    assert not reads.add_template(10, token=token, prefix="d/", kernel_backing=7)
    assert reads.add_template(10, token=reads.lookup_epoch("d/"), prefix="d/", kernel_backing=7)
    assert loop.ask(_open_request(9, 10))[1:2] == (0,)
    assert [e[0] for e in _events(reads)] == [native.OPENED]
    st = _stats_after(reads, "open", 2)
    assert st["open"][0] == 2 and st["release"][0] == 1 and st["templates"] == 1


def test_a_handle_the_loop_opened_on_its_own_file_is_read_there(loop: Loop, cache_file: Any) -> None:
    path, data = cache_file
    reads = loop.reads
    backing = _register(reads, path)
    assert reads.add_template(20, token=reads.lookup_epoch(""), prefix="", native_backing=backing,
                              size=len(data))
    reads.backing_close(backing)  # the template keeps its own descriptor
    handles = []
    for unique in (1, 2):
        _, error, body = loop.ask(_open_request(unique, 20))
        fh, flags, _ = abi.OPEN_OUT.unpack(body)
        assert error == 0 and flags == abi.FOPEN_KEEP_CACHE
        handles.append(fh)
    assert handles[0] != handles[1]
    assert loop.ask(_read_request(3, handles[1], 1000, 5000))[2] == data[1000:6000]
    # Python releases a handle the loop opened (a RELEASE handed over): no event, and the
    # template may go once no handle is open
    assert reads.unbind(handles[0])
    assert loop.ask(_release_request(4, handles[1]))[1] == 0
    assert [e[0] for e in _events(reads)] == [native.OPENED, native.OPENED, native.RELEASED]
    assert reads.drop_template(20)
    assert loop.ask(_read_request(5, handles[1], 0, 10))[2] == struct.pack("<I", abi.READ)
    assert not reads.add_template(21, token=reads.lookup_epoch(""), prefix="", native_backing=backing,
                                  size=1), "a closed registration"


def test_opens_go_to_python_while_the_event_ring_is_full(loop: Loop) -> None:
    """Events are never dropped: with the ring full, the loop hands OPENs to Python, which
    takes the events first; releases of the loop's handles likewise."""
    reads = loop.reads
    assert reads.add_template(30, token=reads.lookup_epoch(""), prefix="", kernel_backing=3)
    handles = []
    unique = 0
    while True:
        unique += 1
        _, _, body = loop.ask(_open_request(unique, 30))
        if body == struct.pack("<I", abi.OPEN):
            break
        handles.append(abi.OPEN_OUT.unpack(body)[0])
    assert len(handles) == 16384 and reads.stats()["open_handovers"] == 1
    assert loop.ask(_release_request(unique + 1, handles[0]))[2] == struct.pack("<I", abi.RELEASE)
    events = _events(reads)
    assert [fh for _, fh, _, _ in events] == handles and reads.stats()["events"] == 0
    assert loop.ask(_release_request(unique + 2, handles[1])) == (unique + 2, 0, b"")
    assert _events(reads) == [(native.RELEASED, handles[1], 30, 0)]


def test_the_event_fd_wakes_a_waiter_when_events_arrive(loop: Loop) -> None:
    reads = loop.reads
    assert reads.add_template(40, token=reads.lookup_epoch(""), prefix="", kernel_backing=3)

    async def main() -> list[tuple[int, int, int, int]]:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, loop.ask, _open_request(1, 40))
                await reads.wait_events()
        return _events(reads)

    assert [e[0] for e in trio.run(main)] == [native.OPENED]


def _payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _wait_metric(m: Any, metric: str, value: float) -> None:
    deadline = time.monotonic() + 10
    while m.metric(metric) != value:
        if time.monotonic() > deadline:
            # (what the daemon did instead: the registrations' outcomes and the cache)
            told = {k: v for k, v in m.metrics().items()
                    if k.startswith(("cachefs_passthrough_", "cachefs_cache_evictions",
                                     "cachefs_cache_blocks", "cachefs_open_file_handles"))}
            pytest.fail(f"{metric} stayed {m.metric(metric)}, not {value}; {told}")
        time.sleep(0.05)


def _give_a_template(m: Any, key: str, body: bytes, *, cached_blocks: int) -> None:
    """Read ``key`` (cold), wait for the cache to hold ``cached_blocks``, restart the daemon
    (an empty memory tier: the native loop reads the file) and open ``key`` once in Python,
    which registers it and gives its inode an open template: its next open is the loop's."""
    assert _read(m.path / key) == body
    _wait_metric(m, "cachefs_cache_blocks", cached_blocks)
    m.stop()
    m.start()
    assert _read(m.path / key) == body
    _wait_metric(m, "cachefs_native_open_templates", 1)


@pytest.mark.drops_caches
@pytest.mark.fuse
@pytest.mark.parametrize("reader", ["kernel", "native"])
def test_opens_answered_by_the_loop_keep_their_registration_until_closed(
        bucket, mount_factory, reader) -> None:  # type: ignore[no-untyped-def]
    """A file opened once is opened by the native loop afterwards (no Python), and a
    handle the loop opened keeps the file's registration (its pin, the kernel's backing)
    while the idle bound would close it: its bytes stay right, and the registration goes
    only once the handle is closed."""
    client, name = bucket
    a, b = _payload(1, 100_000), _payload(2, 100_000)
    client.put_object(Bucket=name, Key="a.bin", Body=a)
    client.put_object(Bucket=name, Key="b.bin", Body=b)
    extra = ("--passthrough", "off") if reader == "native" else ()
    args = ("--block-size", "64K", "--cache-size", "512K", "--memory-budget", "256K",
            "--registered-files", "1", *extra)
    m = mount_factory(f"s3://{name}", *args)
    assert _read(m.path / "b.bin") == b
    _give_a_template(m, "a.bin", a, cached_blocks=4)
    opens = 'cachefs_fuse_native_answers_total{op="open"}'
    before = m.metric(opens)
    _drop_page_cache()
    fd = os.open(m.path / "a.bin", os.O_RDONLY)  # opened by the loop
    try:
        assert m.metric(opens) == before + 1
        assert m.metric("cachefs_open_file_handles") == 1  # (its bookkeeping caught up)
        for _ in range(2):  # b registered, idle: the bound would close a's registration
            assert _read(m.path / "b.bin") == b
            # (the kernel sends a RELEASE after close() returns: b's next open must not
            # find its handle still open, registration and template included)
            _wait_metric(m, "cachefs_open_file_handles", 1)
        # a's registration and template stayed: another open of it is the loop's too
        _drop_page_cache()
        assert _read(m.path / "a.bin") == a
        assert m.metric(opens) == before + 2
        _drop_page_cache()
        assert os.pread(fd, len(a) + 10, 0) == a
    finally:
        os.close(fd)
    _wait_metric(m, "cachefs_open_file_handles", 0)
    for _ in range(2):  # now a's registration may go (the loop's handle is closed)
        assert _read(m.path / "b.bin") == b
        _wait_metric(m, "cachefs_open_file_handles", 0)
    answered = m.metric(opens)
    assert _read(m.path / "a.bin") == a  # registered again, in Python ...
    assert m.metric(opens) == answered, "a's template outlived its registration"
    assert _read(m.path / "a.bin") == a  # ... and given a template again
    assert m.metric(opens) == answered + 1
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 0
    assert m.gets() == 0
    m.stop()


@pytest.mark.drops_caches
@pytest.mark.fuse
@pytest.mark.parametrize("reader", ["kernel", "native"])
def test_an_evicted_registration_the_loop_still_reads_goes_once_its_handle_closes(
        bucket, mount_factory, reader) -> None:  # type: ignore[no-untyped-def]
    """An idle registration's pin yields to eviction, but a handle the native loop opened
    with its template may still read the file (Python does not see it): eviction drops
    the blocks from the index, the bytes stay right under the open handle, and the
    registration is closed, and its bytes freed, only after that handle is closed: soon
    after, even if nothing else happens on the mount."""
    client, name = bucket
    # (z/ sorts after b/: no walk of z/ goes on into b/ and fetches its files ahead)
    files = {"z/a.bin": _payload(11, 100_000), "b/c.bin": _payload(12, 100_000),
             "b/d.bin": _payload(13, 100_000)}
    for key, body in files.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    a = files["z/a.bin"]
    extra = ("--passthrough", "off") if reader == "native" else ()
    # 256 KiB: a, c and d (100,000 bytes, two blocks each) do not all fit, and a is the
    # least recently used.
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--cache-size", "256K",
                      "--cache-policy", "lru", "--memory-budget", "256K", *extra)
    _give_a_template(m, "z/a.bin", a, cached_blocks=2)
    opens = 'cachefs_fuse_native_answers_total{op="open"}'
    before = m.metric(opens)
    fd = os.open(m.path / "z/a.bin", os.O_RDONLY)  # opened by the loop
    try:
        assert m.metric(opens) == before + 1
        for key in ("b/c.bin", "b/d.bin"):
            assert _read(m.path / key) == files[key]
        # (d's put needs one of a's blocks: the least recently used)
        _wait_metric(m, "cachefs_cache_evictions_total", 1)
        _wait_metric(m, "cachefs_open_file_handles", 1)
        assert m.metric("cachefs_passthrough_yielded_total") == 0, \
            "closed under a handle the loop opened"
        _drop_page_cache()
        assert os.pread(fd, len(a) + 10, 0) == a, "the loop's handle read freed bytes"
    finally:
        os.close(fd)
    _wait_metric(m, "cachefs_open_file_handles", 0)
    # Nothing else happens on the mount: the loop's release reaches Python only as a
    # bookkeeping event, so the registration goes at the daemon's next look (every
    # second), not at a later read.
    _wait_metric(m, "cachefs_passthrough_yielded_total", 1)
    # ... and a's bytes with it, not at the next maintenance pass (every 5 s)
    deadline = time.monotonic() + 2
    while (held := m.cache_bytes_on_disk()) > 256 * 1024:
        assert time.monotonic() < deadline, f"{held} bytes on disk for a 256 KiB cache"
        time.sleep(0.05)
    # What is left registered is c's and d's at most (registered at their close, each
    # when whole on disk then: which of their blocks d's puts evict depends on when the
    # preparing thread looks, so not asserted), never a's.
    assert m.metric("cachefs_passthrough_backing_files") <= 2
    assert _read(m.path / "z/a.bin") == a  # (not whole on disk any more: the daemon's)
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 0


@pytest.mark.fuse
@pytest.mark.parametrize("reader", ["kernel", "native"])
def test_a_file_opened_before_it_was_cached_is_opened_by_the_loop_next_time(bucket, mount_factory, reader) -> None:  # type: ignore[no-untyped-def]
    """A cold open is served by the daemon (the object is not cached yet); once its
    reader closed it, the file is registered and its inode given an open template (a
    backing with the kernel's passthrough, the native loop's reads without): its next open
    (the next epoch's) is the loop's, not Python's."""
    if reader == "kernel" and not passthrough_mod.supported():
        pytest.skip("FUSE passthrough needs Linux >= 6.9")
    client, name = bucket
    a = _payload(22, 100_000)
    client.put_object(Bucket=name, Key="a.bin", Body=a)
    mode = ["--passthrough", "off"] if reader == "native" else []
    m = mount_factory(f"s3://{name}", "--block-size", "64K", *mode)
    assert _read(m.path / "a.bin") == a  # (cold: opened and read in Python)
    _wait_metric(m, "cachefs_passthrough_backing_files", 1)
    _wait_metric(m, "cachefs_native_open_templates", 1)
    opens = 'cachefs_fuse_native_answers_total{op="open"}'
    before, gets = m.metric(opens), m.gets()
    assert _read(m.path / "a.bin") == a
    assert m.metric(opens) == before + 1
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 0
    assert m.gets() == gets


@pytest.mark.drops_caches
@pytest.mark.fuse
def test_the_loops_opens_and_releases_are_told_to_python_in_batches(bucket, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """Python takes the loop's opens and releases in batches (fs.FileSystem.adopt): each
    open is counted (an open of a registered file, its bytes a cache hit), a handle
    still open after a batch is in Python's table (a read of it may reach Python), and
    one opened and released within a batch leaves nothing behind."""
    client, name = bucket
    a = _payload(21, 100_000)
    client.put_object(Bucket=name, Key="a.bin", Body=a)
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--passthrough", "off")
    _give_a_template(m, "a.bin", a, cached_blocks=2)
    before = m.metrics()
    for _ in range(30):  # (the kernel's page cache answers the reads: opens only)
        with open(m.path / "a.bin", "rb") as f:
            assert f.read(10) == a[:10]
    fd = os.open(m.path / "a.bin", os.O_RDONLY)
    try:
        assert m.metric("cachefs_open_file_handles") == 1  # (the scrape took the batch)
        _drop_page_cache()
        assert os.pread(fd, len(a), 0) == a
    finally:
        os.close(fd)
    _wait_metric(m, "cachefs_open_file_handles", 0)
    after = m.metrics()
    opens = 'cachefs_fuse_native_answers_total{op="open"}'
    assert after[opens] - before[opens] == 31
    assert after["cachefs_passthrough_opens_total"] - before["cachefs_passthrough_opens_total"] == 31
    assert after["cachefs_cache_hit_bytes_total"] - before["cachefs_cache_hit_bytes_total"] == 31 * len(a)
    assert after["cachefs_cache_corrupt_blocks_total"] == 0


@pytest.mark.fuse
@pytest.mark.parametrize("reader", ["kernel", "native"])
def test_an_open_the_loop_answers_sees_a_listing_change_as_python_would(
        bucket, mount_factory, reader) -> None:  # type: ignore[no-untyped-def]
    """The kernel keeps a name's inode for the metadata TTL and opens it without a lookup.
    When the directory's listing is refreshed meanwhile (here: an ESTALE read of another
    file invalidates it) and no longer has that inode, Python answers its open ESTALE and
    the kernel looks the name up again, finding the new version. An open template must not
    keep answering the old inode: its directory's epoch moved on."""
    client, name = bucket
    a_old, a_new = _payload(11, 50_000), _payload(12, 60_000)
    client.put_object(Bucket=name, Key="d/a.bin", Body=a_old)
    # (named before a.bin: a walk from a.bin does not fetch it ahead)
    client.put_object(Bucket=name, Key="d/0v.bin", Body=b"A" * (8 * BLOCK))
    extra = ("--passthrough", "off") if reader == "native" else ()
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--read-ahead", "64K",
                      "--metadata-ttl", "1h", *extra)
    a = m.path / "d" / "a.bin"
    assert _read(a) == a_old
    _wait_metric(m, "cachefs_cache_blocks", 1)
    m.stop()
    m.start()  # (an empty memory tier: the native loop reads the file)
    assert _read(a) == a_old  # opened in Python: registered, given a template
    opens = 'cachefs_fuse_native_answers_total{op="open"}'
    before = m.metric(opens)
    assert _read(a) == a_old
    assert m.metric(opens) == before + 1  # the loop opened it
    client.put_object(Bucket=name, Key="d/a.bin", Body=a_new)
    # 0v.bin changes under an open reader: its last block (never fetched ahead of a read
    # of the first) is ESTALE, and d/'s listing is refreshed
    with open(m.path / "d" / "0v.bin", "rb", buffering=0) as f:
        assert os.pread(f.fileno(), BLOCK, 0) == b"A" * BLOCK
        client.put_object(Bucket=name, Key="d/0v.bin", Body=b"B" * (8 * BLOCK))
        with pytest.raises(OSError) as raised:
            os.pread(f.fileno(), BLOCK, 7 * BLOCK)
        assert raised.value.errno == errno.ESTALE
    deadline = time.monotonic() + 20
    while (got := _read(a)) != a_new:
        assert got == a_old
        assert time.monotonic() < deadline, "an open template kept answering the old inode"
        time.sleep(0.2)


def test_the_lookup_table_has_twice_as_many_slots_as_registered_files() -> None:
    assert native.lookup_slots_for(0) == native.LOOKUP_SLOTS
    assert native.lookup_slots_for(native.LOOKUP_SLOTS // 2) == native.LOOKUP_SLOTS
    assert native.lookup_slots_for(65_536) == 131_072
    assert native.lookup_slots_for(100_000) == 262_144


@pytest.mark.fuse
@pytest.mark.parametrize("passthrough", ["off", "kernel"])
def test_a_handle_opened_before_its_file_was_cached_is_read_in_c_once_it_is(
        bucket: Any, mount_factory: Any, passthrough: str) -> None:
    """A reader that keeps one handle for a whole run (a memory-mapped Arrow or token file
    opened once) got it while the file was not cached: every READ of it was answered in
    Python for its whole life, each reading and verifying a whole block. Once the object
    is cached whole (by this daemon: no read-back), that handle is bound to its file and
    the native loop answers its READs; its bytes stay exact, before and after its close.
    Every such handle of the file (each of a node's training processes maps it), with the
    kernel's passthrough too, which fixed the handles' mode at their open: the file is
    registered with the loop beside the kernel for them, and the next open of the file
    after their close is passed through again (the one-mode rule held)."""
    if passthrough == "kernel" and not passthrough_mod.supported():
        pytest.skip("FUSE passthrough needs Linux >= 6.9")
    client, name = bucket
    data = random.Random(11).randbytes(4 * (1 << 20) + 777)
    client.put_object(Bucket=name, Key="rows.arrow", Body=data)
    m = mount_factory(f"s3://{name}", "--block-size", "1M",
                      *(["--passthrough", "off"] if passthrough == "off" else []))
    if passthrough == "kernel":
        assert m.metric("cachefs_passthrough_enabled") == 1
    path = m.path / "rows.arrow"
    native_reads = 'cachefs_fuse_native_answers_total{op="read"}'
    # Two handles, as two training processes of a node each map the file at start-up.
    fds = [os.open(path, os.O_RDONLY), os.open(path, os.O_RDONLY)]
    try:
        assert os.pread(fds[0], len(data) + 10, 0) == data  # cold: fetched through Python
        deadline = time.monotonic() + 30  # (written to the disk cache after the reads)
        while m.metric("cachefs_cache_blocks") < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        before = m.metric(native_reads)
        for _ in range(6):  # (a try to bind is made at a READ at most every second)
            time.sleep(1.1)
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                offset = random.randrange(len(data) - 4096)
                assert os.pread(fd, 4096, offset) == data[offset:offset + 4096]
            if m.metric("cachefs_passthrough_upgraded_total") >= 2:
                break
        assert m.metric("cachefs_passthrough_upgraded_total") == 2
        for fd in fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            for offset in (0, 1 << 20, len(data) - 5000):
                assert os.pread(fd, 4096, offset) == data[offset:offset + 4096]
        assert m.metric(native_reads) >= before + 6, "the handles' reads are still Python's"
        os.close(fds.pop())  # one closed: the other reads on
        os.posix_fadvise(fds[0], 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(fds[0], 4096, 4096) == data[4096:8192]
    finally:
        for fd in fds:
            os.close(fd)
    drop_cached(path)
    opens = m.metric("cachefs_passthrough_opens_total")
    assert _read(path) == data
    if passthrough == "kernel":
        assert m.metric("cachefs_passthrough_opens_total") == opens + 1

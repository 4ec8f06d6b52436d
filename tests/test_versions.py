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
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from cachefs.passthrough import supported as passthrough_supported
from tests.versiontags import UNIT, VersionTags

pytestmark = pytest.mark.fuse

MIB = 1 << 20


def units_of(version: int) -> int:
    """About 6 MiB; the length differs between versions (by whole 4 KiB pages and by
    odd units, so a length from another version cannot pass as this one's)."""
    return 6 * MIB // UNIT - 2048 + (version * 389) % 4096


_TAGS = VersionTags(units_of)
tagged = _TAGS.tagged
classify = _TAGS.classify


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
    outcomes = overwrite_under_readers(client, name, m.path, seconds=10)
    print(dict(outcomes))
    assert outcomes["ok"] > 0
    assert outcomes["mixed"] == 0, outcomes
    assert outcomes["wrong_length"] == 0, outcomes


# -- each cache the kernel keeps per inode, forced deterministically -------------------------
BLOCK = 64 * 1024


def _payload(seed: int, size: int) -> bytes:
    import random

    return random.Random(seed).randbytes(size)


def _read_fd(fd: int, size: int, offset: int = 0) -> bytes:
    import os

    out = []
    while True:
        chunk = os.pread(fd, size, offset)
        if not chunk:
            return b"".join(out)
        out.append(chunk)
        offset += len(chunk)


def _read_or_estale(fd: int, expected: bytes) -> None:
    """The whole of ``fd`` is ``expected`` (the version it opened), or the read fails
    with ESTALE; nothing else."""
    try:
        got = _read_fd(fd, BLOCK)
    except OSError as exc:
        assert exc.errno == errno.ESTALE, exc
        return
    assert len(got) == len(expected), "a length from another version"
    assert got == expected, "bytes from another version"


def test_a_newer_listing_never_changes_the_size_of_an_open_file(bucket, mount_factory) -> None:  # type: ignore[no-untyped-def]
    import os

    client, name = bucket
    v1, v2 = _payload(1, 4 * BLOCK + 100), _payload(2, 6 * BLOCK + 7)
    client.put_object(Bucket=name, Key="f.bin", Body=v1)
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--metadata-ttl", "1s",
                      "--read-ahead", "64K")
    path = m.path / "f.bin"
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, BLOCK, 0) == v1[:BLOCK]
        client.put_object(Bucket=name, Key="f.bin", Body=v2)
        _until(lambda: os.stat(path).st_size == len(v2))  # the name shows the new version
        # the open file is still the old one
        assert os.fstat(fd).st_size == len(v1), "an open file took another version's size"
        _read_or_estale(fd, v1)
    finally:
        os.close(fd)
    assert path.read_bytes() == v2


@pytest.mark.parametrize("passthrough", ["auto", "off"])
@pytest.mark.parametrize("opened", ["cold", "cached"])
def test_an_open_file_keeps_its_attributes_and_maps_after_its_object_changed(  # type: ignore[no-untyped-def]
        bucket, mount_factory, passthrough, opened) -> None:
    """fstat() of an open file is that file's version, not ESTALE, after a newer listing
    dropped its inode: the kernel sends it without the handle, and nothing retries it
    (a stat through the name is retried on ESTALE; an fstat is not). mmap(), which
    sizes the map with fstat, then maps the open version's bytes. Whether Python opened
    the file (cold) or the native loop did (cached: an open template)."""
    import mmap
    import os

    client, name = bucket
    v1, v2 = _payload(1, 3 * BLOCK + 5), _payload(2, 5 * BLOCK + 3)
    client.put_object(Bucket=name, Key="f.bin", Body=v1)
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--metadata-ttl", "1s",
                      "--passthrough", passthrough)
    path = m.path / "f.bin"
    if opened == "cached":
        assert path.read_bytes() == v1
        _wait_metric(m, "cachefs_open_file_handles", 0)
    with open(path, "rb") as f:
        assert f.read() == v1
        client.put_object(Bucket=name, Key="f.bin", Body=v2)
        _until(lambda: os.stat(path).st_size == len(v2))  # the listing has v2 now
        time.sleep(1.2)  # and the kernel's attributes of the open file have expired
        assert os.fstat(f.fileno()).st_size == len(v1)
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            assert len(mapped) == len(v1)
            assert mapped[:] == v1
    assert path.read_bytes() == v2


def test_the_page_cache_of_one_version_never_serves_another(bucket, mount_factory) -> None:  # type: ignore[no-untyped-def]
    import os

    client, name = bucket
    v1, v2 = b"1" * (3 * BLOCK), b"2" * (3 * BLOCK)  # one length: only the bytes tell
    client.put_object(Bucket=name, Key="f.bin", Body=v1)
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--metadata-ttl", "1s",
                      "--passthrough", "off")
    path = m.path / "f.bin"
    fd1 = os.open(path, os.O_RDONLY)
    try:
        assert _read_fd(fd1, BLOCK) == v1  # v1 in the page cache (kept across opens)
        client.put_object(Bucket=name, Key="f.bin", Body=v2)
        # New opens find v2 (its pages: never in fd1's cache) once the listing has it.
        _until(lambda: path.read_bytes() == v2)
        assert _read_fd(fd1, BLOCK) == v1  # cached blocks of v1, never v2's pages
    finally:
        os.close(fd1)


@pytest.mark.skipif(not passthrough_supported(), reason="FUSE passthrough needs Linux >= 6.9")
def test_a_passed_through_file_never_serves_a_newer_open(bucket, mount_factory) -> None:  # type: ignore[no-untyped-def]
    import os

    client, name = bucket
    v1, v2 = _payload(1, 3 * BLOCK), _payload(2, 5 * BLOCK + 3)
    client.put_object(Bucket=name, Key="f.bin", Body=v1)
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--metadata-ttl", "1s")
    path = m.path / "f.bin"
    assert path.read_bytes() == v1  # cached
    _wait_metric(m, "cachefs_open_file_handles", 0)
    fd1 = os.open(path, os.O_RDONLY)  # passed through to v1's cache file
    try:
        assert m.metric("cachefs_passthrough_opens_total") == 1
        client.put_object(Bucket=name, Key="f.bin", Body=v2)
        _until(lambda: os.stat(path).st_size == len(v2))
        fd2 = os.open(path, os.O_RDONLY)
        try:
            assert os.fstat(fd2).st_size == len(v2)
            assert _read_fd(fd2, BLOCK) == v2
        finally:
            os.close(fd2)
        assert _read_fd(fd1, BLOCK) == v1
    finally:
        os.close(fd1)


def test_an_outdated_entry_in_the_kernel_opens_the_current_version(bucket, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """The kernel may hold a name's entry (to the old version's inode) after the
    daemon's listing learnt of a new version: the open answers ESTALE and the
    kernel looks the name up again, so the caller opens the new version."""
    client, name = bucket
    client.put_object(Bucket=name, Key="d/a.bin", Body=b"old a")
    client.put_object(Bucket=name, Key="d/b.bin", Body=b"b")
    client.put_object(Bucket=name, Key="d/c.bin", Body=b"c")
    m = mount_factory(f"s3://{name}", "--metadata-ttl", "3s")
    t0 = time.monotonic()
    assert (m.path / "d" / "b.bin").read_bytes() == b"b"  # the directory is listed now
    client.put_object(Bucket=name, Key="d/a.bin", Body=b"new a!")
    time.sleep(max(0.0, t0 + 2.0 - time.monotonic()))
    assert (m.path / "d" / "a.bin").stat().st_size == 5  # entry kept by the kernel for 3 s
    time.sleep(max(0.0, t0 + 3.3 - time.monotonic()))
    lists = m.metric('cachefs_s3_requests_total{op="list"}')
    (m.path / "d" / "c.bin").stat()  # the directory is listed again: a is "new a!" now
    _until(lambda: m.metric('cachefs_s3_requests_total{op="list"}') > lists)
    time.sleep(0.2)  # the new listing is stored
    assert time.monotonic() < t0 + 4.5, "too slow to test: the kernel's entry of a expired"
    assert (m.path / "d" / "a.bin").read_bytes() == b"new a!"


def _until(condition: Any, timeout: float = 15) -> None:
    """Poll until ``condition()`` (an expired listing may be answered while it is
    refreshed, so a new version shows up shortly after the TTL, not at it)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _wait_metric(m: Any, metric: str, value: float) -> None:
    for _ in range(100):
        if m.metric(metric) == value:
            return
        time.sleep(0.05)


# -- an object replaced while its listing is fresh --------------------------------------------
@pytest.mark.parametrize("passthrough", ["off", "auto"])
def test_an_open_after_a_get_saw_the_change_reads_the_new_version(bucket, s3_endpoint,  # type: ignore[no-untyped-def]
                                                                  mount_factory, passthrough):
    """The object behind a name is replaced in S3 while its directory's listing is fresh
    and the kernel still holds the name's entry (the old version's inode). Once a GET has
    seen the change (here the first read of a handle opened before it, which fails ESTALE:
    nothing of the old version is cached and S3 no longer has it), a new open and read of
    the name gets the new version's bytes, never ESTALE -- also while the refreshed
    listing is still on its way (LISTs are held back until the reader waits on the
    daemon). The handle opened before keeps its version: its length, and ESTALE for
    bytes S3 no longer has."""
    from tests.faultproxy import FaultProxy

    client, name = bucket
    v1, v2 = _payload(1, 3 * BLOCK + 11), _payload(2, 5 * BLOCK + 3)
    client.put_object(Bucket=name, Key="d/f.bin", Body=v1)
    client.put_object(Bucket=name, Key="d/g.bin", Body=b"g")
    lists_held = threading.Event()

    def plan(method: str, path: str, n: int) -> str:
        if method == "GET" and "list-type=2" in path:
            lists_held.wait(60)  # (a hang guard: released below)
        return "pass"

    with FaultProxy(s3_endpoint) as proxy:
        m = mount_factory(f"s3://{name}", "--block-size", "64K", "--metadata-ttl", "1h",
                          "--list-ahead", "0", "--passthrough", passthrough, start=False)
        m.endpoint = proxy.url
        m.start()
        path = m.path / "d" / "f.bin"
        assert path.stat().st_size == len(v1)  # listed, fresh for an hour (the entry too)
        held = os.open(path, os.O_RDONLY)
        try:
            client.put_object(Bucket=name, Key="d/f.bin", Body=v2)
            proxy.plan = plan
            lists_held.clear()
            try:
                with pytest.raises(OSError) as ei:
                    os.pread(held, BLOCK, 0)  # the GET that sees the change
                assert ei.value.errno == errno.ESTALE
                deferred = m.metric('cachefs_fuse_handed_over_total{how="deferred"}')
                got: dict[str, Any] = {}

                def reader() -> None:
                    try:
                        got["data"] = _read_whole(path)
                    except OSError as exc:
                        got["errno"] = errno.errorcode.get(exc.errno or 0, exc.errno)

                t = threading.Thread(target=reader)
                t.start()
                # The LISTs stay held until the reader has its answer or waits on the
                # daemon: its open must not depend on the listing being refreshed first.
                _until(lambda: not t.is_alive() or m.metric(
                    'cachefs_fuse_handed_over_total{how="deferred"}') > deferred, timeout=30)
            finally:
                lists_held.set()
            t.join(60)
            assert not t.is_alive()
            assert "errno" not in got, f"open+read of the new version failed {got['errno']}"
            assert got["data"] == v2
            # (the kernel's entry named the old inode: its open was answered ESTALE, and
            # the kernel's second try, after a LOOKUP, opened the new version)
            assert m.metric('cachefs_fuse_errors_total{errno="ESTALE",op="open"}') >= 1
            assert path.read_bytes() == v2
            assert os.fstat(held).st_size == len(v1)  # the held handle keeps its version
            _read_or_estale(held, v1)
        finally:
            os.close(held)
        assert "Traceback" not in m.log()


@pytest.mark.parametrize("passthrough", ["off", "auto"])
def test_a_walk_opens_the_new_version_of_a_file_its_lookahead_saw_replaced(  # type: ignore[no-untyped-def]
        bucket, mount_factory, passthrough):
    """A reader walks a directory in name order (a DataLoader over its files) while its
    listing is fresh and the kernel holds every name's entry; one file ahead of it was
    replaced in S3 meanwhile. The walk's lookahead GETs that file before the reader opens
    it and sees the change: the reader's open and read then get the new version (the
    kernel's entry is outdated: the open answers ESTALE inside the kernel, which looks
    the name up again), never ESTALE, and every other file its one version."""
    client, name = bucket
    files = {f"d/f{i:02d}.bin": _payload(10 + i, 20_000 + i) for i in range(10)}
    for key, data in files.items():
        client.put_object(Bucket=name, Key=key, Body=data)
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--metadata-ttl", "1h",
                      "--list-ahead", "0", "--passthrough", passthrough)
    d = m.path / "d"
    for key in sorted(files):  # the kernel holds every entry (for an hour)
        assert (m.path / key).stat().st_size == len(files[key])
    new = _payload(99, 30_003)
    client.put_object(Bucket=name, Key="d/f06.bin", Body=new)
    files["d/f06.bin"] = new
    changed = 'cachefs_s3_errors_total{kind="ObjectChanged",op="get"}'
    lists = m.metric('cachefs_s3_requests_total{op="list"}')
    for i in range(4):  # a walk in order: its lookahead requests f04..f07
        assert _read_whole(d / f"f{i:02d}.bin") == files[f"d/f{i:02d}.bin"]
    _until(lambda: m.metric(changed) >= 1)  # the lookahead's GET of f06 saw the change
    # (the refresh of the listing it asks for is under way: a bounded wait, no assertion;
    # the reads below must not depend on it having ended)
    for _ in range(50):
        if m.metric('cachefs_s3_requests_total{op="list"}') > lists:
            break
        time.sleep(0.1)
    for i in range(4, 10):
        key = f"d/f{i:02d}.bin"
        try:
            got = _read_whole(m.path / key)
        except OSError as exc:
            raise AssertionError(f"{key}: {errno.errorcode.get(exc.errno or 0)}") from exc
        assert got == files[key], key
    # The new version was reached one of two ways, by timing: the open of the outdated
    # entry answered ESTALE inside the kernel (which looked the name up again), or the
    # listing's refresh had ended first and the name was looked up afresh.
    assert (m.metric('cachefs_fuse_errors_total{errno="ESTALE",op="open"}') >= 1
            or m.metric('cachefs_s3_requests_total{op="list"}') > lists)
    assert "Traceback" not in m.log()


# -- objects rewritten faster than a listing and an open take ----------------------------------
_SMALL = VersionTags(lambda v: 256 * 1024 // UNIT - 64 + (v * 389) % 128)  # ~250 KB


@pytest.mark.slow
def test_objects_rewritten_faster_than_they_list_fail_only_with_estale(bucket, mount_factory):  # type: ignore[no-untyped-def]
    """The documented limit of an open of a changed object (README, "How keys become
    files"): the kernel retries an open that failed ESTALE once, and the version the
    retry's lookup gets (the listing made since) may have been replaced too when objects
    are rewritten dozens of times a second; then open() fails with ESTALE. Each open
    reads one whole version, or fails with ESTALE (at the open or at a read): nothing
    else, never a mix, never another version's length, no other error, no hang."""
    client, name = bucket
    files = 6
    for f in range(files):
        client.put_object(Bucket=name, Key=f"v/f{f}.bin", Body=_SMALL.tagged(1, f))
    m = mount_factory(f"s3://{name}", "--metadata-ttl", "1s", "--block-size", "64K")
    stop = threading.Event()
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    failures: list[BaseException] = []
    versions = iter(range(2, 1 << 30))

    def writer() -> None:
        try:
            while not stop.is_set():
                v = next(versions)
                client.put_object(Bucket=name, Key=f"v/f{v % files}.bin",
                                  Body=_SMALL.tagged(v, v % files))
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    def reader(seed: int) -> None:
        n = seed
        try:
            while not stop.is_set():
                f = n % files
                n += 1
                try:
                    fd = os.open(m.path / "v" / f"f{f}.bin", os.O_RDONLY)
                except OSError as exc:
                    if exc.errno != errno.ESTALE:
                        raise
                    got = "open_estale"
                else:
                    try:
                        got = _SMALL.classify(_read_fd(fd, MIB), f)
                    except OSError as exc:
                        if exc.errno != errno.ESTALE:
                            raise
                        got = "read_estale"
                    finally:
                        os.close(fd)
                with lock:
                    outcomes[got] += 1
        except BaseException as exc:  # reported by the test
            failures.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(2)]
    threads += [threading.Thread(target=reader, args=(r,)) for r in range(8)]
    for t in threads:
        t.start()
    time.sleep(30)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a reader or writer hung"
    print(dict(outcomes), next(versions) - 2, "versions written")
    assert not failures, failures
    assert outcomes["ok"] > 0, outcomes
    assert set(outcomes) <= {"ok", "open_estale", "read_estale"}, outcomes

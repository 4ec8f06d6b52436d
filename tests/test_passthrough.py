"""FUSE passthrough on real mounts: the kernel reads fully cached files from the cache file.

What is checked: a cached file's open is passed through and its reads never reach
the daemon, yet return the object's exact bytes; a corrupt cache file is never
handed to the kernel; concurrent opens share one backing, released with the last
handle; an inode with a handle served by the daemon is not switched to
passthrough (the kernel would fail the open); ``--passthrough off`` is honoured.
These tests need Linux >= 6.9 and root (cachefs negotiates passthrough with the
kernel itself, whatever the pyfuse3 and libfuse) and are skipped, saying why, on
an older kernel.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

import pytest

from cachefs import passthrough
from cachefs.fuse import abi
from tests.conftest import drop_page_cache as _drop_page_cache
from tests.conftest import read_unbuffered as _read
from tests.conftest import reread_cold

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.skipif(not passthrough.supported(),
                       reason="FUSE passthrough needs Linux >= 6.9"),
]

BLOCK = 64 * 1024


def _payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _walk_files(bucket: Any, *, seed: int, size: int, n: int = 40) -> tuple[str, dict[str, bytes]]:
    """``n`` small files of one folder (``walk/``) put into the bucket: (bucket name, files)."""
    client, name = bucket
    files = {f"walk/f{i:03d}.bin": _payload(seed + i, size + i) for i in range(n)}
    for key, body in files.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    return name, files


def _counter(m: Any, name: str) -> float:
    return m.metric(name)


@pytest.fixture
def shard(bucket: Any) -> tuple[Any, str, bytes]:
    client, name = bucket
    data = _payload(7, 5 * BLOCK + 777)
    client.put_object(Bucket=name, Key="shards/s0.tar", Body=data)
    return client, name, data


@pytest.mark.drops_caches
def test_cached_file_is_read_by_the_kernel_with_exact_bytes(shard, mount_factory) -> None:  # type: ignore[no-untyped-def]
    _, name, data = shard
    m = mount_factory(f"s3://{name}", "--block-size", "64K")
    path = m.path / "shards" / "s0.tar"
    assert _read(path) == data  # cold: through the daemon, fills the cache
    assert _counter(m, "cachefs_passthrough_opens_total") == 0
    assert m.metric("cachefs_passthrough_enabled") == 1
    read_before = m.metric("cachefs_read_bytes_total")
    hits_before = m.metric("cachefs_cache_hit_bytes_total")
    gets_before = m.gets()
    reread_cold(path, data, (0, BLOCK - 3, 3 * BLOCK + 5, len(data) - 10))
    assert _counter(m, "cachefs_passthrough_opens_total") == 4
    assert m.metric("cachefs_read_bytes_total") == read_before, "reads reached the daemon"
    assert m.gets() == gets_before
    # Verified once, when registered; the idle registration serves the later opens, each
    # counted as a read of the whole object from the cache.
    assert m.metric("cachefs_passthrough_verified_bytes_total") == len(data)
    assert m.metric("cachefs_cache_hit_bytes_total") == hits_before + 4 * len(data)
    assert m.metric("cachefs_passthrough_backing_files") == 1
    m.stop()
    m.start()  # a new daemon: the cache file is verified again before use
    assert _read(path) == data
    assert _counter(m, "cachefs_passthrough_opens_total") == 1 and m.gets() == 0


@pytest.mark.drops_caches
@pytest.mark.parametrize("reader", ["kernel", "native"])
def test_corrupt_cache_file_is_never_handed_to_the_kernel(shard, mount_factory, reader) -> None:  # type: ignore[no-untyped-def]
    """Nor to the native loop (without passthrough: tests/test_native_reads.py), which
    takes its files from the same registration."""
    _, name, data = shard
    mode = ["--passthrough", "off"] if reader == "native" else []
    m = mount_factory(f"s3://{name}", "--block-size", "64K", *mode)
    path = m.path / "shards" / "s0.tar"
    assert _read(path) == data
    m.corrupt_cache_file(2 * BLOCK + 9)  # one flipped bit in the third block
    _drop_page_cache()
    assert _read(path) == data
    metrics = m.metrics()
    assert metrics["cachefs_cache_corrupt_blocks_total"] == 1
    assert metrics.get('cachefs_passthrough_declined_total{reason="unverified"}') == 1
    assert metrics['cachefs_s3_requests_total{op="get"}'] == 1, "only the bad block is fetched"
    assert metrics.get("cachefs_passthrough_opens_total", 0) == 0
    # Repaired by that read: the next open (a new daemon's: an object in its memory tier
    # is not bound to the native loop) reads the file without the daemon's Python.
    m.stop()
    m.start()
    _drop_page_cache()
    assert _read(path) == data
    assert m.metric("cachefs_passthrough_opens_total") == 1
    assert m.metric("cachefs_native_reads_enabled") == (reader == "native")
    assert m.metric("cachefs_read_bytes_total") == (len(data) if reader == "native" else 0)
    assert m.gets() == 0 and m.metric("cachefs_cache_corrupt_blocks_total") == 0


@pytest.mark.drops_caches
@pytest.mark.parametrize("reader", ["kernel", "native"])
def test_concurrent_opens_share_one_backing(shard, mount_factory, reader) -> None:  # type: ignore[no-untyped-def]
    """Three handles of one file read at once: one registration, exact bytes. With the
    native loop (no passthrough) its two workers serve the handles' reads concurrently."""
    _, name, data = shard
    mode = ["--passthrough", "off"] if reader == "native" else []
    m = mount_factory(f"s3://{name}", "--block-size", "64K", *mode)
    path = m.path / "shards" / "s0.tar"
    assert _read(path) == data
    if reader == "native":
        m.stop()
        m.start()  # (an object in the memory tier is answered from there, not bound)
    _drop_page_cache()
    files = [open(path, "rb", buffering=0) for _ in range(3)]
    try:
        assert m.metric("cachefs_passthrough_backing_files") == 1
        errors: list[BaseException] = []

        def reader(f: Any) -> None:
            try:
                for off in range(0, len(data), 10_000):
                    assert os.pread(f.fileno(), 10_000, off) == data[off:off + 10_000]
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(f,)) for f in files]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
    finally:
        for f in files:
            f.close()
    assert m.metric("cachefs_passthrough_opens_total") == 3
    assert m.metric("cachefs_passthrough_backing_files") == 1
    if reader == "native":
        s = m.metrics()
        assert s['cachefs_fuse_requests_total{op="read"}'] > 0
        assert not any(v for k, v in s.items() if k.startswith("cachefs_tier_read_bytes_total")), \
            "a bound handle's read reached Python"
        assert m.gets() == 0


def test_a_handle_served_by_the_daemon_keeps_the_inode_out_of_passthrough(shard, mount_factory) -> None:  # type: ignore[no-untyped-def]
    _, name, data = shard
    m = mount_factory(f"s3://{name}", "--block-size", "64K")
    path = m.path / "shards" / "s0.tar"
    with open(path, "rb", buffering=0) as cold:
        assert cold.read() == data  # cached now, and this handle is still open
        with open(path, "rb", buffering=0) as second:  # the kernel would refuse passthrough
            assert second.read() == data
        assert m.metric('cachefs_passthrough_declined_total{reason="open_direct"}') == 1
        assert m.metric("cachefs_passthrough_opens_total") == 0
    for _ in range(100):  # wait for the RELEASE of both handles
        if m.metric("cachefs_open_file_handles") == 0:
            break
        threading.Event().wait(0.05)
    assert _read(path) == data
    assert m.metric("cachefs_passthrough_opens_total") == 1


@pytest.mark.drops_caches
def test_files_fetched_ahead_are_registered_once_they_land(bucket, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """A cold walk in directory order: the files the lookahead fetches are registered by
    the preparing threads when their fetch lands, without reading them back (this daemon
    wrote them from checked bytes), so their opens find a backing ready."""
    name, files = _walk_files(bucket, seed=300, size=30_000)
    m = mount_factory(f"s3://{name}", "--block-size", "64K")
    for key in sorted(files):
        assert _read(m.path / key) == files[key]
    registered = (_counter(m, 'cachefs_passthrough_prepared_total{outcome="registered"}')
                  + _counter(m, 'cachefs_passthrough_prepared_total{outcome="written"}'))
    assert registered >= len(files) // 2, f"only {registered} files registered ahead"
    # Every file was written by this daemon: none was read back to be verified.
    assert _counter(m, "cachefs_cache_objects_trusted_total") >= registered
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 0
    opens = _counter(m, "cachefs_passthrough_opens_total")
    _drop_page_cache()
    for key in sorted(files):  # the next epoch: the registrations serve the opens
        assert _read(m.path / key) == files[key]
    assert _counter(m, "cachefs_passthrough_opens_total") == opens + len(files)


@pytest.mark.drops_caches
@pytest.mark.parametrize("reader", ["kernel", "native"])
def test_files_fetched_ahead_are_registered_by_the_threads_that_wrote_them(bucket, mount_factory, reader) -> None:  # type: ignore[no-untyped-def]
    """A cold walk in directory order: a small file the lookahead fetches is registered
    by the S3 thread that checked and wrote its bytes, from the descriptor it wrote them
    through (no preparing thread, no second open, no index read), with its open template
    -- and every byte the kernel (or the native loop) then reads from the cache file is
    the object's, in this epoch and the next."""
    name, files = _walk_files(bucket, seed=700, size=30_000)
    extra = ("--passthrough", "off") if reader == "native" else ()
    m = mount_factory(f"s3://{name}", "--block-size", "64K", *extra)
    keys = sorted(files)
    for key in keys:
        assert _read(m.path / key) == files[key]
    _wait_for(m, "cachefs_open_file_handles", 0)
    s = m.metrics()
    written = s.get('cachefs_passthrough_prepared_total{outcome="written"}', 0)
    assert written >= len(files) // 2, f"only {written} files registered by their S3 thread"
    # (the preparing threads registered at most the files the walk opened before their
    # fetch was predicted)
    assert s['cachefs_passthrough_prepared_total{outcome="registered"}'] < len(files) // 2
    assert s["cachefs_cache_objects_trusted_total"] >= written
    # (its template ahead: refused for a file the walk had opened before it landed, whose
    # handle the daemon served -- one I/O mode per inode)
    assert s["cachefs_native_open_templates"] > 0
    assert s["cachefs_cache_corrupt_blocks_total"] == 0
    assert m.gets() == len(files)
    for epoch in range(2):  # (the registrations serve the opens, from the files written)
        _drop_page_cache()
        for key in keys:
            assert _read(m.path / key) == files[key], f"epoch {epoch}: {key}"
    _wait_for(m, "cachefs_open_file_handles", 0)
    s = m.metrics()
    assert s["cachefs_cache_corrupt_blocks_total"] == 0
    assert m.gets() == len(files)
    assert s["cachefs_passthrough_opens_total"] >= 2 * len(files)


@pytest.mark.drops_caches
@pytest.mark.parametrize("reader", ["kernel", "native"])
def test_a_cold_walk_is_looked_up_and_opened_without_python(bucket, mount_factory, reader) -> None:  # type: ignore[no-untyped-def]
    """A cold walk in directory order: each file the lookahead fetched is registered with
    an open template once it lands, and the names after the walk's lookups are given to
    the native loop, so the walk's later lookups and opens cost no Python (in a cold
    pass they waited for the interpreter behind the S3 threads) -- and every byte read is
    the object's, each fetched once."""
    name, files = _walk_files(bucket, seed=400, size=20_000)
    extra = ("--passthrough", "off") if reader == "native" else ()
    m = mount_factory(f"s3://{name}", "--block-size", "64K", *extra)
    keys = sorted(files)
    first, rest = keys[:8], keys[8:]
    # The folder's dentry is held (O_PATH: no FUSE open) for the walk: the kernel drops
    # unused dentries whenever anything on the machine writes drop_caches (as this test
    # does below) or reclaims them, and would then look the folder itself up again -- a
    # lookup that is not one of the walk's files, counted with theirs below.
    folder = os.open(m.path / "walk", os.O_PATH | os.O_DIRECTORY)
    try:
        _walk_in_order(m, files, first, rest)
    finally:
        os.close(folder)
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 0
    assert m.gets() == len(files)


def _walk_in_order(m: Any, files: dict[str, bytes], first: list[str], rest: list[str]) -> None:
    """The walk of test_a_cold_walk_is_looked_up_and_opened_without_python."""
    for key in first:  # a walk in order: the lookahead fetches the rest of the folder
        assert _read(m.path / key) == files[key]
    # The files read so far were opened in Python (not cached yet when opened); every
    # one of the rest is registered once it lands, with a template: wait until they are.
    deadline = time.monotonic() + 20
    templates, steady_since = -1.0, time.monotonic()
    while templates < len(rest) or time.monotonic() - steady_since < 0.5:
        assert time.monotonic() < deadline, f"{templates} open templates, not {len(rest)}"
        if (now := m.metric("cachefs_native_open_templates")) != templates:
            templates, steady_since = now, time.monotonic()
        time.sleep(0.05)
    native = {op: f'cachefs_fuse_native_answers_total{{op="{op}"}}' for op in ("lookup", "open")}
    every = {op: f'cachefs_fuse_requests_total{{op="{op}"}}' for op in ("lookup", "open")}
    before = {op: (m.metric(native[op]), m.metric(every[op]) - m.metric(native[op]))
              for op in ("lookup", "open")}
    # (what any process on the machine may do at any time: the walk's lookups and opens
    # are the loop's all the same)
    _drop_page_cache()
    for key in rest:
        assert _read(m.path / key) == files[key]
    _wait_for(m, "cachefs_open_file_handles", 0)
    for op in ("lookup", "open"):
        loop_answered, python_answered = before[op]
        # (one assertion: a failure says whether the requests came, and who answered)
        answered = (m.metric(native[op]) - loop_answered,
                    m.metric(every[op]) - m.metric(native[op]) - python_answered)
        assert answered == (len(rest), 0), \
            f"{op}s of the walk answered (by the loop, by Python): {answered}"


@pytest.mark.drops_caches
def test_passthrough_off(shard, mount_factory) -> None:  # type: ignore[no-untyped-def]
    _, name, data = shard
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--passthrough", "off",
                      "--native-reads", "off")  # (with them: tests/test_native_reads.py)
    path = m.path / "shards" / "s0.tar"
    assert _read(path) == data
    _drop_page_cache()
    before = m.metric("cachefs_read_bytes_total")
    assert _read(path) == data
    assert m.metric("cachefs_passthrough_enabled") == 0
    assert m.metric("cachefs_passthrough_opens_total") == 0
    assert m.metric("cachefs_read_bytes_total") == before + len(data)


@pytest.mark.drops_caches
def test_a_walk_without_passthrough_finds_its_cached_files_in_the_page_cache(bucket, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """A new daemon without passthrough over a warm cache, page cache dropped: the files
    a directory walk will open next have their cache files read into the page cache
    ahead (not loaded into the daemon's memory through the request loop), and every
    byte the workers then read and verify is the object's."""
    name, files = _walk_files(bucket, seed=400, size=20_000)
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--passthrough", "off",
                      "--native-reads", "off")
    for key in sorted(files):
        assert _read(m.path / key) == files[key]
    _wait_for(m, "cachefs_cache_blocks", len(files))
    m.stop()
    m.start()
    _drop_page_cache()
    for key in sorted(files):
        assert _read(m.path / key) == files[key]
    s = m.metrics()
    advised = s['cachefs_disk_readahead_total{outcome="advised"}']
    assert advised >= len(files) // 2, f"only {advised} cache files read ahead"
    assert s.get('cachefs_thread_hops_total{op="cache_read"}', 0) == 0, \
        "cached files were loaded into memory through the request loop"
    assert s['cachefs_tier_read_bytes_total{tier="disk"}'] == sum(len(b) for b in files.values())
    assert s["cachefs_cache_corrupt_blocks_total"] == 0
    assert m.gets() == 0


def test_a_walk_over_files_the_native_loop_reads_leaves_their_cache_files_alone(bucket, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """Without passthrough, files registered with the native loop are read by it (O_DIRECT
    when none of their bytes is in the page cache): a directory walk over them asks
    neither the prefetcher (an index read each) nor the disk readahead about them, whose
    page-cache fill would only turn the loop's direct reads into copies and cost a thread
    of its own. Only files not registered yet are read into the page cache ahead."""
    name, files = _walk_files(bucket, seed=500, size=20_000, n=60)
    # (a memory tier too small to hold the walk's files: they are on local disk only)
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--passthrough", "off",
                      "--memory-budget", "256K")
    for key in sorted(files):
        assert _read(m.path / key) == files[key]
    _wait_for(m, "cachefs_cache_blocks", len(files))
    m.stop()
    m.start()
    for key in sorted(files):  # registered at their opens (and ahead of them)
        assert _read(m.path / key) == files[key]
    registered = m.metric("cachefs_passthrough_backing_files")
    assert registered == len(files), f"only {registered} files registered with the native loop"
    before = m.metrics()
    for key in sorted(files):  # every open answered by the loop
        assert _read(m.path / key) == files[key]
        time.sleep(0.03)  # (the walk is told of the loop's opens in batches, 20 ms apart)
    m.metrics()  # (the loop's opens are told to the walk: its requests ahead follow)
    time.sleep(0.5)
    after = m.metrics()
    opens = 'cachefs_fuse_native_answers_total{op="open"}'
    assert after[opens] - before[opens] >= len(files) - 1
    advised = 'cachefs_disk_readahead_total{outcome="advised"}'
    assert after.get(advised, 0) == before.get(advised, 0), \
        "files the native loop reads were read into the page cache ahead"
    assert after["cachefs_cache_corrupt_blocks_total"] == 0
    assert m.gets() == 0


def test_the_loops_one_read_is_the_kernels_largest_read() -> None:
    """Passthrough.reads_itself steps over registered files the native loop reads in one
    READ: the largest READ the INIT answer lets the kernel send."""
    assert passthrough.LOOP_ONE_READ == abi.MAX_READ


def test_readahead_read_by_the_kernel_counts_as_used(bucket, mount_factory) -> None:  # type: ignore[no-untyped-def]
    client, name = bucket
    files = {f"walk/f{i:03d}.bin": _payload(100 + i, 20_000 + i) for i in range(24)}
    for key, body in files.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    m = mount_factory(f"s3://{name}", "--block-size", "64K")
    for key in sorted(files):  # a directory-order walk: the lookahead fetches ahead
        assert _read(m.path / key) == files[key]
    issued = m.metric('cachefs_prefetch_issued_bytes_total{policy="directory"}')
    assert issued > 0, "the in-order walk was not prefetched"
    assert m.metric('cachefs_prefetch_used_bytes_total{policy="directory"}') == issued, \
        "every prefetched file was read"
    assert m.metric("cachefs_passthrough_opens_total") > 0, "prefetched files were opened cached"


def test_idle_backings_are_bounded_and_a_new_version_is_served(bucket, mount_factory) -> None:  # type: ignore[no-untyped-def]
    client, name = bucket
    a, b = _payload(1, 100_000), _payload(2, 100_000)
    client.put_object(Bucket=name, Key="a.bin", Body=a)
    client.put_object(Bucket=name, Key="b.bin", Body=b)
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--cache-size", "512K",
                      "--memory-budget", "256K", "--metadata-ttl", "0",
                      "--registered-files", "1")
    for i in range(2):
        assert _read(m.path / "a.bin") == a
        assert _read(m.path / "b.bin") == b
        if i == 0:
            # Written to the cache after they were read: an open before that is served
            # by the daemon (not cached whole yet), so wait for all four blocks.
            _wait_for(m, "cachefs_cache_blocks", 4)
    _wait_for(m, "cachefs_open_file_handles", 0)
    assert m.metric("cachefs_passthrough_opens_total") == 2
    assert m.metric("cachefs_passthrough_backing_files") == 1, "a's idle registration was dropped"
    log = (m.cache_dir / "cachefs.log").read_text()
    assert log.count("the most kept (--registered-files)") == 1, "the bound binding is not told once"
    new_a = _payload(3, 90_000)
    client.put_object(Bucket=name, Key="a.bin", Body=new_a)
    # The expired listing is answered at once (one version, whole: the old one) while it is
    # refreshed in the background (stale-while-revalidate); then the new version shows.
    for _ in range(100):
        got = _read(m.path / "a.bin")
        assert got in (a, new_a)
        if got == new_a:
            break
        threading.Event().wait(0.05)
    assert got == new_a
    _wait_for(m, "cachefs_open_file_handles", 0)
    opens = m.metric("cachefs_passthrough_opens_total")
    assert _read(m.path / "a.bin") == new_a  # now cached whole: passed through
    assert m.metric("cachefs_passthrough_opens_total") == opens + 1


@pytest.mark.parametrize("reader", ["kernel", "native"])
def test_idle_registrations_take_no_cache_room_and_go_when_evicted(bucket, mount_factory, reader) -> None:  # type: ignore[no-untyped-def]
    """Idle registrations hold no room in the cache (they used to pin up to a quarter of
    it, and a dataset past that was re-registered, read back, every epoch): every file of
    a dataset the cache holds stays registered. When eviction wants their blocks, the
    registrations are closed and their bytes freed, and every read stays right."""
    client, name = bucket
    first = {f"a/f{i}.bin": _payload(500 + i, 60_000) for i in range(6)}
    later = {f"b/g{i}.bin": _payload(600 + i, 60_000) for i in range(4)}
    for key, body in first.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    extra = ("--passthrough", "off") if reader == "native" else ()
    # Eight blocks; the six files of a/ are three quarters of it.
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--cache-size", "512K",
                      "--cache-policy", "lru", "--memory-budget", "256K",
                      "--metadata-ttl", "0", *extra)
    for key in sorted(first):
        assert _read(m.path / key) == first[key]
    _wait_for(m, "cachefs_open_file_handles", 0)
    _wait_for(m, "cachefs_passthrough_backing_files", 6)
    assert m.metric("cachefs_passthrough_backing_files") == 6, "not every idle file stayed"
    assert m.metric("cachefs_passthrough_yielded_total") == 0
    for key, body in later.items():  # (put only now: no walk fetched them ahead)
        client.put_object(Bucket=name, Key=key, Body=body)
    for key in sorted(later):
        for _ in range(100):  # (an expired listing is answered while it is refreshed)
            if (m.path / key).exists():
                break
            time.sleep(0.05)  # two of a/'s blocks must go to make room
        assert _read(m.path / key) == later[key]
    _wait_for(m, "cachefs_open_file_handles", 0)
    for _ in range(100):
        if m.metric("cachefs_passthrough_yielded_total") >= 2 and m.cache_bytes_on_disk() <= 8 * BLOCK:
            break
        time.sleep(0.05)
    assert m.metric("cachefs_passthrough_yielded_total") >= 2
    assert m.metric("cachefs_passthrough_backing_files") <= 8
    assert m.cache_bytes_on_disk() <= 8 * BLOCK, "evicted bytes still on disk once their registration went"
    for key, body in sorted({**first, **later}.items()):
        assert _read(m.path / key) == body
    assert m.metric("cachefs_cache_corrupt_blocks_total") == 0


def _wait_for(m: Any, metric: str, value: float) -> None:
    """RELEASE reaches the daemon just after close() returns."""
    for _ in range(100):
        if m.metric(metric) == value:
            return
        threading.Event().wait(0.05)


def test_o_direct_opens_of_a_cached_file_read_like_cold_ones(shard, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """An O_DIRECT open of a cached file is served by the daemon: passed through, the
    kernel would open the cache file O_DIRECT too, and a read into an unaligned buffer
    (any Python ``os.pread``) would fail EINVAL where the same read of a cold file works."""
    _, name, data = shard
    m = mount_factory(f"s3://{name}", "--block-size", "64K")
    path = m.path / "shards" / "s0.tar"
    assert _read(path) == data
    # Written to the cache just after they were read: wait for every block, so that the
    # file is cached whole (a plain open would be passed through) when O_DIRECT opens it.
    _wait_for(m, "cachefs_cache_blocks", -(-len(data) // BLOCK))
    read_before = m.metric("cachefs_read_bytes_total")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        for off, size in ((5, 100), (0, 4096), (BLOCK - 3, 10), (len(data) - 10, 100)):
            assert os.pread(fd, size, off) == data[off:off + size]
        # (declined, or -- once its closed cold handle got it registered with an open
        # template -- passed through like its inode but marked direct I/O: either way
        # the daemon answers the reads)
        assert m.metric("cachefs_read_bytes_total") > read_before, "served by the daemon"
        with open(path, "rb", buffering=0) as f:  # a plain open meanwhile: served too
            assert f.read() == data
    finally:
        os.close(fd)
    opens = _counter(m, "cachefs_passthrough_opens_total")
    assert _read(path) == data
    # passed through again, once it is closed
    assert _counter(m, "cachefs_passthrough_opens_total") == opens + 1
    m.stop()


def test_o_direct_opens_of_a_passed_through_inode_read_unaligned(shard, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """While an inode has passed-through handles, the kernel refuses it a handle the
    daemon serves, so an O_DIRECT open is passed through too, but marked direct I/O: its
    reads still come to the daemon, and an unaligned read works as on any other open.
    (The daemon learns of a close only when RELEASE arrives, after close() returned, so a
    close followed by an O_DIRECT open meets this case by chance.)"""
    _, name, data = shard
    m = mount_factory(f"s3://{name}", "--block-size", "64K")
    path = m.path / "shards" / "s0.tar"
    assert _read(path) == data
    _wait_for(m, "cachefs_cache_blocks", -(-len(data) // BLOCK))
    with open(path, "rb", buffering=0) as plain:
        assert plain.read(10) == data[:10]
        assert m.metric("cachefs_passthrough_opens_total") == 1
        read_before = m.metric("cachefs_read_bytes_total")
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            for off, size in ((5, 100), (0, 4096), (BLOCK - 3, 10), (len(data) - 10, 100)):
                assert os.pread(fd, size, off) == data[off:off + size]
        finally:
            os.close(fd)
        assert m.metric("cachefs_read_bytes_total") > read_before, "served by the daemon"
        assert plain.read() == data[10:]
    m.stop()


@pytest.mark.drops_caches
def test_a_file_read_before_it_was_cached_is_registered_once_closed(shard, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """The next epoch's open of a file read cold finds its backing ready: verified and
    registered by a preparing thread once the cold handle closed, not by that open."""
    _, name, data = shard
    m = mount_factory(f"s3://{name}", "--block-size", "64K")
    path = m.path / "shards" / "s0.tar"
    assert _read(path) == data  # not cached when opened: served by the daemon
    _wait_for(m, 'cachefs_passthrough_prepared_total{outcome="registered"}', 1)
    assert m.metric('cachefs_passthrough_prepared_total{outcome="registered"}') == 1
    assert m.metric("cachefs_passthrough_backing_files") == 1
    assert m.metric("cachefs_passthrough_opens_total") == 0
    verified = m.metric("cachefs_passthrough_verified_bytes_total")
    assert verified == len(data), "the preparing thread verified every block"
    read_before = m.metric("cachefs_read_bytes_total")
    _drop_page_cache()
    assert _read(path) == data
    assert m.metric("cachefs_passthrough_opens_total") == 1
    assert m.metric("cachefs_passthrough_verified_bytes_total") == verified, \
        "verified again at the open"
    assert m.metric("cachefs_read_bytes_total") == read_before, "reads reached the daemon"


@pytest.mark.drops_caches
def test_files_a_walk_will_open_are_registered_ahead(bucket, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """A new daemon over a warm cache: files the directory lookahead predicts are
    verified and registered before their open, and every byte read is the object's."""
    name, files = _walk_files(bucket, seed=200, size=20_000)
    m = mount_factory(f"s3://{name}", "--block-size", "64K")
    for key in sorted(files):
        assert _read(m.path / key) == files[key]
    _wait_for(m, "cachefs_cache_blocks", len(files))
    m.stop()
    m.start()  # nothing registered: each file is verified once more before use
    _drop_page_cache()
    for key in sorted(files):
        assert _read(m.path / key) == files[key]
    _wait_for(m, "cachefs_open_file_handles", 0)
    s = m.metrics()
    assert s['cachefs_passthrough_prepared_total{outcome="registered"}'] > 0, \
        "no file was registered ahead of its open"
    assert s["cachefs_passthrough_opens_total"] == len(files)
    assert s["cachefs_passthrough_verified_bytes_total"] == sum(len(b) for b in files.values()), \
        "a file was verified twice (ahead and at its open)"
    assert s["cachefs_cache_hit_bytes_total"] == sum(len(b) for b in files.values())
    assert m.gets() == 0


def test_a_close_registers_a_file_only_into_spare_idle_room(bucket, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """Registering files read in this epoch for the next one never closes an idle
    registration to make room: the second file does not fit beside the first."""
    client, name = bucket
    a, b = _payload(4, 50_000), _payload(5, 50_000)
    client.put_object(Bucket=name, Key="a.bin", Body=a)
    client.put_object(Bucket=name, Key="b.bin", Body=b)
    m = mount_factory(f"s3://{name}", "--block-size", "64K", "--cache-size", "256K",
                      "--registered-files", "1")
    assert _read(m.path / "a.bin") == a
    _wait_for(m, 'cachefs_passthrough_prepared_total{outcome="registered"}', 1)
    assert _read(m.path / "b.bin") == b
    _wait_for(m, 'cachefs_passthrough_prepared_total{outcome="full"}', 1)
    s = m.metrics()
    assert s['cachefs_passthrough_prepared_total{outcome="registered"}'] == 1
    assert s['cachefs_passthrough_prepared_total{outcome="full"}'] == 1
    assert s["cachefs_passthrough_backing_files"] == 1
    before = m.metric("cachefs_passthrough_verified_bytes_total")
    assert _read(m.path / "a.bin") == a  # its registration is still there: no verification
    assert m.metric("cachefs_passthrough_verified_bytes_total") == before
    assert m.metric("cachefs_passthrough_opens_total") == 1


def test_the_mount_line_says_how_cached_files_are_read(shard, mount_factory) -> None:  # type: ignore[no-untyped-def]
    """Without passthrough the C loop reads registered files: the mount's log line said
    'passthrough on' there. It names each way."""
    _, name, _ = shard
    for args, said in ((("--passthrough", "off"), "passthrough off, reads of cached files in C,"),
                       (("--passthrough", "off", "--native-reads", "off"), "passthrough off, up to")):
        m = mount_factory(f"s3://{name}", *args)
        # (the daemon logs the line just after it says it is ready: wait for it)
        deadline = time.monotonic() + 30
        lines: list[str] = []
        while not lines and time.monotonic() < deadline:
            lines = [x for x in m.log().splitlines() if " mounted " in x]
            if not lines:
                time.sleep(0.05)
        assert lines, m.log()
        assert said in lines[0], lines[0]
        m.stop()

"""Unit tests of cachefs.cache.blocks: verified reads, admission policies, persistence, orphans."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from cachefs import failpoints, metrics
from cachefs.cache.blocks import BlockCache, block_id, object_id, split_block_id
from cachefs.cache.lmdbenv import LmdbEnv

BLOCK = 4096
UNIT = 4096  # the allocation unit the caches charge (no more than BLOCK: blocks start on it)


def bid(i: int, etag: str = "etag") -> bytes:
    return block_id("bucket", "key", etag, BLOCK, i)


def data(i: int, n: int = BLOCK) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(n))


def corrupt_count() -> float:
    return metrics.REGISTRY.get_sample_value("cachefs_cache_corrupt_blocks_total") or 0.0


class Cache:
    """A BlockCache in a temporary directory, reopenable; trio calls wrapped in trio.run."""

    def __init__(self, root: Path, capacity: int, policy: str = "keep") -> None:
        self.root = root
        self.capacity = capacity
        self.policy = policy
        root.mkdir(parents=True, exist_ok=True)
        self.env = LmdbEnv(root / "meta.lmdb")
        self.cache = BlockCache(self.env, root, capacity=capacity, policy=policy,
                                unit=UNIT)

    def put(self, b: bytes, d: bytes) -> bool:
        return trio.run(self.cache.put, b, d)

    def get(self, b: bytes) -> bytes | None:
        return trio.run(self.cache.get, b)

    def touch_flush(self) -> None:
        self.cache.flush_touches(self.cache.take_touches())

    def reopen(self) -> None:
        self.env.close()
        self.env = LmdbEnv(self.root / "meta.lmdb")
        self.cache = BlockCache(self.env, self.root, capacity=self.capacity, policy=self.policy,
                                unit=UNIT)

    def files(self) -> list[Path]:
        return sorted(p for p in self.cache.objects_dir.rglob("*") if p.is_file())

    def stored(self, b: bytes, n: int = BLOCK) -> bytes:
        """The bytes at block ``b``'s place in its object file (b"" without a file)."""
        path, offset = self.cache.location(b)
        if not os.path.exists(path):
            return b""
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(n)

    def damage(self, b: bytes, at: int) -> None:
        path, offset = self.cache.location(b)
        with open(path, "r+b") as f:
            f.seek(offset + at)
            byte = f.read(1)
            f.seek(offset + at)
            f.write(bytes([byte[0] ^ 0x01]))

    def allocated(self) -> int:
        return sum(p.stat().st_blocks * 512 for p in self.files())


@pytest.fixture
def make_cache(tmp_path: Path) -> Iterator[type[Cache]]:
    made: list[Cache] = []

    def factory(capacity: int = 10 * BLOCK, policy: str = "keep") -> Cache:
        c = Cache(tmp_path / f"cache{len(made)}", capacity, policy)
        made.append(c)
        return c

    yield factory  # type: ignore[misc]
    for c in made:
        c.env.close()


def test_block_id_depends_on_every_component() -> None:
    base = block_id("b", "k", "e", 4096, 0)
    assert len(base) == 24
    assert base == block_id("b", "k", "e", 4096, 0)
    others = {block_id("b2", "k", "e", 4096, 0), block_id("b", "k2", "e", 4096, 0),
              block_id("b", "k", "e2", 4096, 0), block_id("b", "k", "e", 8192, 0),
              block_id("b", "k", "e", 4096, 1)}
    assert base not in others and len(others) == 5


def test_an_object_id_remembered_is_the_one_hashed_and_the_memory_is_bounded() -> None:
    """Object ids are remembered (the trio thread asked for a cold file's ~7.6 times): a
    remembered id is the hash of its version, ids of versions pushed out are hashed again
    the same, and at most OID_CACHE are kept."""
    import xxhash

    from cachefs.cache import blockid

    def hashed(key: str) -> bytes:
        return xxhash.xxh3_128_digest(f"b\0{key}\0e\0{4096}".encode())

    first = object_id("b", "k0", "e", 4096)
    assert first == hashed("k0") and object_id("b", "k0", "e", 4096) is first
    for i in range(blockid.OID_CACHE + 10):
        assert object_id("b", f"k{i}", "e", 4096) == hashed(f"k{i}")
    assert object_id("b", "k0", "e", 4096) == first  # pushed out, hashed again
    assert blockid.object_id.cache_info().currsize <= blockid.OID_CACHE


def test_blocks_of_one_object_share_its_file_at_their_offsets() -> None:
    b3 = block_id("b", "k", "e", 4096, 3)
    assert split_block_id(b3) == (object_id("b", "k", "e", 4096), 3 * 4096)
    assert split_block_id(block_id("b", "k", "e", 8192, 3))[0] != object_id("b", "k", "e", 4096)
    # ids sort by object, then offset: an object's blocks are adjacent in the index
    ids = [block_id("b", k, "e", 4096, i) for k in ("k1", "k2") for i in (0, 1, 256, 70000)]
    assert sorted(ids) == sorted(ids, key=lambda b: (b[:16], split_block_id(b)[1]))


def test_put_get_round_trip(make_cache) -> None:  # type: ignore[no-untyped-def]
    c = make_cache()
    assert c.get(bid(0)) is None
    assert c.put(bid(0), data(0))
    assert c.put(bid(1), data(1, 10))
    assert c.get(bid(0)) == data(0)
    assert c.get(bid(1)) == data(1, 10)
    assert c.cache.contains(bid(0)) and c.cache.length_of(bid(1)) == 10
    assert c.cache.used == BLOCK + UNIT and c.cache.block_count == 2, "10 bytes take a unit"
    assert c.stored(bid(0)) == data(0) and c.stored(bid(1), 10) == data(1, 10)
    assert len(c.files()) == 1, "the blocks of one object share one file"
    # Putting the same block again is a no-op that reports success.
    assert c.put(bid(0), data(0))
    assert c.cache.used == BLOCK + UNIT and c.cache.block_count == 2


def test_put_now_of_a_block_stored_meanwhile_keeps_it(make_cache) -> None:  # type: ignore[no-untyped-def]
    """put_now does not ask the index first (its caller just found the block missing): the
    second answer of a hedged GET stores the same bytes again, and nothing changes."""
    c = make_cache()
    reads = metrics.LMDB_TRANSACTIONS.counters["read"]
    before = reads.value
    assert c.cache.put_now(bid(0), data(0))
    assert reads.value == before  # no read transaction of its own
    assert c.cache.put_now(bid(0), data(0))  # stored meanwhile: admitted, counted once
    assert c.cache.used == BLOCK and c.cache.block_count == 1
    assert c.get(bid(0)) == data(0) and c.stored(bid(0)) == data(0)
    full = make_cache(capacity=BLOCK)  # keep policy, full: a block stored already stays
    assert full.cache.put_now(bid(0), data(0)) and full.cache.put_now(bid(0), data(0))
    assert full.get(bid(0)) == data(0) and full.cache.used == BLOCK


def test_flipped_byte_is_detected_counted_and_dropped(make_cache) -> None:  # type: ignore[no-untyped-def]
    c = make_cache()
    assert c.put(bid(0), data(0))
    assert c.put(bid(1), data(1))
    c.damage(bid(0), 123)
    before = corrupt_count()
    assert c.get(bid(0)) is None
    assert corrupt_count() == before + 1
    assert not c.cache.contains(bid(0))
    assert c.stored(bid(0)) == bytes(BLOCK), "the dropped block's bytes are punched out"
    assert c.cache.used == BLOCK and c.cache.block_count == 1
    # The entry is gone: the next lookup is a plain miss, not another corruption.
    assert c.get(bid(0)) is None
    assert corrupt_count() == before + 1
    assert c.get(bid(1)) == data(1)
    # It can be stored again.
    assert c.put(bid(0), data(0)) and c.get(bid(0)) == data(0)


@pytest.mark.parametrize("damage", ["truncate", "zeroed"])
def test_short_or_lost_bytes_are_corrupt(make_cache, damage: str) -> None:  # type: ignore[no-untyped-def]
    c = make_cache()
    assert c.put(bid(0), data(0))
    path = Path(c.cache.location(bid(0))[0])
    if damage == "truncate":
        os.truncate(path, BLOCK - 1)
    else:
        path.write_bytes(bytes(BLOCK))
    before = corrupt_count()
    assert c.get(bid(0)) is None
    assert corrupt_count() == before + 1
    assert not c.cache.contains(bid(0)) and c.cache.used == 0


def test_missing_block_file_is_a_miss(make_cache) -> None:  # type: ignore[no-untyped-def]
    c = make_cache()
    assert c.put(bid(0), data(0))
    os.unlink(c.cache.location(bid(0))[0])
    assert c.get(bid(0)) is None
    assert not c.cache.contains(bid(0))
    assert c.cache.used == 0 and c.cache.block_count == 0


def test_a_cache_whose_objects_directory_was_removed_stores_blocks_again(make_cache, cache_writes: str) -> None:  # type: ignore[no-untyped-def]
    """The objects directory removed under a running daemon (an operator freeing space, a
    cleaner of old files under /var/tmp once the cache was empty): every later block
    failed to be written ('No such file or directory'), was served from memory and S3
    only, and warm called the cache full, until a restart. The directory is made again."""
    import shutil

    c = make_cache()
    assert c.put(bid(0), data(0))
    shutil.rmtree(c.cache.objects_dir)
    assert c.get(bid(0)) is None  # (a miss, fetched again)
    assert c.put(bid(1), data(1))
    assert c.get(bid(1)) == data(1)
    assert c.put(bid(0), data(0))
    assert c.get(bid(0)) == data(0)
    assert (c.cache.objects_dir.stat().st_mode & 0o777) == 0o700


def test_keep_policy_rejects_when_full_and_keeps_old_blocks(make_cache) -> None:  # type: ignore[no-untyped-def]
    c = make_cache(capacity=3 * BLOCK, policy="keep")
    rejects = metrics.REGISTRY.get_sample_value("cachefs_cache_admission_rejected_total") or 0.0
    for i in range(3):
        assert c.put(bid(i), data(i))
    assert not c.put(bid(3), data(3))
    assert not c.put(bid(4), data(4, 1))
    assert (metrics.REGISTRY.get_sample_value("cachefs_cache_admission_rejected_total") or 0.0) >= rejects + 2
    for i in range(3):
        assert c.get(bid(i)) == data(i)
    assert not c.cache.contains(bid(3)) and not c.stored(bid(3)).strip(b"\0")
    assert c.cache.used == 3 * BLOCK and c.cache.block_count == 3
    assert c.allocated() <= 3 * BLOCK, "a rejected block leaves no bytes behind"


def test_keep_policy_rejection_inside_the_index_transaction(make_cache) -> None:  # type: ignore[no-untyped-def]
    # put_sync skips put()'s fast check (as when two puts race): the index still refuses.
    c = make_cache(capacity=2 * BLOCK, policy="keep")
    assert c.cache.put_sync(bid(0), data(0))
    assert c.cache.put_sync(bid(1), data(1))
    assert not c.cache.put_sync(bid(2), data(2))
    assert not c.stored(bid(2)).strip(b"\0")
    assert c.cache.used == 2 * BLOCK


def test_block_larger_than_capacity_is_rejected(make_cache) -> None:  # type: ignore[no-untyped-def]
    c = make_cache(capacity=BLOCK, policy="lru")
    assert not c.put(bid(0), data(0, BLOCK + 1))
    assert c.cache.used == 0 and c.files() == []


def test_lru_evicts_least_recently_used(make_cache) -> None:  # type: ignore[no-untyped-def]
    c = make_cache(capacity=3 * BLOCK, policy="lru")
    evictions = metrics.REGISTRY.get_sample_value("cachefs_cache_evictions_total") or 0.0
    for i in range(3):
        assert c.put(bid(i), data(i))
        time.sleep(0.002)
    assert c.get(bid(0)) == data(0)  # 0 is now the most recently used
    c.touch_flush()
    assert c.put(bid(3), data(3))
    assert not c.cache.contains(bid(1)), "block 1 was least recently used"
    assert c.stored(bid(1)) == bytes(BLOCK), "its bytes are punched out"
    assert all(c.cache.contains(bid(i)) for i in (0, 2, 3))
    assert c.cache.used == 3 * BLOCK and c.cache.block_count == 3
    assert (metrics.REGISTRY.get_sample_value("cachefs_cache_evictions_total") or 0.0) == evictions + 1
    time.sleep(0.002)
    assert c.get(bid(2)) == data(2)
    c.touch_flush()
    assert c.put(bid(4), data(4))
    assert not c.cache.contains(bid(0))
    assert {i for i in range(5) if c.cache.contains(bid(i))} == {2, 3, 4}


def test_lru_never_exceeds_capacity(make_cache) -> None:  # type: ignore[no-untyped-def]
    c = make_cache(capacity=5 * BLOCK, policy="lru")
    sizes = [BLOCK, 300, 700, BLOCK, 50, 999, BLOCK, 400, 10, BLOCK, 600, 800] * 3
    for i, n in enumerate(sizes):
        assert c.put(bid(i), data(i, n))
        assert c.cache.used <= c.capacity
        # each block takes at most its page: evicted blocks' bytes are freed
        assert c.allocated() <= BLOCK * c.cache.block_count
        indexed = sum(c.cache.charge(c.cache.length_of(bid(j)) or 0) for j in range(i + 1))
        assert indexed == c.cache.used
        if i % 4 == 0:
            c.get(bid(i // 2))
            c.touch_flush()
    assert c.cache.contains(bid(len(sizes) - 1))


def test_used_bytes_and_count_persist_across_reopen(make_cache) -> None:  # type: ignore[no-untyped-def]
    c = make_cache(capacity=10 * BLOCK)
    for i in range(4):
        assert c.put(bid(i), data(i, 100 * (i + 1)))
    c.reopen()
    assert c.cache.used == 4 * UNIT and c.cache.block_count == 4
    assert metrics.REGISTRY.get_sample_value("cachefs_cache_used_bytes") == 4 * UNIT
    assert c.get(bid(3)) == data(3, 400)
    assert c.put(bid(9), data(9, 10))
    assert c.cache.used == 5 * UNIT


def tiny_bid(i: int) -> bytes:
    """Block 0 of object ``t{i}``: each in a file of its own."""
    return block_id("bucket", f"t{i}", "etag", BLOCK, 0)


@pytest.mark.parametrize("policy", ["keep", "lru"])
def test_tiny_blocks_are_charged_their_disk_allocation(make_cache, policy: str) -> None:  # type: ignore[no-untyped-def]
    """The capacity bounds the disk the cache files take: a block of a few bytes takes a
    whole file-system block, and is charged that, not its length."""
    c = make_cache(capacity=8 * BLOCK, policy=policy)
    for i in range(40):
        n = 10 + 37 * i
        admitted = c.put(tiny_bid(i), data(i, n))
        assert admitted or policy == "keep"
        assert c.allocated() <= c.cache.used <= c.capacity
    assert c.cache.used > c.capacity // 2
    assert metrics.REGISTRY.get_sample_value("cachefs_cache_used_bytes") == c.cache.used


def test_used_bytes_of_block_lengths_are_recounted_at_start(make_cache) -> None:  # type: ignore[no-untyped-def]
    """An index whose used bytes summed block lengths (an earlier version's accounting, no
    ``used_unit`` key) is recounted at start: the total never stays of the old kind."""
    c = make_cache(capacity=100 * BLOCK)
    lengths = [10, 4096, 5000, 1]
    for i, n in enumerate(lengths):
        assert c.put(tiny_bid(i), data(i, n))
    charged = c.cache.used
    assert charged == sum(-(-n // UNIT) * UNIT for n in lengths) == 5 * UNIT
    with c.env.write() as txn:  # what an earlier version left
        meta = c.env.db("meta")
        txn.delete(b"used_unit", db=meta)
        txn.put(b"used_bytes", str(sum(lengths)).encode(), db=meta)
    c.reopen()
    assert c.cache.used == charged and c.cache.block_count == len(lengths)
    assert c.get(tiny_bid(2)) == data(2, 5000), "the true length is kept for reads"
    c.cache.drop([tiny_bid(0)])
    assert c.cache.used == charged - UNIT
    # A cache directory moved to a file system of another unit is recounted in it.
    c.env.close()
    c.env = LmdbEnv(c.root / "meta.lmdb")
    c.cache = BlockCache(c.env, c.root, capacity=c.capacity, unit=4 * UNIT)
    assert c.cache.used == 3 * 4 * UNIT and c.cache.block_count == 3


def test_remove_orphans(make_cache) -> None:  # type: ignore[no-untyped-def]
    c = make_cache()
    assert c.put(bid(0), data(0))
    indexed = Path(c.cache.location(bid(0))[0])
    old = time.time() - 3600
    orphan = Path(c.cache.location(bid(0, etag="gone"))[0])
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"orphan")
    junk = c.cache.objects_dir / "zz" / "not-hex"
    junk.parent.mkdir()
    junk.write_bytes(b"junk")
    legacy = c.root / "blocks" / "ab" / ("ab" * 16)
    legacy.parent.mkdir(parents=True)
    legacy.write_bytes(b"a block of the one-file-per-block layout")
    for p in (orphan, junk, indexed):
        os.utime(p, (old, old))
    young_orphan = Path(c.cache.location(bid(0, etag="being-put"))[0])
    young_orphan.parent.mkdir(exist_ok=True)
    young_orphan.write_bytes(b"being put")

    cutoff = time.time() - 60
    assert c.cache.remove_orphans(cutoff) == 3
    assert not orphan.exists() and not junk.exists() and not (c.root / "blocks").exists()
    assert indexed.exists() and young_orphan.exists()
    assert c.get(bid(0)) == data(0)
    assert c.cache.remove_orphans(cutoff) == 0


def test_an_index_of_the_older_layout_is_dropped(make_cache) -> None:  # type: ignore[no-untyped-def]
    c = make_cache()
    assert c.put(bid(0), data(0))
    with c.env.write() as txn:  # as an earlier version left it: no layout mark
        txn.delete(b"layout", db=c.env.db("meta"))
    c.reopen()
    assert c.cache.used == 0 and c.cache.block_count == 0 and not c.cache.contains(bid(0))
    assert c.put(bid(0), data(0)) and c.get(bid(0)) == data(0)
    c.reopen()
    assert c.cache.block_count == 1, "the current layout is kept"


def test_write_failure_returns_false(make_cache) -> None:  # type: ignore[no-untyped-def]
    c = make_cache()
    errors = metrics.REGISTRY.get_sample_value("cachefs_cache_write_errors_total") or 0.0
    path = Path(c.cache.location(bid(0))[0])
    path.parent.mkdir()
    path.mkdir()  # the object file's name is taken by a directory
    assert c.put(bid(0), data(0)) is False
    assert (metrics.REGISTRY.get_sample_value("cachefs_cache_write_errors_total") or 0.0) == errors + 1
    assert not c.cache.contains(bid(0)) and c.cache.used == 0
    assert c.get(bid(0)) is None


@pytest.fixture(params=["native", "python"])
def cache_writes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each cache-file write path: the C one (cachefs/cache/_cachefile.c) and Python's."""
    from cachefs.cache import objectfiles

    if request.param == "python":
        monkeypatch.setattr(objectfiles, "_cachefile", None)
    elif not objectfiles.NATIVE_WRITES:
        assert not os.environ.get("CI"), "the cache-file extension was not built"
        pytest.skip("built without the cache-file extension")
    return str(request.param)


def test_disk_full_returns_false_and_frees_the_block(make_cache, cache_writes: str) -> None:  # type: ignore[no-untyped-def]
    import resource

    c = make_cache()
    assert c.put(bid(0), data(0))
    # A real torn write: the file-size limit lets 100 bytes of block 1 through, then the
    # next write fails (EFBIG; Python ignores SIGXFSZ), as a filling disk does with ENOSPC.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (BLOCK + 100, hard))
    try:
        stored = c.put(bid(1), data(1))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert stored is False
    assert not c.cache.contains(bid(1)) and not c.stored(bid(1)).strip(b"\0")
    assert c.get(bid(0)) == data(0)


def test_a_cache_file_is_written_at_its_offset_in_a_private_directory(make_cache, cache_writes: str) -> None:  # type: ignore[no-untyped-def]
    c = make_cache()
    assert c.put(bid(2), data(2))  # the object's file and its directory are made here
    path = Path(c.cache.location(bid(2))[0])
    assert c.stored(bid(2)) == data(2) and c.stored(bid(0)) == bytes(BLOCK)
    assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    oid = object_id("bucket", "key", "etag", BLOCK)
    before = path.stat()
    inode, was, now = c.cache.files.write_at(oid, memoryview(b"xy"), 1)
    after = path.stat()
    # (the file's inode, and its change times just before and after the write)
    assert (inode, was, now) == (after.st_ino, before.st_ctime_ns, after.st_ctime_ns)
    assert now != was
    assert c.stored(bid(0), 3) == b"\0xy"
    # A failure is the failing call's OSError, naming the file.
    other = next(o for o in (object_id("bucket", "key", f"e{i}", BLOCK) for i in range(1000))
                 if not Path(c.cache.files.path(o)).parent.exists())
    Path(c.cache.files.path(other)).parent.write_bytes(b"")  # its directory's name is a file
    with pytest.raises(NotADirectoryError) as caught:
        c.cache.files.write_at(other, b"x", 0)
    assert caught.value.filename == c.cache.files.path(other)
    with pytest.raises(NotADirectoryError):
        c.cache.files.write_kept(other, b"x", 0)


def test_a_kept_write_leaves_the_file_written_open(make_cache, cache_writes: str) -> None:  # type: ignore[no-untyped-def]
    """write_kept (the S3 thread that registers the file it wrote, cachefs.passthrough):
    the same write, its file left open read-write -- the very file, made private as any."""
    c = make_cache()
    oid = object_id("bucket", "key", "etag", BLOCK)
    inode, was, now, fd = c.cache.files.write_kept(oid, memoryview(b"abc"), 2)
    try:
        path = Path(c.cache.files.path(oid))
        assert os.fstat(fd).st_ino == inode == path.stat().st_ino
        assert now == path.stat().st_ctime_ns and was <= now
        assert os.pread(fd, 8, 0) == b"\0\0abc"
        assert os.get_inheritable(fd) is False
        assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    finally:
        os.close(fd)
    # put_kept: written and indexed (and marked), the descriptor the caller's
    c.cache.pin(oid)
    kept = c.cache.put_kept(bid(0), data(0))
    assert kept is not None
    fd, stamp = kept
    try:
        assert os.pread(fd, BLOCK, 0) == data(0)
        assert stamp == (os.fstat(fd).st_ino, os.fstat(fd).st_ctime_ns), "the file as written"
        assert c.cache.contains(bid(0)) and c.cache.written_blocks(oid) == 1
    finally:
        os.close(fd)
        c.cache.unpin(oid)
    assert c.get(bid(0)) == data(0)


def test_index_failure_returns_false_and_removes_file(make_cache, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from cachefs.errors import CacheError

    c = make_cache()

    def full(*args: object) -> tuple[bool, list[bytes]]:
        raise CacheError("cache metadata is full")

    monkeypatch.setattr(c.cache, "_index_put", full)
    assert c.put(bid(0), data(0)) is False
    assert not os.path.exists(c.cache.location(bid(0))[0]), "no block of the object is indexed"
    assert c.cache.used == 0


def test_unknown_policy_is_rejected(tmp_path: Path) -> None:
    env = LmdbEnv(tmp_path / "meta.lmdb")
    try:
        with pytest.raises(ValueError):
            BlockCache(env, tmp_path, capacity=BLOCK, policy="fifo")
    finally:
        env.close()


def test_lru_never_evicts_a_pinned_object(make_cache) -> None:  # type: ignore[no-untyped-def]
    c = make_cache(capacity=3 * BLOCK, policy="lru")
    pinned = [block_id("bucket", "pinned", "e", BLOCK, i) for i in range(2)]
    for b in pinned:
        assert c.put(b, data(1))
        time.sleep(0.002)
    oid = object_id("bucket", "pinned", "e", BLOCK)
    c.cache.pin(oid)
    assert c.put(bid(0), data(0))
    time.sleep(0.002)
    assert c.put(bid(1), data(1)), "the unpinned block 0 makes room"
    assert not c.cache.contains(bid(0))
    other = object_id("bucket", "key", "etag", BLOCK)  # the object of bid(i)
    c.cache.pin(other)
    assert not c.put(bid(2), data(2)), "only pinned blocks are left: not admitted"
    assert all(c.cache.contains(b) for b in pinned) and c.cache.contains(bid(1))
    assert c.cache.verify_object(pinned) == 2 * BLOCK
    c.cache.unpin(other)
    c.cache.unpin(oid)
    assert c.put(bid(2), data(2))
    assert not c.cache.contains(pinned[0]), "unpinned, the oldest goes first"


def test_a_yielding_pin_lets_eviction_choose_and_keeps_the_bytes_until_the_unpin(make_cache) -> None:  # type: ignore[no-untyped-def]
    """An idle registration's pin: eviction may drop the object's blocks from the index
    (the holder is told, once, outside the cache's locks), but their bytes stay in the
    file, right, until the last unpin; turned back into a plain pin it keeps eviction
    away again."""
    c = make_cache(capacity=3 * BLOCK, policy="lru")
    held = [block_id("bucket", "held", "e", BLOCK, i) for i in range(2)]
    for i, b in enumerate(held):
        assert c.put(b, data(10 + i))
        time.sleep(0.002)
    oid = object_id("bucket", "held", "e", BLOCK)
    told: list[list[bytes]] = []

    def on_yielded(oids: list[bytes]) -> None:
        assert not c.cache._lock.locked(), "told under the cache's lock"
        told.append(oids)

    c.cache.on_evicted_while_pinned = on_yielded
    c.cache.pin(oid)
    c.cache.convert_pin(oid, yielding=True)  # (as a registration going idle does)
    assert c.put(bid(0), data(0))
    time.sleep(0.002)
    assert c.put(bid(1), data(1)), "the held object's oldest block makes room"
    assert not c.cache.contains(held[0])
    assert told == [[oid]]
    path = c.cache.object_path(oid)
    with open(path, "rb") as f:
        assert f.read(BLOCK) == data(10), "its bytes are kept while the pin lasts"
    assert c.cache.deferred_bytes == BLOCK
    c.cache.convert_pin(oid, yielding=False)  # (in use again)
    time.sleep(0.002)
    assert c.put(bid(2), data(2))
    assert c.cache.contains(held[1]), "a plain pin keeps eviction away"
    assert not c.cache.contains(bid(0))
    assert told == [[oid]], "nothing more was evicted"
    c.cache.unpin(oid)
    c.cache.flush_touches({})
    assert c.cache.deferred_bytes == 0
    with open(path, "rb") as f:
        assert f.read(BLOCK) == bytes(BLOCK), "released at the unpin: a hole"
        assert f.read(BLOCK) == data(11)


def test_a_pin_taken_while_an_eviction_is_decided_is_told_of_it(make_cache) -> None:  # type: ignore[no-untyped-def]
    """A plain pin taken after eviction chose an object's blocks (a registration whose
    verification read them before the eviction committed) defers their release like any
    pin, and its holder is told too: otherwise the registration would never learn that
    its bytes are no longer the cache's, and would hold them beyond the cache's size
    until some bound closed it."""
    c = make_cache(capacity=2 * BLOCK, policy="lru")
    victim = block_id("bucket", "victim", "e", BLOCK, 0)
    assert c.put(victim, data(10))
    time.sleep(0.002)
    assert c.put(bid(0), data(0))
    oid = object_id("bucket", "victim", "e", BLOCK)
    told: list[list[bytes]] = []
    c.cache.on_evicted_while_pinned = told.append
    # The pin lands between the eviction's commit and the release of the bytes.
    failpoints.arm("evict.release", lambda: c.cache.pin(oid))
    try:
        assert c.put(bid(1), data(1)), "the victim makes room"
    finally:
        failpoints.disarm("evict.release")
    assert not c.cache.contains(victim)
    assert c.cache.deferred_bytes == BLOCK, "the pin keeps the bytes"
    assert told == [[oid]], "the pin's holder was not told its blocks were evicted"
    c.cache.unpin(oid)
    c.cache.flush_touches({})
    assert c.cache.deferred_bytes == 0


def test_lru_gives_blocks_fetched_ahead_and_unread_a_second_chance(make_cache) -> None:  # type: ignore[no-untyped-def]
    """A block fetched ahead that no reader took yet is not evicted as the least recently
    used: evicting it would fetch it twice (a sweep fills free space early in an epoch,
    its reader comes later). Once read it ages like any other; and when only unread
    blocks are left, the oldest goes rather than refusing the new one."""
    c = make_cache(capacity=3 * BLOCK, policy="lru")
    unread = {bid(0)}
    c.cache.is_unread = lambda b: b in unread
    for i in range(3):
        assert c.put(bid(i), data(i))
        time.sleep(0.002)
    assert c.put(bid(3), data(3))
    assert c.cache.contains(bid(0)), "the unread block fetched ahead was evicted"
    assert not c.cache.contains(bid(1))
    unread.clear()  # read now; it was made most recently used when spared
    time.sleep(0.002)
    assert c.put(bid(4), data(4))
    assert not c.cache.contains(bid(2)) and c.cache.contains(bid(0))
    unread.update({bid(0), bid(3), bid(4)})  # nothing else left to take
    time.sleep(0.002)
    assert c.put(bid(5), data(5)), "refused while unread blocks could make room"
    assert c.cache.contains(bid(4)) and c.cache.contains(bid(5))
    assert [c.cache.contains(bid(i)) for i in (0, 3)].count(True) == 1, "not one evicted"
    assert c.cache.used == 3 * BLOCK


def test_verify_object_checks_every_block(make_cache) -> None:  # type: ignore[no-untyped-def]
    c = make_cache()
    blocks = [block_id("bucket", "obj", "e", BLOCK, i) for i in range(3)]
    for i, b in enumerate(blocks):
        assert c.put(b, data(i, BLOCK if i < 2 else 100))
    assert c.cache.verify_object(blocks) == 2 * BLOCK + 100
    assert c.cache.verify_object([*blocks, block_id("bucket", "obj", "e", BLOCK, 3)]) is None
    c.damage(blocks[1], 5)
    before = corrupt_count()
    assert c.cache.verify_object(blocks) is None
    assert corrupt_count() == before + 1 and not c.cache.contains(blocks[1])


def trusted_count() -> float:
    return metrics.REGISTRY.get_sample_value("cachefs_cache_objects_trusted_total") or 0.0


def _verify_with_fd(c: Cache, blocks: list[bytes]) -> int | None:
    """verify_object as passthrough calls it: pinned, through an open descriptor."""
    oid = split_block_id(blocks[0])[0]
    c.cache.pin(oid)
    try:
        fd = os.open(c.cache.object_path(oid), os.O_RDONLY)
        try:
            return c.cache.verify_object(blocks, fd)
        finally:
            os.close(fd)
    finally:
        c.cache.unpin(oid)


def test_an_object_this_cache_wrote_is_verified_without_reading_it_back(make_cache) -> None:  # type: ignore[no-untyped-def]
    c = make_cache()
    blocks = [block_id("bucket", "obj", "e", BLOCK, i) for i in range(3)]
    for i, b in enumerate(blocks):
        assert c.put(b, data(i, BLOCK if i < 2 else 100))
    # Written marks are trusted (the file is not read back): a trusted object, nothing read.
    trusted, corrupt = trusted_count(), corrupt_count()
    assert _verify_with_fd(c, blocks) == 2 * BLOCK + 100
    assert trusted_count() == trusted + 1 and corrupt_count() == corrupt
    # Damage behind the cache's back, in the same life, changed the file's stamp: the
    # marks are void and the check reads every block, and finds it...
    c.damage(blocks[1], 5)
    assert _verify_with_fd(c, blocks) is None
    assert trusted_count() == trusted + 1 and corrupt_count() == corrupt + 1
    # ...and once the block is written again (the cache's own write: its mark carries
    # the file's stamp again, but the other blocks' marks went with the damage) the
    # next check reads the object back, finds it right, and the one after trusts it.
    assert c.put(blocks[1], data(1))
    assert _verify_with_fd(c, blocks) == 2 * BLOCK + 100
    assert trusted_count() == trusted + 1 and corrupt_count() == corrupt + 1
    assert _verify_with_fd(c, blocks) == 2 * BLOCK + 100  # (read back: marked as checked)
    assert trusted_count() == trusted + 2
    # A new daemon (the marks live in memory only) reads every block again.
    c.damage(blocks[0], 7)
    c.reopen()
    assert _verify_with_fd(c, blocks) is None
    assert trusted_count() == trusted + 2 and corrupt_count() == corrupt + 2


def test_without_read_back_only_an_object_this_cache_wrote_is_verified(make_cache) -> None:  # type: ignore[no-untyped-def]
    """What a passthrough open of an object too large to read back at its open checks:
    the written marks, and nothing is read (a damaged block is not found, nor dropped)."""
    c = make_cache()
    blocks = [block_id("bucket", "obj", "e", BLOCK, i) for i in range(2)]
    for i, b in enumerate(blocks):
        assert c.put(b, data(i))
    oid = split_block_id(blocks[0])[0]

    def verify() -> int | None:
        c.cache.pin(oid)
        try:
            fd = os.open(c.cache.object_path(oid), os.O_RDONLY)
            try:
                return c.cache.verify_object(blocks, fd, read_back=False)
            finally:
                os.close(fd)
        finally:
            c.cache.unpin(oid)

    assert verify() == 2 * BLOCK  # written in this life: trusted
    c.reopen()  # (a new daemon: no marks)
    c.damage(blocks[1], 3)
    corrupt = corrupt_count()
    assert verify() is None  # would have to be read: not verified
    assert corrupt_count() == corrupt and c.cache.contains(blocks[1]), "it was read"


def test_an_object_read_back_whole_is_not_read_back_again_in_the_same_life(make_cache) -> None:  # type: ignore[no-untyped-def]
    """A registration dropped for the bounds (more files per node than it keeps) is made
    again at the next open: the object it read back and found right is marked as if
    written here, so that open costs no second read of it, until a release of its bytes
    ends the trust (as for written marks)."""
    c = make_cache()
    blocks = [block_id("bucket", "obj", "e", BLOCK, i) for i in range(2)]
    for i, b in enumerate(blocks):
        assert c.put(b, data(i))
    c.reopen()  # (a new daemon: no written marks)
    trusted, corrupt = trusted_count(), corrupt_count()
    assert _verify_with_fd(c, blocks) == 2 * BLOCK  # read back whole, found right
    assert trusted_count() == trusted
    assert _verify_with_fd(c, blocks) == 2 * BLOCK
    assert trusted_count() == trusted + 1, "read back a second time"
    c.cache.drop([blocks[0]])  # a release: the marks go
    assert c.put(blocks[0], data(0))
    c.damage(blocks[1], 3)
    assert _verify_with_fd(c, blocks) is None, "a block released since was trusted"
    assert corrupt_count() == corrupt + 1
    # Without a descriptor (no pin: a daemon-side check) nothing is marked.
    c.reopen()
    assert c.put(blocks[1], data(1))
    c.reopen()
    assert c.cache.verify_object(blocks) == 2 * BLOCK
    c.damage(blocks[0], 4)
    assert _verify_with_fd(c, blocks) is None


def test_a_release_of_an_objects_bytes_ends_the_trust_in_it(make_cache) -> None:  # type: ignore[no-untyped-def]
    c = make_cache()
    blocks = [block_id("bucket", "obj", "e", BLOCK, i) for i in range(2)]
    for i, b in enumerate(blocks):
        assert c.put(b, data(i))
    c.cache.drop([blocks[0]])  # a punched block: the object's marks are dropped
    assert c.put(blocks[0], data(0))  # stored again: only its own mark is back
    c.damage(blocks[1], 3)
    corrupt = corrupt_count()
    assert _verify_with_fd(c, blocks) is None, "a block not re-written was trusted"
    assert corrupt_count() == corrupt + 1


def test_a_descriptor_of_a_replaced_file_is_not_trusted(make_cache) -> None:  # type: ignore[no-untyped-def]
    c = make_cache()
    b = block_id("bucket", "obj", "e", BLOCK, 0)
    assert c.put(b, data(0))
    oid = split_block_id(b)[0]
    c.cache.pin(oid)
    try:
        old = os.open(c.cache.object_path(oid), os.O_RDONLY)
        try:
            c.cache.unpin(oid)
            c.cache.drop([b])  # the file is removed...
            assert not os.path.exists(c.cache.object_path(oid))
            assert c.put(b, data(0))  # ...and written anew: marked with the new inode
            c.cache.pin(oid)
            with open(c.cache.object_path(oid), "r+b") as f:
                f.write(b"\xff")  # (so that trusting the mark would be visible below)
            trusted = trusted_count()
            # The old file's own bytes are read and checked (they are intact): the marks of
            # the new file say nothing about it.
            assert c.cache.verify_object([b], old) == BLOCK
            assert trusted_count() == trusted
        finally:
            os.close(old)
    finally:
        c.cache.unpin(oid)


def test_verifying_one_object_never_waits_for_another_objects_write(make_cache) -> None:  # type: ignore[no-untyped-def]
    """b's block held inside its index transaction (the LMDB writer, which a cold pass's
    writes queue for) does not delay the verification of a's file. Objects share no lock:
    two whose ids began with the same byte shared one of 64 striped locks, and a's
    passthrough open waited for b's write."""
    c = make_cache()
    a = [block_id("bucket", "a", "e", BLOCK, 0)]
    first = split_block_id(a[0])[0][0] % 64
    key = next(f"b{i}" for i in range(100_000)
               if object_id("bucket", f"b{i}", "e", BLOCK)[0] % 64 == first)
    b = block_id("bucket", key, "e", BLOCK, 0)
    assert c.put(a[0], data(1))
    inside, go = threading.Event(), threading.Event()

    def hold() -> None:
        inside.set()
        go.wait(10)

    failpoints.arm("put.index", hold)
    writer = threading.Thread(target=c.cache.put_sync, args=(b, data(2)))
    verified: list[int | None] = []
    checker = threading.Thread(target=lambda: verified.append(_verify_with_fd(c, a)))
    try:
        writer.start()
        assert inside.wait(10)
        checker.start()
        checker.join(5)
        waited = checker.is_alive()
    finally:
        go.set()
        failpoints.disarm("put.index")
        writer.join()
        checker.join()
    assert not waited, "a's verification waited for b's index write"
    assert verified == [BLOCK]
    assert c.get(b) == data(2)
    assert len(c.cache._file_locks) == 0  # a lock lives only while held or waited for


@pytest.mark.parametrize("policy", ["keep", "lru"])
def test_a_cache_over_its_capacity_is_trimmed_least_recently_used_first(  # type: ignore[no-untyped-def]
        make_cache, policy: str) -> None:
    """Reopened with a lower capacity than it was filled under (or recounted in disk
    allocation), a cache evicts down to the capacity under either policy, least recently
    used first, sparing objects in use; their bytes leave the disk. (keep stayed over the
    cap for good: it never evicts to admit.)"""
    c = make_cache(capacity=12 * UNIT, policy=policy)
    for i in range(12):
        assert c.put(tiny_bid(i), data(i, 100 + i))
    c.cache.touch([tiny_bid(0)])  # used lately: kept
    c.touch_flush()
    c.capacity = 5 * UNIT
    c.reopen()
    assert c.cache.used == 12 * UNIT  # (over the capacity until trimmed)
    oid = split_block_id(tiny_bid(1))[0]
    c.cache.pin(oid)  # an object in use: never evicted under its reader
    freed = c.cache.trim_to_capacity(batch=2 * UNIT)  # (several transactions)
    assert freed == 7 * UNIT and c.cache.used == 5 * UNIT
    assert c.cache.block_count == 5
    kept = [i for i in range(12) if c.cache.contains(tiny_bid(i))]
    assert kept == [0, 1, 9, 10, 11], kept
    for i in kept:
        assert c.get(tiny_bid(i)) == data(i, 100 + i)
    c.cache.unpin(oid)
    assert c.allocated() == 5 * UNIT
    assert c.cache.trim_to_capacity() == 0


def test_used_bytes_are_the_last_index_write_s_when_two_threads_report_out_of_order(
        make_cache) -> None:  # type: ignore[no-untyped-def]
    """Two puts on two threads: the first commits its index write, the second commits
    after it but reports its used bytes first. The cache took each thread's count as it
    came, so the first thread's, older, stood: a full mount's cachefs_cache_used_bytes was
    one block short of what its files took for good (a CI run of the tiny-files cache test
    waited 60 s for it), and a full keep cache's admission counted from a stale figure."""
    c = make_cache(capacity=8 * BLOCK)
    b1, b2 = tiny_bid(1), tiny_bid(2)
    committed, reported = threading.Event(), threading.Event()
    put = c.cache.index.put

    def held_put(bid, *args, **kwargs):  # type: ignore[no-untyped-def]
        result = put(bid, *args, **kwargs)  # (committed)
        if bid == b1:
            committed.set()
            reported.wait(10)  # ... and reported after the second put's report
        return result

    c.cache.index.put = held_put  # type: ignore[method-assign]
    first = threading.Thread(target=c.cache.put_sync, args=(b1, data(1, 100)))
    first.start()
    assert committed.wait(10)
    assert c.cache.put_sync(b2, data(2, 100))
    reported.set()
    first.join()
    assert c.cache.used == c.cache.index.totals()[0] == 2 * c.cache.charge(100)
    assert metrics.REGISTRY.get_sample_value("cachefs_cache_used_bytes") == c.cache.used

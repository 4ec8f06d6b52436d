"""Unit tests of cachefs.read.lookahead.DirectoryLookahead: which opens start prefetch, and how much."""

from __future__ import annotations

import random
from collections.abc import Iterator

from cachefs.cache.metadata import Entry
from cachefs.read.fetcher import ObjectVersion
from cachefs.read.lookahead import DirectoryLookahead

NAMES = [f"img{i:05d}.jpg".encode() for i in range(2000)]
DIR = "train/c000/"
# A listing numbers a directory's names in name order (cachefs.cache.index).
INO = {name: 100 + i for i, name in enumerate(NAMES)}


class FakePrefetcher:
    """Records the keys asked for; every object is one block, resident once asked for."""

    def __init__(self) -> None:
        self.prefetched: list[str] = []

    def want_object(self, obj: ObjectVersion, policy: str) -> int | None:
        assert policy == "directory"
        if obj.key not in self.prefetched:
            self.prefetched.append(obj.key)
        return obj.size


def iter_after(prefix: str, after: bytes) -> Iterator[Entry]:
    for name in NAMES:
        if name > after:
            yield Entry(name=name, is_dir=False, size=100_000, mtime=0.0, etag="e",
                        ino=INO[name])


def make() -> tuple[DirectoryLookahead, FakePrefetcher]:
    f = FakePrefetcher()
    return DirectoryLookahead(f, iter_after), f  # type: ignore[arg-type]


def test_one_reader_in_order_prefetches_ahead_and_not_behind() -> None:
    la, f = make()
    for name in NAMES[:40]:
        la.on_open(DIR, name, INO[name])
    assert f.prefetched, "an in-order walk starts prefetch"
    keys = [DIR + n.decode() for n in NAMES]
    assert all(keys.index(k) >= 3 for k in f.prefetched), "nothing before the walk"
    assert keys.index(f.prefetched[-1]) > 40 + 16, "the window grows ahead of the reader"


def test_interleaved_readers_each_walking_in_order_are_detected() -> None:
    # 8 DataLoader workers, batches of 32 consecutive files, opens interleaved.
    la, f = make()
    workers, batch = 8, 32
    for step in range(batch):
        for w in range(workers):
            la.on_open(DIR, NAMES[w * batch + step], INO[NAMES[w * batch + step]], reader=1000 + w)
    keys = {DIR + n.decode() for n in NAMES}
    assert len(f.prefetched) >= workers * 8, f"only {len(f.prefetched)} files prefetched"
    assert set(f.prefetched) <= keys
    # the next round of batches (worker 0 goes on at file 256) is requested ahead
    assert DIR + NAMES[workers * batch].decode() in f.prefetched


def test_random_opens_prefetch_nothing() -> None:
    la, f = make()
    order = list(range(len(NAMES)))
    random.Random(5).shuffle(order)
    for i in order[:500]:
        la.on_open(DIR, NAMES[i], INO[NAMES[i]])
    # A random order ascends by an adjacent step now and then, never three times running
    # for long: at most a handful of small windows.
    assert len(f.prefetched) < 25, len(f.prefetched)


def test_a_thread_pool_taking_turns_over_one_sequence_is_detected() -> None:
    la, f = make()
    for i in range(64):  # 8 threads, file i opened by thread i % 8
        la.on_open(DIR, NAMES[i], INO[NAMES[i]], reader=2000 + i % 8)
    assert DIR + NAMES[80].decode() in f.prefetched


def test_walks_are_bounded() -> None:
    la, _ = make()
    for r in range(la.max_walks + 100):
        la.on_open(f"d{r}/", NAMES[0], INO[NAMES[0]], reader=r + 1)
    assert len(la._walks) == la.max_walks


def test_a_shuffled_epoch_over_small_directories_prefetches_little() -> None:
    # 100 class folders of 50 files, a random permutation of all of them (a shuffled
    # DataLoader epoch): some walk is always a few names before the next open.
    dirs = [f"train/c{c:03d}/" for c in range(100)]
    files = [(d, n) for d in dirs for n in NAMES[:50]]

    def small_dir(prefix: str, after: bytes) -> Iterator[Entry]:
        for name in NAMES[:50]:
            if name > after:
                yield Entry(name=name, is_dir=False, size=100_000, mtime=0.0, etag="e",
                            ino=INO[name])

    f = FakePrefetcher()
    la = DirectoryLookahead(f, small_dir)  # type: ignore[arg-type]
    random.Random(11).shuffle(files)
    for i, (d, n) in enumerate(files):
        la.on_open(d, n, INO[n], reader=3000 + i % 8)  # 8 workers
    assert len(f.prefetched) < 0.02 * len(files), f"{len(f.prefetched)} of {len(files)} prefetched"

"""The one prefetcher's ledger and warm path, and the fetcher's walk over cache tiers.

Component tests over MemoryStore + BlockCache (no FUSE): every speculative fetch is
counted once, by policy, as used or wasted; a tier below the disk is asked before the
origin and is filled from it; a block found in a lower tier is written back above.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from cachefs import metrics
from cachefs.cache.blocks import BlockCache
from cachefs.cache.lmdbenv import LmdbEnv
from cachefs.read.budget import MemoryBudget
from cachefs.read.fetcher import Fetcher, ObjectVersion
from cachefs.read.prefetcher import DIRECTORY, HINT, SEQUENTIAL, WARM, Prefetcher, PrefetchLedger
from cachefs.read.tiers import BlockRef
from cachefs.s3.memory import MemoryStore
from cachefs.s3.origin import Origin
from tests.conftest import running

BS = 64


def counter(name: str, policy: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, {"policy": policy}) or 0.0


class DictTier:
    """A lower tier (standing in for a shared one): a dict, with call counts."""

    name = "shared"

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}
        self.gets = 0
        self.puts = 0

    def contains(self, ref: BlockRef) -> bool:
        return False  # cannot tell without a request

    async def get(self, ref: BlockRef) -> bytes | None:
        self.gets += 1
        await trio.lowlevel.checkpoint()
        return self.blocks.get(ref.bid)

    async def put(self, ref: BlockRef, data: bytes) -> None:
        self.puts += 1
        self.blocks[ref.bid] = data

    async def withdraw(self, refs: Sequence[BlockRef]) -> None:
        for ref in refs:
            self.blocks.pop(ref.bid, None)


def run(tmp_path: Path, store: MemoryStore, fn: Callable[[Fetcher, Prefetcher], Awaitable[Any]],
        *, lower: list[Any] | None = None, budget: int = 1 << 20, ledger_size: int = 1000,
        sub: str = "cache") -> Any:
    root = tmp_path / sub
    root.mkdir(exist_ok=True)
    env = LmdbEnv(root / "meta.lmdb")

    async def main() -> Any:
        ledger = PrefetchLedger(ledger_size)
        cache = BlockCache(env, root, capacity=1 << 20)
        fetcher = Fetcher(Origin(store, max_connections=8, deadline=0), cache, block_size=BS,
                          budget=MemoryBudget(budget), hot_capacity=0, notes=ledger,
                          lower_tiers=lower or [])
        prefetcher = Prefetcher(fetcher, fetcher.budget, ledger)
        async with running(fetcher):
            return await fn(fetcher, prefetcher)
    try:
        return trio.run(main)
    finally:
        env.close()


def put(store: MemoryStore, key: str, n: int, seed: int = 1) -> tuple[ObjectVersion, bytes]:
    data = random.Random(seed).randbytes(n)
    info = store.put(key, data)
    return ObjectVersion(key, info.etag, info.size), data


def test_ledger_counts_used_and_wasted_bytes_by_policy(tmp_path: Path) -> None:
    store = MemoryStore()
    obj, data = put(store, "k", 6 * BS)
    used0, wasted0 = counter("cachefs_prefetch_used_bytes_total", HINT), \
        counter("cachefs_prefetch_wasted_bytes_total", HINT)
    issued0 = counter("cachefs_prefetch_issued_bytes_total", HINT)

    async def body(f: Fetcher, p: Prefetcher) -> None:
        assert p.want_object(obj, HINT) == 6 * BS
        await f.drain()
        assert await f.read(obj, 0, 2 * BS) == data[:2 * BS]  # two of six blocks read
        # Four more issued blocks overflow a ledger of 6: the two oldest unread go.
        other, _ = put(store, "other", 4 * BS, seed=2)
        assert p.want_object(other, HINT) == 4 * BS

    run(tmp_path, store, body, ledger_size=6)
    assert counter("cachefs_prefetch_issued_bytes_total", HINT) - issued0 == 10 * BS
    assert counter("cachefs_prefetch_used_bytes_total", HINT) - used0 == 2 * BS
    assert counter("cachefs_prefetch_wasted_bytes_total", HINT) - wasted0 == 2 * BS


def test_ledger_marks_blocks_the_kernel_reads_itself_as_used() -> None:
    ledger = PrefetchLedger()
    before = counter("cachefs_prefetch_used_bytes_total", SEQUENTIAL)
    ledger.issued(b"a" * 24, 100, SEQUENTIAL)
    ledger.issued(b"b" * 24, 50, SEQUENTIAL)
    ledger.mark_used([b"a" * 24, b"c" * 24])
    assert counter("cachefs_prefetch_used_bytes_total", SEQUENTIAL) - before == 100
    assert len(ledger) == 1
    ledger.forget(b"b" * 24)
    assert len(ledger) == 0


def test_warm_block_fetches_once_and_waits_for_budget(tmp_path: Path) -> None:
    store = MemoryStore()
    obj, _ = put(store, "k", 4 * BS)
    issued0 = counter("cachefs_prefetch_issued_bytes_total", WARM)

    async def body(f: Fetcher, p: Prefetcher) -> list[bool]:
        # A budget of one block: four warm calls in parallel must queue, not fail.
        results: list[bool] = [False] * 4

        async def one(i: int) -> None:
            results[i] = await p.warm_block(obj, i)

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(one, i)
        assert [f.is_cached(obj, i) for i in range(4)] == [True] * 4
        assert await p.warm_block(obj, 2) is False  # already on disk
        assert f.budget.used == 0
        return results

    assert run(tmp_path, store, body, budget=BS) == [True] * 4
    assert store.calls["get"] == 4
    assert counter("cachefs_prefetch_issued_bytes_total", WARM) - issued0 == 4 * BS


def test_fetcher_walks_tiers_in_order_and_writes_back_above(tmp_path: Path) -> None:
    store = MemoryStore()
    obj, data = put(store, "k", 3 * BS)
    shared = DictTier()

    async def first_node(f: Fetcher, p: Prefetcher) -> bytes:
        return await f.read(obj, 0, 3 * BS)

    # A cold node: the lower tier misses, the origin answers, both tiers are filled.
    assert run(tmp_path, store, first_node, lower=[shared], sub="node1") == data
    assert store.calls["get"] == 3
    assert shared.gets == 3 and shared.puts == 3

    sources: list[str] = []

    async def second_node(f: Fetcher, p: Prefetcher) -> bytes:
        for i in range(3):
            sources.append((await f.get_block(obj, i))[1])
        await f.drain()
        assert all(f.is_cached(obj, i) for i in range(3)), "written back to the disk tier"
        return await f.read(obj, 0, 3 * BS)

    # Another node with an empty disk: every block comes from the lower tier, no GET.
    assert run(tmp_path, store, second_node, lower=[shared], sub="node2") == data
    assert sources == ["shared"] * 3
    assert store.calls["get"] == 3
    assert shared.puts == 3  # a block found in the lower tier is not put back into it


def test_a_failing_lower_tier_is_a_miss_that_goes_to_the_origin(tmp_path: Path) -> None:
    store = MemoryStore()
    obj, data = put(store, "k", 2 * BS)

    class Broken(DictTier):
        async def get(self, ref: BlockRef) -> bytes | None:
            self.gets += 1
            return None  # the contract: down, corrupt or missing are all a miss

    broken = Broken()

    async def body(f: Fetcher, p: Prefetcher) -> bytes:
        return await f.read(obj, 0, 2 * BS)

    assert run(tmp_path, store, body, lower=[broken]) == data
    assert broken.gets == 2 and store.calls["get"] == 2


def test_a_batch_of_one_block_objects_is_looked_up_on_disk_in_one_read(tmp_path: Path) -> None:
    """Prefetcher.on_disk answers for a batch of one-block objects (a top-up of the directory
    lookahead) from one read transaction of the index, and want_object with its answer
    decides as it does alone: a file on disk is left there (0), one not on disk is fetched
    (its length), an object of more blocks looks its blocks up itself."""
    store = MemoryStore()
    small = [put(store, f"d/f{i}", BS // 2 + i, seed=i)[0] for i in range(6)]
    big, _ = put(store, "d/big", 3 * BS, seed=9)
    reads = metrics.LMDB_TRANSACTIONS.counters["read"]

    async def body(f: Fetcher, p: Prefetcher) -> None:
        for obj in small[::2]:  # three of the six on local disk
            await f.read(obj, 0, obj.size)
        await f.drain()
        before = reads.value
        on_disk = p.on_disk([*small, big])
        assert reads.value - before == 1
        assert on_disk == {f.block_id(obj, 0) for obj in small[::2]}
        before = reads.value
        got = [p.want_object(obj, DIRECTORY, on_disk=on_disk) for obj in small]
        assert reads.value - before == 0  # no lookup of its own per file
        assert got == [0 if i % 2 == 0 else obj.size for i, obj in enumerate(small)]
        assert p.want_object(big, DIRECTORY, on_disk=on_disk) == 3 * BS
        assert reads.value - before == 3  # (its three blocks, one at a time)
        await f.drain()
        assert all(f.is_cached(obj, 0) for obj in small)

    run(tmp_path, store, body)

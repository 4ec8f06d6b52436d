"""Unit tests of the shared tier's parts: names and stamps, the circuit breaker, the
publish queue, and SharedTier's lookups, leases, publishing and failure handling over an
in-memory object client (two tiers on one dict = two nodes on one store)."""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import trio

from cachefs import metrics
from cachefs.errors import (
    AccessDenied,
    EndpointUnreachable,
    NoSuchBucket,
    StoreError,
    TransientStoreError,
)
from cachefs.read import shared
from cachefs.read.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from cachefs.read.fetcher import ObjectVersion
from cachefs.read.publishq import Publish, PublishQueue
from cachefs.read.shared import (
    HARD_LIMIT,
    LEASE_HISTORY,
    STAMP,
    SharedLayout,
    SharedSettings,
    SharedTier,
)
from cachefs.read.tiers import BlockRef
from cachefs.s3.objects import Response
from tests.conftest import running

BS = 1024
OBJ = ObjectVersion("train/x.bin", "etag1", 3 * BS + 100)


def ref(index: int, obj: ObjectVersion = OBJ) -> BlockRef:
    length = max(0, min(BS, obj.size - index * BS))
    return BlockRef(obj, index, length, b"%024d" % index)


def block(index: int) -> bytes:
    return bytes([index % 256]) * ref(index).length


class MemoryObjects:
    """An ObjectClient stand-in on a dict, shared by several tiers (nodes). ``fail`` makes
    every request raise, ``fail_writes`` every PUT; ``gate`` (a threading.Event) holds requests until set."""

    endpoint = "memory://"
    sessions = None

    def __init__(self, *, honour_if_none_match: bool = True) -> None:
        self.objects: dict[str, tuple[bytes, dict[str, str]]] = {}
        self.counts: Counter[str] = Counter()
        self.fail: StoreError | None = None
        self.fail_writes: StoreError | None = None
        self.gate: threading.Event | None = None
        self.gates: dict[str, threading.Event] = {}  # by op
        self.honour = honour_if_none_match
        self._lock = threading.Lock()

    def _enter(self, op: str) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        if op in self.gates:
            self.gates[op].wait(10)
        with self._lock:
            self.counts[op] += 1
        if self.fail is not None:
            raise self.fail

    def get(self, key: str, *, timeout: float | None = None) -> Response | None:
        self._enter("get")
        item = self.objects.get(key)
        return None if item is None else Response(item[0], dict(item[1]))

    def head(self, key: str, *, timeout: float | None = None) -> dict[str, str] | None:
        self._enter("head")
        item = self.objects.get(key)
        return None if item is None else dict(item[1])

    def put(self, key: str, body: bytes, *, metadata: dict[str, str] | None = None,
            if_none_match: bool = False, op: str = "put", timeout: float | None = None) -> bool:
        self._enter(op)
        if self.fail_writes is not None:
            raise self.fail_writes
        with self._lock:
            if if_none_match and self.honour and key in self.objects:
                return False
            self.objects[key] = (body, {f"x-amz-meta-{k}": v for k, v in (metadata or {}).items()})
        return True

    def delete(self, key: str, *, timeout: float | None = None) -> None:
        self._enter("delete")
        self.objects.pop(key, None)


def tier(client: MemoryObjects, node: str | None = None, **settings: Any) -> SharedTier:
    base: dict[str, Any] = dict(timeout=2.0, publish_timeout=2.0, queue_bytes=16 * BS,
                                lease_wait=0.5, breaker_cooldown=0.2)
    base.update(settings)
    return SharedTier(client, SharedLayout("pfx/", "src", BS),  # type: ignore[arg-type]
                      label="s3://cache/pfx/", settings=SharedSettings(**base), node=node)


def run(fn: Callable[..., Any], *tiers: SharedTier) -> Any:
    async def main() -> Any:
        async with trio.open_nursery() as nursery:
            for t in tiers:
                await nursery.start(t.run)
            try:
                return await fn()
            finally:
                nursery.cancel_scope.cancel()
    return trio.run(main)


def lookups(result: str) -> float:
    return metrics.SHARED_LOOKUPS.labels(result)._value.get()


def publishes(result: str) -> float:
    return metrics.SHARED_PUBLISHES.labels(result)._value.get()


def leases(result: str) -> float:
    return metrics.SHARED_LEASES.labels(result)._value.get()


# -- names and stamps ----------------------------------------------------------------------
def test_names_depend_on_every_field_of_the_block_identity() -> None:
    layout = SharedLayout("p/", "src", BS)
    base = layout.block_key(ref(1))
    assert base.startswith("p/v1/") and base.endswith("/0000000001")
    others = {
        layout.block_key(ref(2)),
        layout.block_key(ref(1, ObjectVersion("train/x.bin", "etag2", OBJ.size))),
        layout.block_key(ref(1, ObjectVersion("train/y.bin", "etag1", OBJ.size))),
        SharedLayout("p/", "other-src", BS).block_key(ref(1)),
        SharedLayout("p/", "src", 2 * BS).block_key(ref(1)),
    }
    assert base not in others and len(others) == 5
    assert layout.block_key(ref(1)) == base  # stable
    assert layout.lease_key(ref(1), 7).startswith("p/leases/")


def test_verify_accepts_the_stamped_block_and_names_what_is_wrong() -> None:
    layout = SharedLayout("p/", "src", BS)
    r, data = ref(0), block(0)
    headers = {f"x-amz-meta-{STAMP}": layout.stamp(r, data)}
    assert layout.verify(r, Response(data, headers)) == (data, "hit")
    flipped = bytes([data[0] ^ 1]) + data[1:]
    assert layout.verify(r, Response(flipped, headers)) == (None, "corrupt")
    assert layout.verify(r, Response(data[:-1], headers)) == (None, "corrupt")
    assert layout.verify(r, Response(data, {})) == (None, "foreign")
    other = {f"x-amz-meta-{STAMP}": layout.stamp(ref(1), block(1))}
    assert layout.verify(r, Response(data, other)) == (None, "foreign")


def test_shards_are_stable_and_spread() -> None:
    layout = SharedLayout("p/", "src", BS)
    many = ObjectVersion("big", "e", 4000 * BS)
    shards = [layout.shard_of(BlockRef(many, i, BS, b""), 4) for i in range(4000)]
    assert shards == [layout.shard_of(BlockRef(many, i, BS, b""), 4) for i in range(4000)]
    counts = Counter(shards)
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 850


# -- the circuit breaker -------------------------------------------------------------------
def test_breaker_opens_after_threshold_and_closes_after_a_good_trial(caplog) -> None:
    caplog.set_level(logging.INFO)
    now = [0.0]
    b = CircuitBreaker("the tier", threshold=3, cooldown=1.0, max_cooldown=4.0,
                       clock=lambda: now[0])
    b.failure("x")
    b.success()  # a success resets the count
    b.failure("x")
    b.failure("x")
    assert b.state == CLOSED and b.allow()
    b.failure("boom")
    assert b.state == OPEN and not b.allow()
    assert metrics.SHARED_BREAKER_OPEN._value.get() == 1
    now[0] = 1.0
    assert b.allow() and b.state == HALF_OPEN
    assert not b.allow()  # one trial at a time
    b.failure("still")  # back to open, cooldown doubled, no new log line
    now[0] = 2.5
    assert not b.allow()
    now[0] = 3.0
    assert b.allow()
    b.success()
    assert b.state == CLOSED and metrics.SHARED_BREAKER_OPEN._value.get() == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "cachefs.read.breaker"
             and r.levelname in ("WARNING", "INFO")]
    assert len(lines) == 2
    assert "boom" in lines[0] and "circuit breaker open" in lines[0]
    assert "answers again after 3.0s" in lines[1]


def test_breaker_cooldown_is_capped_and_a_lost_trial_is_replaced() -> None:
    now = [0.0]
    b = CircuitBreaker("t", threshold=1, cooldown=1.0, max_cooldown=2.0, clock=lambda: now[0])
    b.failure("x")
    for _ in range(5):
        now[0] += 2.0
        assert b.allow()
        b.failure("x")
    now[0] += 2.0
    assert b.allow()  # the cooldown never grew past 2 s
    now[0] += 2.0  # this trial never reported back: another is allowed
    assert b.allow()


# -- the publish queue ---------------------------------------------------------------------
def test_queue_is_bounded_in_bytes_and_leased_blocks_displace_unleased() -> None:
    async def main() -> None:
        q = PublishQueue(3 * BS)
        items = [Publish(f"k{i}", ref(0), b"x" * BS) for i in range(3)]
        assert all(q.offer(i) for i in items)
        assert q.offer(Publish("k0", ref(0), b"x" * BS))  # same key: already queued
        assert not q.offer(Publish("k3", ref(0), b"x" * BS))  # full: dropped
        leased = Publish("k4", ref(0), b"x" * BS, leased=True)
        before = publishes("dropped_full")
        assert q.offer(leased)  # takes the place of the oldest unleased block
        assert publishes("dropped_full") == before + 1 and items[0].done.is_set()
        assert q.bytes == 3 * BS and len(q) == 3
        assert metrics.SHARED_QUEUE_BYTES._value.get() == 3 * BS
        taken = [await q.take() for _ in range(3)]
        assert [t.key for t in taken] == ["k1", "k2", "k4"]
        assert q.pending("k1") is taken[0]  # in progress until finished
        for t in taken:
            q.finish(t, True)
        await q.wait_idle()
        assert q.bytes == 0 and q.pending("k1") is None and taken[0].stored
    trio.run(main)


# -- the tier ---------------------------------------------------------------------------------
def test_a_block_put_by_one_node_is_a_verified_hit_on_another() -> None:
    store = MemoryObjects()
    a, b = tier(store), tier(store)

    async def main() -> None:
        assert await b.get(ref(0)) is None  # miss (b writes the block's fetch lease)
        await a.put(ref(0), block(0))
        await a.drain()
        assert await b.get(ref(0)) == block(0)
        assert await b.get(ref(1)) is None
    hits = lookups("hit")
    run(main, a, b)
    assert lookups("hit") == hits + 1
    assert sum(1 for k in store.objects if k.startswith("pfx/v1/")) == 1


def test_lease_loser_waits_for_the_winner_and_gets_the_block() -> None:
    store = MemoryObjects()
    a, b = tier(store), tier(store)

    async def main() -> None:
        assert await a.get(ref(2)) is None  # a wins the lease: it fetches from the origin

        async def winner_publishes() -> None:
            await trio.sleep(0.1)  # the origin fetch
            await a.put(ref(2), block(2))
        async with trio.open_nursery() as n:
            n.start_soon(winner_publishes)
            assert await b.get(ref(2)) == block(2)  # lost the lease, waited, served
    won, served = leases("won"), leases("lost_served")
    run(main, a, b)
    assert leases("won") == won + 1 and leases("lost_served") == served + 1


def test_lease_loser_gives_up_after_the_wait() -> None:
    store = MemoryObjects()
    a, b = tier(store), tier(store, lease_wait=0.2)

    async def main() -> None:
        assert await a.get(ref(1)) is None  # a wins and then never publishes
        assert await b.get(ref(1)) is None  # b waits 0.2 s, then goes to the origin
    timeouts = leases("lost_timeout")
    run(main, a, b)
    assert leases("lost_timeout") == timeouts + 1


def test_a_restarted_node_takes_over_its_own_leases_and_waits_for_others() -> None:
    """A lease found taken is this node's own when it holds the node's identity (a run
    before a restart): taken over at once (reclaimed), and no contention is seen; another
    node's lease is still waited for."""
    store = MemoryObjects()
    before = tier(store, node="host:1111")
    again, other = tier(store, node="host:1111"), tier(store, node="host:2222", lease_wait=0.2)

    async def first_run() -> None:
        assert await before.get(ref(0)) is None  # its lease; then it dies holding it
        assert await before.get(ref(1)) is None
        await trio.sleep(0.2)  # (the lease writes land)

    async def second_run() -> None:
        t0 = trio.current_time()
        assert await again.get(ref(0)) is None
        assert trio.current_time() - t0 < 0.2  # no lease wait (0.5 s here)
        assert not again._contended()
        assert await other.get(ref(1)) is None  # another node's lease: waited for

    run(first_run, before)
    reclaimed, timeouts = leases("reclaimed"), leases("lost_timeout")
    run(second_run, again, other)
    assert leases("reclaimed") == reclaimed + 1
    assert leases("lost_timeout") == timeouts + 1


def test_a_slow_lease_answer_is_waited_for_briefly_until_contention_is_seen() -> None:
    store = MemoryObjects()
    a, b = tier(store, timeout=1.0), tier(store)
    many = ObjectVersion("many", "e", 1000 * BS)

    def block_ref(i: int) -> BlockRef:
        return BlockRef(many, i, BS, b"")

    async def miss_waits_for_lease(t: SharedTier, i: int) -> bool:
        """Whether a miss of block i waits for its lease write (held back here) longer
        than the grace of LEASE_GRACE budgets."""
        store.gates["lease"] = threading.Event()
        with trio.move_on_after(0.5) as waited:
            assert await t.get(block_ref(i)) is None
        store.gates["lease"].set()
        await trio.sleep(0.2)
        return waited.cancelled_caught

    async def main() -> None:
        # No contention seen: a miss waits 0.1 s for its lease, then fetches anyway ...
        assert not await miss_waits_for_lease(a, 0)
        # ... and the write still lands, for nodes that miss the block later.
        assert any(k.startswith("pfx/leases/") and f"/{0:010d}." in k for k in store.objects)
        # b holds block 1's lease; a's slow write finds it taken after a went ahead
        # (raced: both fetch it), and a's next misses wait for their lease's answer ...
        assert await b.get(block_ref(1)) is None
        assert not await miss_waits_for_lease(a, 1)
        assert await miss_waits_for_lease(a, 2)
        # ... until LEASE_HISTORY leases in a row were won (block 2's was given up).
        for i in range(3, 3 + LEASE_HISTORY):
            assert await a.get(block_ref(i)) is None
        assert not await miss_waits_for_lease(a, 3 + LEASE_HISTORY)

    raced = leases("raced")
    run(main, a, b)
    assert leases("raced") == raced + 1


def test_leases_are_off_when_the_store_ignores_if_none_match(caplog) -> None:
    store = MemoryObjects(honour_if_none_match=False)
    a = tier(store)

    async def main() -> None:
        await trio.sleep(0.2)  # the start-up probe
        assert a.conditional_writes is False and not a.leases_on
        assert await a.get(ref(0)) is None
    run(main, a)
    assert store.counts["lease"] == 2  # the probe's two writes; no lease after it
    assert any("ignores If-None-Match" in r.getMessage() for r in caplog.records)


def test_a_failed_start_up_check_is_made_again_once_the_store_answers(caplog) -> None:
    """A store down at start is checked again once it answers a request (not before a
    cooldown); a store that answers but refuses the check's writes is checked again at
    a doubling interval, not at each request it answers."""
    down, refusing = MemoryObjects(honour_if_none_match=False), MemoryObjects()
    a, b = tier(down, breaker_cooldown=0.2), tier(refusing, breaker_cooldown=0.2)
    down.fail = EndpointUnreachable("refused")
    refusing.fail_writes = AccessDenied("read-only credentials")

    async def main() -> None:
        await trio.sleep(0.1)
        assert a.conditional_writes is None and b.conditional_writes is None
        down.fail = None
        await trio.sleep(0.4)  # (a's breaker cools down)
        assert await a.get(ref(0)) is None  # answered: a checks again
        await trio.sleep(0.3)
        assert a.conditional_writes is False and not a.leases_on
        for i in range(40):  # b's lookups are answered all along
            assert await b.get(ref(i % 3)) is None
            await trio.sleep(0.05)
    run(main, a, b)
    # ~2.8 s: checks at 0, 0.2, 0.6, 1.4, 3.0 s: again, but not once per answered lookup
    # (40 of them), whatever the machine's load.
    assert 3 <= refusing.counts["lease"] <= 6 and b.conditional_writes is None
    assert sum("start-up check failed" in r.getMessage() for r in caplog.records) == 2
    assert sum("ignores If-None-Match" in r.getMessage() for r in caplog.records) == 1


def test_a_failing_store_opens_the_breaker_and_lookups_stop(caplog) -> None:
    store = MemoryObjects()
    a = tier(store, breaker_cooldown=30.0)
    store.fail = EndpointUnreachable("refused")

    async def main() -> None:
        await trio.sleep(0.2)  # the start-up probe fails first: one failure
        for i in range(6):
            assert await a.get(ref(i % 3)) is None
        await a.put(ref(0), block(0))  # not even queued while the breaker is open
    skipped, dropped = lookups("skipped"), publishes("dropped_unavailable")
    run(main, a)
    assert store.counts["get"] == 2  # + the probe's failed write = 3 failures: open
    assert lookups("skipped") == skipped + 4
    assert publishes("dropped_unavailable") == dropped + 1
    assert a.breaker.state == OPEN
    assert sum("circuit breaker open" in r.getMessage() for r in caplog.records) == 1


def test_a_stalled_store_costs_a_bounded_wait_per_failure_then_nothing() -> None:
    store = MemoryObjects()
    a = tier(store, timeout=0.1, breaker_cooldown=30.0, leases=False)

    async def main() -> float:
        await trio.sleep(0.1)  # the probe passes while the store answers
        store.gate = threading.Event()  # from now on nothing answers
        t0 = trio.current_time()
        for i in range(10):
            assert await a.get(ref(i % 3)) is None
        store.gate.set()
        return trio.current_time() - t0
    timeouts = lookups("timeout")
    elapsed = run(main, a)
    assert lookups("timeout") == timeouts + 3  # three failures, then the breaker is open
    assert a.breaker.state == OPEN
    # A thread that never returns is given up after HARD_LIMIT budgets; the seven
    # lookups after the breaker opened cost nothing.
    assert elapsed < 4 * HARD_LIMIT * 0.1


def test_refused_writes_stop_publishing_but_not_reads(caplog) -> None:
    store = MemoryObjects()
    a = tier(store)

    async def main() -> None:
        await trio.sleep(0.1)
        store.objects["x"] = (b"", {})
        store.fail = AccessDenied("read-only credentials")
        await a.put(ref(0), block(0))
        await a.drain()
        assert not a.can_publish()
        assert a.why_unpublished() == "it refuses writes (read-only credentials)"
        store.fail = None
        await a.put(ref(1), block(1))  # dropped: publishing is off for a while
        assert len(a.queue) == 0
        assert await a.get(ref(1)) is None  # reads go on (no lease while not publishing)
    run(main, a)
    assert a.breaker.state == CLOSED
    assert store.counts["lease"] == 2  # only the start-up probe's
    assert any("refuses writes" in r.getMessage() for r in caplog.records)


def test_a_tier_that_keeps_refusing_writes_is_logged_once_and_taking_them_again_once(
        caplog, monkeypatch) -> None:
    """A node with read-only credentials: its writes are refused at every retry of
    publishing. It logged "publishing again" and "refuses writes" at each retry, every 5
    minutes for its whole life, where one line was promised. Now: one warning at the first
    refusal, nothing at the retries it refuses, one line when a write is taken again."""
    monkeypatch.setattr(shared, "PUBLISH_RETRY", 0.05)
    monkeypatch.setattr(shared, "REFUSED_RETRY_FIRST", 0.05)
    caplog.set_level(logging.INFO, "cachefs.read.shared")
    store = MemoryObjects()
    a = tier(store)

    def lines(text: str) -> int:
        return sum(text in r.getMessage() for r in caplog.records)

    async def main() -> None:
        await trio.sleep(0.1)
        store.fail = AccessDenied("read-only credentials")
        for i in range(6):  # six retries, every one refused
            await a.put(ref(i), block(i))
            await a.drain()
            assert not a.can_publish()
            await trio.sleep(0.06)
            assert a.can_publish()  # (the retry is due)
        await a.put(ref(6), block(6))
        await a.drain()
        assert lines("refuses writes") == 1
        assert lines("takes writes again") == lines("publishing to the shared cache") == 0
        assert metrics.REGISTRY.get_sample_value("cachefs_shared_publish_enabled") == 0
        store.fail = None
        await trio.sleep(0.06)
        await a.put(ref(7), block(7))
        await a.drain()
        assert lines("takes writes again") == 1
        assert metrics.REGISTRY.get_sample_value("cachefs_shared_publish_enabled") == 1
    run(main, a)


def test_a_write_refused_for_a_deleted_bucket_is_tried_again_once_the_tier_answers_again(
        caplog, monkeypatch) -> None:
    """The tier's bucket deleted and made again while nodes run: the node's lookups
    failed (no such bucket: the breaker opened) and its writes were refused, which kept
    publishing off for 5 minutes, well after the bucket was back and lookups answered.
    Writes refused during an outage of reads are tried again once the tier answers
    reads again (no sooner than REFUSED_RETRY_MIN after the refusal)."""
    monkeypatch.setattr(shared, "REFUSED_RETRY_MIN", 0.3)
    caplog.set_level(logging.INFO, "cachefs.read.shared")
    store = MemoryObjects()
    a = tier(store, breaker_cooldown=0.2)

    async def main() -> None:
        await trio.sleep(0.1)  # (the start-up check passes)
        store.fail = NoSuchBucket("bucket 'cache' does not exist")
        await a.put(ref(0), block(0))
        await a.drain()
        assert not a.can_publish() and "refuses writes" in a.why_unpublished()
        for i in range(3):
            assert await a.get(ref(i)) is None
        assert a.breaker.state == OPEN
        store.fail = None  # the bucket is made again
        await trio.sleep(0.25)  # (the breaker's cooldown)
        assert await a.get(ref(1)) is None  # answered: a miss; the breaker closes
        assert a.breaker.state == CLOSED
        await trio.sleep(0.35)  # (past REFUSED_RETRY_MIN after the refusal)
        assert a.can_publish()
        await a.put(ref(2), block(2))
        await a.drain()
        assert "pfx/" in next(iter(store.objects)) and len(store.objects) == 1
    run(main, a)
    assert sum("takes writes again" in r.getMessage() for r in caplog.records) == 1


def test_a_read_only_tier_is_asked_to_take_writes_at_a_doubling_interval(monkeypatch) -> None:
    """Writes refused while reads are answered (read-only credentials): tried again after
    REFUSED_RETRY_FIRST, doubled at each refusal up to PUBLISH_RETRY, and the reads the
    tier answers all along do not bring a write sooner."""
    monkeypatch.setattr(shared, "REFUSED_RETRY_FIRST", 0.1)
    monkeypatch.setattr(shared, "REFUSED_RETRY_MIN", 0.0)
    monkeypatch.setattr(shared, "PUBLISH_RETRY", 0.8)
    store = MemoryObjects()
    a = tier(store, leases=False)
    tries: list[float] = []

    async def main() -> None:
        await trio.sleep(0.1)
        store.fail_writes = AccessDenied("read-only credentials")
        start = trio.current_time()
        while trio.current_time() - start < 4.0:
            before = store.counts["put"]
            await a.put(ref(0), block(0))  # (dropped unless a retry is due)
            await a.drain()
            if store.counts["put"] > before:
                tries.append(trio.current_time() - start)
            assert await a.get(ref(1)) is None  # answered
            await trio.sleep(0.02)
    run(main, a)
    gaps = [round(later - t, 1) for t, later in itertools.pairwise(tries)]
    # 0.1, 0.2, 0.4, 0.8, 0.8... (each at least the pause, plus a poll's 0.02 s or so)
    assert len(tries) <= 8, tries
    assert gaps[:3] == pytest.approx([0.1, 0.2, 0.4], abs=0.1), gaps
    assert all(g >= 0.75 for g in gaps[3:]), gaps


def test_a_warm_waits_out_a_pause_that_a_write_in_flight_ends_the_count_of() -> None:
    """Throttled warm writes pause publishing; a write already in flight then succeeds,
    which ends the tier's count of throttled writes but not the pause. The warm's next
    tries, dropped by the pause, read that count as "not throttled: no point waiting" and
    gave their blocks up (a cluster warm failed files now and then: the shard warm test
    on a real tier, 2 runs in 7). Each block's tries now go by its own write's outcome:
    all are put."""
    throttled_once: set[str] = set()
    slow = threading.Event()

    class Store(MemoryObjects):
        def put(self, key: str, body: bytes, **kw: Any) -> bool:  # type: ignore[override]
            if kw.get("op", "put") == "put" and key.endswith("0"):
                slow.wait(10)  # block 0: a write in flight while the others are throttled
            elif kw.get("op", "put") == "put" and key not in throttled_once:
                throttled_once.add(key)
                raise TransientStoreError("SlowDown", throttled=True)
            return super().put(key, body, **kw)

    store = Store()
    a = tier(store, breaker_cooldown=0.3)
    obj = ObjectVersion("train/y.bin", "etag2", 8 * BS)

    async def main() -> list[bool]:
        await trio.sleep(0.1)  # (the start-up check)
        results: dict[int, bool] = {}

        async def warm(i: int) -> None:
            async def local() -> bytes:
                return bytes([i]) * BS
            results[i] = await a.ensure_published(ref(i, obj), local)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(warm, 0)
            await trio.sleep(0.05)
            for i in (1, 2, 3):  # throttled: a first pause (0.3 s); they wait 0.5 s
                nursery.start_soon(warm, i)
            while len(throttled_once) < 3:
                await trio.sleep(0.01)
            await trio.sleep(0.35)  # (the first pause is over)
            for i in (4, 5, 6):  # throttled: a second pause (0.6 s), over 1-3's next tries
                nursery.start_soon(warm, i)
            while len(throttled_once) < 6:
                await trio.sleep(0.01)
            slow.set()  # block 0's write is taken: the count of throttled writes ends
        return [results[i] for i in range(7)]

    assert run(main, a) == [True] * 7
    assert all(a.layout.block_key(ref(i, obj)) in store.objects for i in range(7))


def test_throttled_writes_pause_publishing_and_leave_reads_alone(caplog) -> None:
    """Writes answered 503 SlowDown (or 500) say nothing of reads: publishing pauses, the
    breaker stays closed and lookups go on; a write that gets no answer feeds the breaker."""
    caplog.set_level(logging.INFO, "cachefs.read.shared")
    store = MemoryObjects()
    a, b = tier(store), tier(store)

    async def main() -> None:
        await trio.sleep(0.1)
        await b.put(ref(0), block(0))  # another node published block 0
        await b.drain()
        store.fail_writes = TransientStoreError("throttled (SlowDown)", throttled=True)
        for i in (1, 2, 3):
            await a.put(ref(i), block(i))
        await a.drain()
        assert not a.can_publish() and a.breaker.state == CLOSED
        assert not a.describe()["publishing"]
        assert a.why_unpublished() == "it throttles writes (throttled (SlowDown))"
        assert await a.get(ref(0)) == block(0)  # reads go on
        assert lookups("skipped") == skipped
        store.fail_writes = None
        await trio.sleep(0.5)  # the pause (0.2 s, the breaker's cooldown) is over
        assert a.can_publish()
        await a.put(ref(1), block(1))
        await a.drain()
        assert a.layout.block_key(ref(1)) in store.objects
        assert a.describe()["publishing"]
        # A write with no answer at all is the store's failure, as a read's would be.
        store.fail_writes = TransientStoreError("reset", reason="connection")
        for i in (2, 3):
            await a.put(ref(i), block(i))
            await a.drain()
        await a.put(ref(2), block(2))
        await a.drain()
        assert a.breaker.state != CLOSED
        assert a.why_unpublished() == "it does not answer (reset)"
    skipped = lookups("skipped")
    run(main, a, b)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("throttles writes" in m for m in messages) == 1, messages
    assert sum("takes writes again" in m for m in messages) == 1, messages


def test_ensure_published_uploads_a_missing_block_and_trusts_a_present_one_it_sees() -> None:
    store = MemoryObjects()
    a = tier(store)
    reads: list[int] = []

    async def main() -> None:
        async def local(i: int) -> bytes:
            reads.append(i)
            return block(i)
        assert await a.ensure_published(ref(0), lambda: local(0))
        assert reads == [0]
        b = tier(store)  # another node: the block is there (HEAD), nothing read locally
        assert await b.ensure_published(ref(0), lambda: local(0))
        assert reads == [0]
        assert await a.ensure_published(ref(0), lambda: local(0))  # asked again (HEAD)
        assert reads == [0]
        store.objects.clear()  # the tier lost it: published again, not trusted from memory
        assert await a.ensure_published(ref(0), lambda: local(0))
        assert reads == [0, 0] and a.layout.block_key(ref(0)) in store.objects
    run(main, a)
    assert store.counts["head"] == 4


def test_corrupt_object_is_replaced_by_the_next_publish() -> None:
    store = MemoryObjects()
    a = tier(store)
    key = a.layout.block_key(ref(0))

    async def main() -> None:
        await a.put(ref(0), block(0))
        await a.drain()
        body, meta = store.objects[key]
        store.objects[key] = (b"\x01" + body[1:], meta)
        assert await a.get(ref(0)) is None  # corrupt: a miss, no lease
        await a.put(ref(0), block(0))  # overwrites despite If-None-Match
        await a.drain()
        assert await a.get(ref(0)) == block(0)
    run(main, a)
    assert store.objects[key][0] == block(0)


@pytest.mark.parametrize("nodes", [1, 3])
def test_describe_is_plain_data(nodes: int) -> None:
    a = tier(MemoryObjects())
    d = a.describe()
    assert d["url"] == "s3://cache/pfx/" and d["breaker"] == CLOSED and d["publishing"]
    assert a.shard_of(ref(0), nodes) in range(nodes)


# -- withdrawal: blocks whose bytes failed the origin's checks never stay in the tier -------
def test_a_withdrawn_block_is_deleted_and_never_served_by_this_node() -> None:
    store = MemoryObjects()
    a, b = tier(store), tier(store)
    key = a.layout.block_key(ref(1))

    async def main() -> None:
        await a.put(ref(1), block(1))
        await a.drain()
        assert key in store.objects
        before = publishes("withdrawn")
        await a.withdraw([ref(1)])
        assert publishes("withdrawn") == before + 1
        with trio.fail_after(5):
            while key in store.objects:
                await trio.sleep(0.01)
        assert await a.get(ref(1)) is None
        assert await b.get(ref(1)) is None  # gone for every node
        await a.put(ref(1), block(1))  # the block fetched again: published again
        await a.drain()
        assert await a.get(ref(1)) == block(1)
    run(main, a, b)


def test_a_withdrawn_block_whose_delete_fails_is_still_not_served_here() -> None:
    store = MemoryObjects()
    a = tier(store)
    key = a.layout.block_key(ref(0))

    async def main() -> None:
        await a.put(ref(0), block(0))
        await a.drain()
        store.gates["delete"] = threading.Event()  # deletes hang: answered after the test
        gets = store.counts["get"]
        await a.withdraw([ref(0)])
        assert await a.get(ref(0)) is None
        assert store.counts["get"] == gets  # not even asked
        assert key in store.objects
        store.gates["delete"].set()
    run(main, a)


def test_a_queued_publish_that_is_withdrawn_is_never_written() -> None:
    store = MemoryObjects()
    a = tier(store, publishers=1)
    store.gates["put"] = threading.Event()

    async def main() -> None:
        await a.put(ref(0), block(0))  # taken by the one publisher, held at the gate
        await a.put(ref(1), block(1))  # queued behind it
        await trio.sleep(0.05)
        await a.withdraw([ref(1)])
        assert a.queue.pending(a.layout.block_key(ref(1))) is None
        store.gates["put"].set()
        await a.drain()
    run(main, a)
    assert a.layout.block_key(ref(0)) in store.objects
    assert a.layout.block_key(ref(1)) not in store.objects


def test_a_publish_withdrawn_while_it_is_written_is_deleted_afterwards() -> None:
    store = MemoryObjects()
    a = tier(store, publishers=1)
    key = a.layout.block_key(ref(2))
    store.gates["put"] = threading.Event()

    async def main() -> None:
        await a.put(ref(2), block(2))
        await trio.sleep(0.05)  # the publisher is in the PUT
        await a.withdraw([ref(2)])
        store.gates["put"].set()
        await a.drain()
        with trio.fail_after(5):
            while key in store.objects:
                await trio.sleep(0.01)
        assert await a.get(ref(2)) is None
    run(main, a)
    assert store.counts["put"] == 1 and key not in store.objects


def _fetcher_over(tmp_path: Any, origin_store: Any, shared: SharedTier,
                  fn: Callable[[Any], Any]) -> Any:
    from cachefs.cache.blocks import BlockCache
    from cachefs.cache.lmdbenv import LmdbEnv
    from cachefs.read.budget import MemoryBudget
    from cachefs.read.fetcher import Fetcher
    from cachefs.s3.origin import Backoff, Origin

    env = LmdbEnv(tmp_path / "meta.lmdb")

    async def main() -> Any:
        cache = BlockCache(env, tmp_path, capacity=1 << 20)
        origin = Origin(origin_store, max_connections=4, deadline=30,
                        backoff=Backoff(base=0.001, cap=0.001))
        fetcher = Fetcher(origin, cache, block_size=BS, budget=MemoryBudget(1 << 20),
                          hot_capacity=0, lower_tiers=[shared])
        async with running(fetcher, shared):
            return await fn(fetcher)
    try:
        return trio.run(main)
    finally:
        env.close()


def _alter(origin_store: Any, which: set[int]) -> None:
    """Alter the bytes of the origin's GETs numbered in ``which`` (1-based), as in transit."""
    seen = [0]
    lock = threading.Lock()

    def mangle(key: str, data: bytes) -> bytes:
        with lock:
            seen[0] += 1
            n = seen[0]
        if n not in which:
            return data
        return data[:3] + bytes([data[3] ^ 0x55]) + data[4:]
    origin_store.mangle = mangle


def test_only_verified_whole_objects_reach_the_shared_tier(tmp_path: Any) -> None:
    from cachefs.s3.memory import MemoryStore

    origin_store = MemoryStore()
    data = bytes(range(256)) * 2
    origin_store.put("small.bin", data)
    info = origin_store.head("small.bin")
    obj = ObjectVersion("small.bin", info.etag, info.size)
    _alter(origin_store, {1})  # the first GET is altered: the ETag (MD5) check retries
    store = MemoryObjects()
    shared = tier(store)

    async def body(f: Any) -> None:
        assert await f.read(obj, 0, len(data)) == data

    _fetcher_over(tmp_path, origin_store, shared, body)
    key = shared.layout.block_key(BlockRef(obj, 0, len(data), b""))
    assert store.objects[key][0] == data and store.counts["put"] == 1


def test_blocks_of_an_object_failing_its_combined_crc_leave_the_shared_tier(
        tmp_path: Any) -> None:
    from cachefs.s3.memory import MemoryStore

    origin_store = MemoryStore()
    data = random_bytes(4 * BS + 10)
    origin_store.put("big.bin", data, checksum="crc64nvme")
    info = origin_store.head("big.bin")
    obj = ObjectVersion("big.bin", info.etag, info.size)
    _alter(origin_store, {2})  # one ranged GET altered in transit
    store = MemoryObjects()
    shared = tier(store)
    other = tier(store)  # another node on the same tier
    mismatches = metrics.S3_ASSEMBLED_CHECKS.labels("mismatch")._value.get()

    def keys() -> set[str]:
        return {k for k in store.objects if "/v1/" in k}

    async def body(f: Any) -> None:
        assert await f.read(obj, 0, len(data)) != data
        await f.drain()
        with trio.fail_after(10):
            while metrics.S3_ASSEMBLED_CHECKS.labels("mismatch")._value.get() == mismatches:
                await trio.sleep(0.01)
            while keys():  # every block deleted from the tier (published or not)
                await trio.sleep(0.01)
        assert not any(f.cache.contains(bid) for bid in f.block_ids(obj))
        for i in range(5):
            assert await other.get(f.ref(obj, i)) is None
        assert await f.read(obj, 0, len(data)) == data  # from the origin, right this time
        await f.drain()
        await shared.drain()
        assert len(keys()) == 5
        for i in range(5):
            assert await other.get(f.ref(obj, i)) == data[i * BS:(i + 1) * BS]

    _fetcher_over(tmp_path, origin_store, shared, body)


def random_bytes(n: int) -> bytes:
    import random
    return random.Random(3).randbytes(n)


def test_a_bad_block_from_the_tier_fails_the_combined_crc_of_a_reader_and_leaves(
        tmp_path: Any) -> None:
    # Another node published block 3 with bytes altered in its own ranged GET (its check
    # never completed). This node fetches blocks 0-2 from the origin and block 3 from the
    # tier: the object's combined CRC covers the tier's block too, and withdraws them all.
    from cachefs.s3.memory import MemoryStore

    origin_store = MemoryStore()
    data = random_bytes(4 * BS)
    origin_store.put("mixed.bin", data, checksum="crc64nvme")
    info = origin_store.head("mixed.bin")
    obj = ObjectVersion("mixed.bin", info.etag, info.size)
    store = MemoryObjects()
    shared = tier(store)
    other = tier(store)
    bad = bytearray(data[3 * BS:])
    bad[7] ^= 0x55
    mismatches = metrics.S3_ASSEMBLED_CHECKS.labels("mismatch")._value.get()

    async def publish_bad() -> None:
        await other.put(ref(3, obj), bytes(bad))
        await other.drain()
    run(publish_bad, other)
    key3 = other.layout.block_key(ref(3, obj))
    assert key3 in store.objects

    async def body(f: Any) -> None:
        # Block 0 first: the object's check starts (every block pending) before block 3
        # arrives from the tier.
        got = await f.read(obj, 0, BS) + await f.read(obj, BS, 3 * BS)
        assert got[:3 * BS] == data[:3 * BS] and got[3 * BS:] == bytes(bad)
        await f.drain()
        with trio.fail_after(10):
            while metrics.S3_ASSEMBLED_CHECKS.labels("mismatch")._value.get() == mismatches:
                await trio.sleep(0.01)
            while key3 in store.objects and store.objects[key3][0] == bytes(bad):
                await trio.sleep(0.01)
        assert not any(f.cache.contains(bid) for bid in f.block_ids(obj))
        assert await f.read(obj, 0, len(data)) == data  # all from the origin now

    _fetcher_over(tmp_path, origin_store, shared, body)

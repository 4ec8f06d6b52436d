"""Unit tests of cachefs.s3.origin over MemoryStore: deadlines, waits outside the connection
limit, adaptive concurrency, hedging, stopping, integrity retries (real worker threads)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import trio

from cachefs import metrics
from cachefs.errors import NoSuchKey, ObjectChanged, StoreError, TransientStoreError
from cachefs.s3 import origin as origin_mod
from cachefs.s3.memory import MemoryStore
from cachefs.s3.origin import AdaptiveLimit, Backoff, Origin
from cachefs.s3.store import Exchange

FAST = Backoff(base=0.01, cap=0.05)


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels or {}) or 0.0


def store_with(**objects: bytes) -> MemoryStore:
    s = MemoryStore()
    for k, v in objects.items():
        s.put(k, v)
    return s


def etag(store: MemoryStore, key: str) -> str:
    return store._objects[key][1].etag


# -- retries and deadlines ----------------------------------------------------------------
def test_good_request_does_not_wait_for_a_retrying_one() -> None:
    """A request retrying through an outage of one key must not keep others from the only
    connection: the waits are trio sleeps outside the limiter."""
    store = store_with(bad=b"b" * 10, good=b"g" * 10)
    store.fault = lambda op, key: (_ for _ in ()).throw(TransientStoreError("x")) \
        if key == "bad" else None
    origin = Origin(store, max_connections=1, deadline=30, backoff=Backoff(base=5.0, cap=5.0))
    took: list[float] = []

    async def main() -> None:
        async def bad() -> None:
            with pytest.raises(TransientStoreError, match="stopping"):
                await origin.get("bad", etag(store, "bad"), 0, 10)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(bad)
            await trio.sleep(0.2)
            t0 = time.monotonic()
            assert (await origin.get("good", etag(store, "good"), 0, 10)).data == b"g" * 10
            took.append(time.monotonic() - t0)
            origin.close()

    trio.run(main)
    assert took[0] < 2.0  # not behind the 5 s backoff of "bad"


def test_retries_run_until_the_deadline_then_fail() -> None:
    store = store_with(k=b"k")
    store.fault = lambda op, key: (_ for _ in ()).throw(TransientStoreError("500", reason="server_error"))
    origin = Origin(store, max_connections=4, deadline=0.5, backoff=FAST)
    before = sample("cachefs_s3_deadline_exceeded_total", {"op": "get"})
    retries = sample("cachefs_s3_retries_total", {"op": "get", "reason": "server_error"})

    async def main() -> float:
        t0 = trio.current_time()
        with pytest.raises(TransientStoreError, match="retry deadline"):
            await origin.get("k", etag(store, "k"), 0, 1)
        return trio.current_time() - t0

    elapsed = trio.run(main)
    assert elapsed >= 0.5
    assert store.calls["get"] > 5
    assert sample("cachefs_s3_deadline_exceeded_total", {"op": "get"}) == before + 1
    assert sample("cachefs_s3_retries_total", {"op": "get", "reason": "server_error"}) > retries


@pytest.mark.parametrize("error", [ObjectChanged("changed"), NoSuchKey("gone")])
def test_permanent_errors_are_not_retried(error: Exception) -> None:
    store = store_with(k=b"k")

    def fault(op: str, key: str) -> None:
        raise error

    store.fault = fault
    origin = Origin(store, max_connections=4, deadline=30, backoff=FAST)
    with pytest.raises(type(error)):
        trio.run(origin.get, "k", etag(store, "k"), 0, 1)
    assert store.calls["get"] == 1


def test_close_ends_retry_waits_at_once() -> None:
    store = store_with(k=b"k")
    store.fault = lambda op, key: (_ for _ in ()).throw(TransientStoreError("down"))
    origin = Origin(store, max_connections=4, deadline=600, backoff=Backoff(base=30, cap=30))

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            async def reader() -> None:
                with pytest.raises(TransientStoreError, match="stopping"):
                    await origin.get("k", etag(store, "k"), 0, 1)
            nursery.start_soon(reader)
            await trio.sleep(0.2)
            t0 = time.monotonic()
            origin.close()
        return time.monotonic() - t0

    assert trio.run(main) < 2.0


def test_close_aborts_a_request_stalled_in_its_thread() -> None:
    store = store_with(k=b"k")
    released = threading.Event()

    def stall(key: str, exchange: Exchange) -> None:
        while not exchange.aborted and not released.is_set():
            time.sleep(0.01)
        if exchange.aborted:
            raise TransientStoreError("aborted", reason="stopping")

    store.on_get = stall
    origin = Origin(store, max_connections=4, deadline=600, backoff=FAST)

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            async def reader() -> None:
                with pytest.raises(TransientStoreError, match="stopping"):
                    await origin.get("k", etag(store, "k"), 0, 1)
            nursery.start_soon(reader)
            await trio.sleep(0.3)
            t0 = time.monotonic()
            origin.close()
        return time.monotonic() - t0

    try:
        assert trio.run(main) < 2.0
    finally:
        released.set()


def test_cancelled_reader_does_not_wait_for_its_thread() -> None:
    store = store_with(k=b"k")
    aborted = threading.Event()

    def stall(key: str, exchange: Exchange) -> None:
        for _ in range(3000):
            if exchange.aborted:
                aborted.set()
                raise TransientStoreError("aborted", reason="stopping")
            time.sleep(0.01)

    store.on_get = stall
    origin = Origin(store, max_connections=4, deadline=600, backoff=FAST)

    async def main() -> float:
        t0 = time.monotonic()
        with trio.move_on_after(0.3):
            await origin.get("k", etag(store, "k"), 0, 1)
        return time.monotonic() - t0

    assert trio.run(main) < 2.0
    assert aborted.wait(5)  # the abandoned thread was told to stop


# -- adaptive concurrency -------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_throttling_cuts_the_limit_once_per_round_and_it_recovers() -> None:
    clock = Clock()
    limit = AdaptiveLimit(64, clock=clock)
    sent = clock.now
    clock.now += 0.1
    limit.throttled(sent)
    assert limit.limit == int(64 * origin_mod.DECREASE)
    limit.throttled(sent)  # sent before the cut: the same round, no second cut
    assert limit.limit == int(64 * origin_mod.DECREASE)
    for _ in range(12):  # every round of throttling cuts again, down to 1
        clock.now += 0.1
        limit.throttled(clock.now)
    assert limit.limit == 1
    assert limit.background.total_tokens == 1
    assert sample("cachefs_s3_concurrency_limit") == 1
    # Successes while throttling is recent grow it slowly (one per window)...
    for _ in range(10):
        limit.succeeded()
    assert limit.limit < 8
    # ...and once S3 has been calm for a while, quickly (slow start) back to the maximum.
    clock.now += origin_mod.CALM + 1
    for _ in range(200):
        limit.succeeded()
    assert limit.limit == 64
    assert limit.background.total_tokens == 48
    assert sample("cachefs_s3_concurrency_limit") == 64


def test_throttled_answers_lower_the_origins_limit() -> None:
    store = store_with(k=b"k")
    calls = {"n": 0}

    def fault(op: str, key: str) -> None:
        calls["n"] += 1
        if calls["n"] <= 6:
            raise TransientStoreError("503 SlowDown", throttled=True)

    store.fault = fault
    origin = Origin(store, max_connections=16, deadline=30, backoff=FAST)
    assert trio.run(origin.get, "k", etag(store, "k"), 0, 1).data == b"k"
    assert origin.limit.limit < 16


# -- hedging -----------------------------------------------------------------------------
def test_a_stalled_get_is_hedged_and_the_loser_aborted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(origin_mod, "HEDGE_FLOOR", 0.2)
    store = store_with(k=b"x" * 1000)
    first = {"done": False}
    lock = threading.Lock()
    aborted = threading.Event()

    def stall_first(key: str, exchange: Exchange) -> None:
        with lock:
            mine, first["done"] = not first["done"], True
        if mine:  # the first request: headers then silence, until aborted
            exchange.received()
            while not exchange.aborted:
                time.sleep(0.01)
            aborted.set()
            raise TransientStoreError("aborted", reason="stopping")

    store.on_get = stall_first
    origin = Origin(store, max_connections=4, deadline=600, backoff=FAST)
    sent = sample("cachefs_s3_hedges_sent_total")
    won = sample("cachefs_s3_hedges_won_total")

    async def main() -> float:
        t0 = time.monotonic()
        got = await origin.get("k", etag(store, "k"), 0, 1000, whole=True)
        assert got.data == b"x" * 1000
        assert got.check == "etag_md5"
        return time.monotonic() - t0

    assert trio.run(main) < 5.0
    assert aborted.wait(5)
    assert store.calls["get"] == 2
    assert sample("cachefs_s3_hedges_sent_total") == sent + 1
    assert sample("cachefs_s3_hedges_won_total") == won + 1


def test_a_slow_but_progressing_body_is_not_hedged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(origin_mod, "HEDGE_FLOOR", 0.2)
    store = store_with(k=b"y" * 100)

    def trickle(key: str, exchange: Exchange) -> None:
        for _ in range(15):  # 1.5 s in all, a byte every 0.1 s
            exchange.received()
            time.sleep(0.1)

    store.on_get = trickle
    origin = Origin(store, max_connections=4, deadline=600, backoff=FAST)
    sent = sample("cachefs_s3_hedges_sent_total")
    assert trio.run(origin.get, "k", etag(store, "k"), 0, 100).data == b"y" * 100
    assert store.calls["get"] == 1
    assert sample("cachefs_s3_hedges_sent_total") == sent


def test_hedge_delay_follows_observed_latency() -> None:
    tracker = origin_mod.LatencyTracker()
    assert tracker.hedge_delay == origin_mod.HEDGE_FLOOR
    for _ in range(100):
        tracker.observe(0.5)
    assert tracker.hedge_delay == pytest.approx(origin_mod.HEDGE_MULTIPLE * 0.5)
    assert tracker.idle_timeout == pytest.approx(origin_mod.IDLE_MULTIPLE * 0.5)
    for _ in range(300):
        tracker.observe(0.001)
    assert tracker.hedge_delay == origin_mod.HEDGE_FLOOR
    assert tracker.idle_timeout == origin_mod.IDLE_FLOOR


def answer_after(exchange: Exchange, seconds: float) -> None:
    """The fake S3's first byte, as if it came ``seconds`` after the request was sent
    (without waiting them: the latency the origin learns is the exchange's)."""
    exchange.received()
    assert exchange.first_byte_at is not None
    exchange.sent_at = exchange.first_byte_at - seconds


def test_answers_that_waited_through_an_outage_do_not_set_the_hedge_delay() -> None:
    """After an outage the hedge delay and idle timeout are those of S3 as it is now: the
    answers to requests that waited through it (sent before it began or during it, answered
    when S3 came back) measure the outage, not S3. (A 25 s outage left the delay at ~17 s on a
    mount making ~10 GETs/s: a GET going silent then was hedged only after 17 s.)"""
    usual, outage = 1.0, 20.0  # S3's first-byte latency; how long the silent requests waited
    store = store_with(**{f"k{i}": b"v%d" % i for i in range(8)}, refused=b"r")
    down = threading.Event()
    back = threading.Event()
    lock = threading.Lock()
    seen = {"silent": 0, "refused": 0}

    def fault(op: str, key: str) -> None:  # a new connection is refused while S3 is down
        if key == "refused" and down.is_set():
            with lock:
                seen["refused"] += 1
            raise TransientStoreError("refused", reason="unreachable")

    def on_get(key: str, exchange: Exchange) -> None:  # a connection that was open: silence
        if key != "refused" and down.is_set():
            with lock:
                seen["silent"] += 1
            back.wait(30)
            answer_after(exchange, outage)
        else:
            answer_after(exchange, usual)

    store.fault = fault
    store.on_get = on_get
    origin = Origin(store, max_connections=16, deadline=600, backoff=FAST)

    async def until(what: str, n: int) -> None:
        while seen[what] < n:
            await trio.sleep(0.01)

    async def read(key: str) -> None:
        assert (await origin.get(key, etag(store, key), 0, 2)).data == store._objects[key][0]

    async def main() -> None:
        for i in range(40):
            await read(f"k{i % 8}")
        assert origin.latency.hedge_delay == pytest.approx(origin_mod.HEDGE_MULTIPLE * usual)
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                down.set()
                for i in range(3):  # sent before the outage is known: answered after it
                    nursery.start_soon(read, f"k{i}")
                await until("silent", 3)
                nursery.start_soon(read, "refused")  # the outage is known: retries wait
                await until("refused", 2)
                for i in range(3, 6):  # sent during the outage
                    nursery.start_soon(read, f"k{i}")
                await until("silent", 6)
                down.clear()  # S3 is back: everything waiting is answered
                back.set()
        for i in range(20):  # S3 as it is now
            await read(f"k{i % 8}")

    trio.run(main)
    assert origin.latency.hedge_delay == pytest.approx(origin_mod.HEDGE_MULTIPLE * usual)
    assert origin.latency.idle_timeout == pytest.approx(origin_mod.IDLE_MULTIPLE * usual)
    assert sample("cachefs_s3_hedge_delay_seconds") == pytest.approx(
        origin_mod.HEDGE_MULTIPLE * usual)


def test_a_slow_but_answering_s3_still_raises_the_hedge_delay() -> None:
    """S3 slow to answer, and throttling, but answering: no outage, its latencies are what the
    hedge delay and idle timeout follow (hedging is not made trigger-happy by leaving out the
    answers that waited through an outage)."""
    slow = 2.0
    store = store_with(**{f"k{i}": b"v%d" % i for i in range(8)})
    throttles = {"left": 3}
    lock = threading.Lock()

    def fault(op: str, key: str) -> None:
        with lock:
            throttled = throttles["left"] > 0
            throttles["left"] -= 1
        if throttled:
            raise TransientStoreError("503 SlowDown", throttled=True)

    store.fault = fault
    store.on_get = lambda key, exchange: answer_after(exchange, slow)
    origin = Origin(store, max_connections=16, deadline=600, backoff=FAST)

    async def main() -> None:
        async def reader(n: int) -> None:
            for i in range(6):
                key = f"k{(n + i) % 8}"
                assert (await origin.get(key, etag(store, key), 0, 2)).data == store._objects[key][0]

        async with trio.open_nursery() as nursery:
            for n in range(4):
                nursery.start_soon(reader, n)

    trio.run(main)
    assert throttles["left"] < 0  # the throttled answers came, and were retried
    assert origin.latency.hedge_delay == pytest.approx(origin_mod.HEDGE_MULTIPLE * slow)
    assert origin.latency.idle_timeout == pytest.approx(origin_mod.IDLE_MULTIPLE * slow)
    assert sample("cachefs_s3_hedge_delay_seconds") == pytest.approx(
        origin_mod.HEDGE_MULTIPLE * slow)


def test_the_hedge_delay_and_its_metric_follow_every_sample() -> None:
    """The p99 is that of the window at every sample, not recomputed every 16 of them: one slow
    answer among 41 is their p99 at once, and so is the metric."""
    tracker = origin_mod.LatencyTracker()
    for _ in range(40):
        tracker.observe(0.1)
    assert tracker.hedge_delay == origin_mod.HEDGE_FLOOR
    assert sample("cachefs_s3_hedge_delay_seconds") == origin_mod.HEDGE_FLOOR
    tracker.observe(0.5)
    assert tracker.hedge_delay == pytest.approx(origin_mod.HEDGE_MULTIPLE * 0.5)
    assert sample("cachefs_s3_hedge_delay_seconds") == pytest.approx(origin_mod.HEDGE_MULTIPLE * 0.5)


def test_latencies_older_than_their_max_age_are_forgotten() -> None:
    """A burst of slow answers on a quiet mount raises the delay for LATENCY_MAX_AGE seconds,
    not until 256 more GETs; once every sample is that old, the floors (as on a new mount)."""
    clock = Clock()
    tracker = origin_mod.LatencyTracker(clock=clock)
    for _ in range(5):
        tracker.observe(3.0)  # a burst of slow answers
    clock.now += 10
    for _ in range(5):
        tracker.observe(0.5)
    assert tracker.hedge_delay == pytest.approx(origin_mod.HEDGE_MULTIPLE * 3.0)
    clock.now += origin_mod.LATENCY_MAX_AGE - 9  # the burst is older than that, the rest not
    assert tracker.hedge_delay == pytest.approx(origin_mod.HEDGE_MULTIPLE * 0.5)
    assert tracker.idle_timeout == origin_mod.IDLE_FLOOR
    assert sample("cachefs_s3_hedge_delay_seconds") == pytest.approx(origin_mod.HEDGE_MULTIPLE * 0.5)
    clock.now += 10
    assert tracker.p99 is None
    assert tracker.hedge_delay == origin_mod.HEDGE_FLOOR
    assert sample("cachefs_s3_hedge_delay_seconds") == origin_mod.HEDGE_FLOOR


# -- integrity ---------------------------------------------------------------------------
def flip_once(times: int = 1) -> Any:
    """Alter the first ``times`` answers, each at another place (as in transit)."""
    left = {"n": times}
    lock = threading.Lock()

    def mangle(key: str, data: bytes) -> bytes:
        with lock:
            if left["n"] <= 0:
                return data
            left["n"] -= 1
            at = left["n"] % len(data)
        return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]
    return mangle


@pytest.mark.parametrize("checksum", [None, "crc64nvme", "crc32", "crc32c", "sha256"])
def test_altered_whole_object_is_retried_never_returned(checksum: str | None) -> None:
    store = MemoryStore()
    data = bytes(range(256)) * 40
    store.put("k", data, checksum=checksum)
    store.mangle = flip_once(2)
    origin = Origin(store, max_connections=4, deadline=30, backoff=FAST)
    check = checksum or "etag_md5"
    errors = sample("cachefs_s3_integrity_errors_total", {"check": check})
    got = trio.run(lambda: origin.get("k", etag(store, "k"), 0, len(data), whole=True))
    assert got.data == data
    assert got.check == check
    assert store.calls["get"] == 3
    assert sample("cachefs_s3_integrity_errors_total", {"check": check}) == errors + 2


def test_ranged_gets_are_not_checked_but_may_carry_their_crc() -> None:
    from cachefs.s3 import integrity

    store = store_with(k=b"z" * 500)
    origin = Origin(store, max_connections=4, deadline=30, backoff=FAST)
    got = trio.run(lambda: origin.get("k", etag(store, "k"), 100, 300, crc_kind="crc64nvme"))
    assert got.data == b"z" * 200
    assert got.check == "none"
    assert got.crc == integrity.crc("crc64nvme", b"z" * 200)


def test_identical_answers_that_disagree_are_served_and_etag_checks_stop() -> None:
    store = MemoryStore()
    for i in range(origin_mod.MD5_DISAGREEMENTS_TO_STOP):
        store.put(f"k{i}", b"content %d" % i)
    # A server whose ETags are not MD5 digests: every answer "disagrees", identically.
    for i in range(origin_mod.MD5_DISAGREEMENTS_TO_STOP):
        key = f"k{i}"
        data, info, stated = store._objects[key]
        store._objects[key] = (data, type(info)(key, info.size, "0" * 32, info.mtime), stated)
    origin = Origin(store, max_connections=4, deadline=30, backoff=FAST)
    disagreements = sample("cachefs_s3_checksum_disagreements_total", {"check": "etag_md5"})

    async def main() -> None:
        for i in range(origin_mod.MD5_DISAGREEMENTS_TO_STOP):
            got = await origin.get(f"k{i}", "0" * 32, 0, len(b"content %d" % i), whole=True)
            assert got.data == b"content %d" % i
    trio.run(main)
    assert store.calls["get"] == 2 * origin_mod.MD5_DISAGREEMENTS_TO_STOP
    assert sample("cachefs_s3_checksum_disagreements_total",
                  {"check": "etag_md5"}) == disagreements + origin_mod.MD5_DISAGREEMENTS_TO_STOP
    assert not origin.check_etags


def test_listing_pages_are_retried_until_the_deadline() -> None:
    store = store_with(**{"d/a": b"a"})
    failures = {"left": 3}

    def fault(op: str, key: str) -> None:
        if op == "list" and failures["left"]:
            failures["left"] -= 1
            raise TransientStoreError("503 SlowDown", throttled=True)

    store.fault = fault
    origin = Origin(store, max_connections=4, deadline=30, backoff=FAST)
    page = trio.run(origin.list_page, "d/", None)
    assert [o.key for o in page.objects] == ["d/a"]
    assert store.calls["list"] == 4


def test_a_stated_checksum_that_disagrees_with_identical_bytes_fails_at_once() -> None:
    store = MemoryStore()
    store.put("k", b"stored bytes", checksum="crc64nvme")
    store.mangle = lambda key, data: b"other bytes!"  # the same wrong bytes every time
    origin = Origin(store, max_connections=4, deadline=600, backoff=FAST)
    with pytest.raises(StoreError, match="disagrees") as info:
        trio.run(lambda: origin.get("k", etag(store, "k"), 0, 12, whole=True))
    assert not isinstance(info.value, TransientStoreError)
    assert store.calls["get"] == 2


def test_requests_waiting_to_retry_go_as_soon_as_s3_answers_again() -> None:
    store = store_with(**{f"k{i}": b"v%d" % i for i in range(5)}, probe=b"p")
    down = {"on": True}

    def fault(op: str, key: str) -> None:
        if down["on"]:
            raise TransientStoreError("refused", reason="unreachable")

    store.fault = fault
    origin = Origin(store, max_connections=8, deadline=60,
                    backoff=Backoff(base=5.0, cap=5.0, network_cap=5.0))
    done: list[float] = []

    async def main() -> float:
        async def reader(i: int) -> None:
            got = await origin.get(f"k{i}", etag(store, f"k{i}"), 0, 2)
            assert got.data == b"v%d" % i
            done.append(time.monotonic())

        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(reader, i)
            await trio.sleep(0.3)  # all failed once; each waits up to 5 s to retry
            down["on"] = False
            back = time.monotonic()
            await origin.get("probe", etag(store, "probe"), 0, 1)  # S3 answers again
        return back

    back = trio.run(main)
    assert len(done) == 5
    assert max(done) - back < 2.0  # not their backoff


def test_waits_after_broken_connections_are_short_and_after_throttling_long() -> None:
    import random as random_mod

    backoff = Backoff()
    rng = random_mod.Random(1)
    network = [backoff.delay(20, rng, from_s3=False) for _ in range(200)]
    asked = [backoff.delay(20, rng, from_s3=True) for _ in range(200)]
    assert max(network) <= backoff.network_cap < 3
    assert max(asked) > 5 and max(asked) <= backoff.cap


# -- threads ------------------------------------------------------------------------------
def test_s3_threads_are_named_once_for_operators() -> None:
    """A thread making S3 requests carries the name ``cachefs-s3`` for Python and the OS
    (``top -H``, /proc), set at its first request and kept across requests, not set and
    reset around each one."""
    store = store_with(k=b"x" * 10)
    origin = Origin(store, max_connections=1, deadline=5, backoff=FAST)
    seen: list[tuple[str, str]] = []

    def note(op: str, key: str) -> None:  # runs in the request's thread
        comm = open(f"/proc/self/task/{threading.get_native_id()}/comm").read().strip()
        seen.append((threading.current_thread().name, comm))

    store.fault = note

    async def main() -> None:
        for _ in range(3):
            assert (await origin.get("k", etag(store, "k"), 0, 10)).data == b"x" * 10
        origin.close()

    trio.run(main)
    assert seen == [("cachefs-s3", "cachefs-s3")] * 3


def test_a_retry_is_cut_off_at_the_retry_deadline() -> None:
    """A retry whose answer does not come (an attempt's own timeouts run for seconds) ends
    at the retry deadline: a read waited the deadline and then that attempt's timeouts
    (12 s of retries under --retry-deadline 8s)."""
    store = store_with(k=b"k")
    calls = {"n": 0}
    silent: list[Exchange] = []

    def first_fails_then_silent(key: str, exchange: Exchange) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise TransientStoreError("reset", reason="connection")
        silent.append(exchange)
        while not exchange.aborted:  # no answer until the request is given up
            time.sleep(0.01)
        raise TransientStoreError("aborted", reason="timeout")

    store.on_get = first_fails_then_silent
    origin = Origin(store, max_connections=4, deadline=0.5, backoff=FAST)

    async def main() -> str:
        # (fail_after: before, the silent attempt never ended)
        with trio.fail_after(10), pytest.raises(TransientStoreError) as info:
            await origin.get("k", etag(store, "k"), 0, 1)
        return str(info.value)

    message = trio.run(main)
    assert "(retry deadline): " in message and "no answer by the retry deadline" in message
    assert silent and all(exchange.aborted for exchange in silent)  # cut off, not waited out


def test_what_just_gave_up_gets_a_last_try_not_a_new_deadline() -> None:
    """The kernel asks again for a read that failed: the same object's request moments
    after it gave up at the deadline gets a last try of at most LAST_TRY seconds while S3
    has answered nothing since (it waited the whole deadline again). Other objects get
    their own deadline, and the object reads again once S3 answers."""
    store = store_with(k=b"k", other=b"o", ok=b"y")
    down = {"on": True}

    def fault(op: str, key: str) -> None:
        if down["on"] and key != "ok":
            raise TransientStoreError("500", reason="server_error")

    store.fault = fault
    origin = Origin(store, max_connections=4, deadline=1.0, backoff=FAST)
    origin_mod_last_try = origin_mod.LAST_TRY
    origin_mod.LAST_TRY = 0.2

    async def failure(key: str) -> str:
        with pytest.raises(TransientStoreError) as info:
            await origin.get(key, etag(store, key), 0, 1)
        return str(info.value)

    async def main() -> None:
        assert "(retry deadline)" in await failure("k")
        # asked again at once: a last try, no deadline of its own
        assert "(a last try after giving up moments ago)" in await failure("k")
        down["on"] = False
        # S3 is back: the same object's request moments later (a reader's retry) reads
        assert (await origin.get("k", etag(store, "k"), 0, 1)).data == b"k"
        down["on"] = True
        assert "(retry deadline)" in await failure("other")  # another object: its own

    try:
        trio.run(main)
    finally:
        origin_mod.LAST_TRY = origin_mod_last_try


def test_requests_giving_up_at_the_deadline_log_one_line_per_interval(caplog: Any) -> None:
    """An outage past the deadline gave up hundreds of prefetches, an ERROR line each: one
    line per operation and interval now, naming how many more gave up since."""
    store = store_with(**{f"k{i}": b"k" for i in range(6)})
    store.fault = lambda op, key: (_ for _ in ()).throw(TransientStoreError("500", reason="server_error"))
    origin = Origin(store, max_connections=8, deadline=0.2, backoff=FAST)
    before = sample("cachefs_s3_deadline_exceeded_total", {"op": "get"})

    async def main() -> None:
        async def one(i: int) -> None:
            with pytest.raises(TransientStoreError, match="retry deadline"):
                await origin.get(f"k{i}", etag(store, f"k{i}"), 0, 1)

        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(one, i)
        origin_mod._LOG_EVERY, every = 0.0, origin_mod._LOG_EVERY
        try:
            await one(5)
        finally:
            origin_mod._LOG_EVERY = every

    with caplog.at_level("ERROR", logger="cachefs.s3.origin"):
        trio.run(main)
    lines = [r.getMessage() for r in caplog.records if "giving up" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "4 more S3 get requests gave up" in lines[1], lines
    assert sample("cachefs_s3_deadline_exceeded_total", {"op": "get"}) == before + 6


# -- GETs driven by callbacks (Origin.get_soon) ----------------------------------------------
class Spawned:
    """A trio instrument counting the tasks spawned while it is on."""

    def __init__(self) -> None:
        self.n = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.n += 1


async def soon(origin: Origin, key: str, etag_: str, start: int, end: int,
               spawned: Spawned | None = None, **kw: Any) -> Any:
    """``origin.get_soon`` under a running ``run_soon``, awaited: its Got, or its error
    raised. ``spawned`` counts the tasks spawned between its start and its answer."""
    told: list[tuple[Any, BaseException | None]] = []
    answered = trio.Event()

    def done(got: Any, error: BaseException | None) -> None:
        told.append((got, error))
        answered.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(origin.run_soon)
        if spawned is not None:
            trio.lowlevel.add_instrument(spawned)
        try:
            assert origin.get_soon(key, etag_, start, end, done=done, **kw)
            await answered.wait()
        finally:
            if spawned is not None:
                trio.lowlevel.remove_instrument(spawned)
        await trio.sleep(0.05)  # (told once: a second call would show)
        nursery.cancel_scope.cancel()
    assert len(told) == 1
    got, error = told[0]
    if error is not None:
        raise error
    return got


def test_a_get_driven_by_callbacks_answers_as_get_does_without_a_task() -> None:
    """The whole-object GET of a cold small file, checked and handed to its sink in the
    worker thread, answered on the trio thread with no task spawned for it."""
    store = MemoryStore()
    data = bytes(range(256)) * 40
    store.put("k", data, checksum="crc64nvme")
    origin = Origin(store, max_connections=4, deadline=30, backoff=FAST)
    sunk: list[bytes] = []
    spawned = Spawned()
    verified = sample("cachefs_s3_verified_bytes_total", {"check": "crc64nvme"})
    got = trio.run(lambda: soon(origin, "k", etag(store, "k"), 0, len(data), spawned,
                                whole=True, background=True, sink=sunk.append))
    assert got.data == data and got.check == "crc64nvme"
    assert sunk == [data]
    assert store.calls["get"] == 1
    assert spawned.n == 0
    assert sample("cachefs_s3_verified_bytes_total", {"check": "crc64nvme"}) == \
        verified + len(data)
    assert origin.limit.all.available_tokens == 4  # (its connection given back)
    assert origin.limit.background.available_tokens == 3


def test_a_get_driven_by_callbacks_is_refused_where_get_alone_goes() -> None:
    """No run_soon, a closed origin or a failing S3: get_soon starts nothing (the caller
    asks get, whose paths those are)."""
    store = store_with(k=b"k")
    origin = Origin(store, max_connections=1, deadline=30, backoff=FAST)

    def done(got: Any, error: BaseException | None) -> None:
        raise AssertionError("told")

    async def main() -> None:
        assert not origin.get_soon("k", etag(store, "k"), 0, 1, done=done)  # no run_soon
        async with trio.open_nursery() as nursery:
            await nursery.start(origin.run_soon)
            origin._outage = True
            assert not origin.get_soon("k", etag(store, "k"), 0, 1, done=done)
            origin._outage = False
            origin._gave_up["s3://bucket/other"] = trio.current_time()
            assert not origin.get_soon("k", etag(store, "k"), 0, 1, done=done)
            origin._gave_up.clear()
            origin.close()
            assert not origin.get_soon("k", etag(store, "k"), 0, 1, done=done)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert store.calls["get"] == 0
    assert origin.limit.all.available_tokens == 1


def test_gets_driven_by_callbacks_wait_for_a_connection_behind_tasks_in_order() -> None:
    """With no connection free, a GET of get_soon waits (no task) and is sent once one is
    given back, after a task already waiting for one (a demand read) and before a later
    GET of its kind; one still waiting at its deadline fails there; one still waiting
    when cachefs stops is told so at once."""
    store = store_with(a=b"a", b=b"b", c=b"c", t=b"t", late=b"l", stop=b"s")
    order: list[str] = []

    def fault(op: str, key: str) -> None:
        order.append(key)

    store.fault = fault
    origin = Origin(store, max_connections=1, deadline=30, backoff=FAST)
    told: dict[str, Any] = {}

    def done_for(key: str) -> Any:
        return lambda got, error: told.__setitem__(key, got.data if got else error)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(origin.run_soon)
            origin.limit.all.acquire_on_behalf_of_nowait("someone")

            async def task_get() -> None:
                told["t"] = (await origin.get("t", etag(store, "t"), 0, 1)).data

            nursery.start_soon(task_get)
            await trio.sleep(0.05)  # (the task waits in the limiter)
            for key in ("a", "b", "c"):
                assert origin.get_soon(key, etag(store, key), 0, 1, done=done_for(key))
            await trio.sleep(0.1)
            assert store.calls["get"] == 0 and not told
            origin.limit.all.release_on_behalf_of("someone")
            while len(told) < 4:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert told == {"t": b"t", "a": b"a", "b": b"b", "c": b"c"}
    assert order == ["t", "a", "b", "c"]
    assert origin.limit.all.available_tokens == 1

    origin = Origin(store, max_connections=1, deadline=0.5, backoff=FAST)

    async def waits() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(origin.run_soon)
            origin.limit.all.acquire_on_behalf_of_nowait("someone")
            assert origin.get_soon("late", etag(store, "late"), 0, 1, done=done_for("late"))
            await trio.sleep(1.0)
            assert isinstance(told["late"], TransientStoreError)
            assert "retry deadline" in str(told["late"])
            assert origin._gave_up  # (remembered: get alone makes the next request ...)
            origin._gave_up.clear()  # (... until S3 answers again)
            assert origin.get_soon("stop", etag(store, "stop"), 0, 1, done=done_for("stop"))
            origin.close()
            assert isinstance(told["stop"], TransientStoreError)
            assert "stopping" in str(told["stop"])
            origin.limit.all.release_on_behalf_of("someone")
            nursery.cancel_scope.cancel()

    trio.run(waits)
    assert "late" not in order and "stop" not in order


def test_a_get_driven_by_callbacks_waiting_long_for_a_connection_takes_its_turn_as_a_task(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Tasks that come to the limiter after a GET of get_soon started waiting in its queue
    go first (the limiter hands a connection given back to a waiting task at once): one
    that waited SOON_QUEUE_WAIT becomes a task in the limiter, so later tasks no longer
    overtake it, and a steady stream of them cannot hold it back until its deadline."""
    from cachefs.s3 import origin as origin_module

    monkeypatch.setattr(origin_module, "SOON_QUEUE_WAIT", 0.3)
    store = store_with(**{k: k.encode() for k in ("t0", "soon", "t1", "t2", "t3")})
    order: list[str] = []
    store.fault = lambda op, key: order.append(key)
    origin = Origin(store, max_connections=1, deadline=30, backoff=FAST)
    told: dict[str, Any] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(origin.run_soon)
            origin.limit.all.acquire_on_behalf_of_nowait("someone")

            async def task_get(key: str) -> None:
                told[key] = (await origin.get(key, etag(store, key), 0, 1)).data

            nursery.start_soon(task_get, "t0")  # (already waiting: goes first)
            await trio.sleep(0.05)
            assert origin.get_soon("soon", etag(store, "soon"), 0, 1,
                                   done=lambda got, error: told.__setitem__(
                                       "soon", got.data if got else error))
            await trio.sleep(0.5)  # (past its wait: a task in the limiter now)
            for key in ("t1", "t2", "t3"):  # (tasks that came after it)
                nursery.start_soon(task_get, key)
                await trio.sleep(0.02)
            origin.limit.all.release_on_behalf_of("someone")
            while len(told) < 5:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert order == ["t0", "soon", "t1", "t2", "t3"]
    assert told["soon"] == b"s"
    assert origin.limit.all.available_tokens == 1


def test_a_get_driven_by_callbacks_is_retried_after_a_failed_first_attempt() -> None:
    store = store_with(k=b"v" * 100)
    failures = {"left": 2}

    def fault(op: str, key: str) -> None:
        if op == "get" and failures["left"]:
            failures["left"] -= 1
            raise TransientStoreError("503 Service Unavailable", reason="server_error")

    store.fault = fault
    origin = Origin(store, max_connections=4, deadline=30, backoff=FAST)
    retries = sample("cachefs_s3_retries_total", {"op": "get", "reason": "server_error"})
    got = trio.run(lambda: soon(origin, "k", etag(store, "k"), 0, 100, whole=True))
    assert got.data == b"v" * 100
    assert store.calls["get"] == 3
    assert sample("cachefs_s3_retries_total", {"op": "get", "reason": "server_error"}) == \
        retries + 2
    assert not origin._outage  # (answered: the outage the failures began is over)


@pytest.mark.parametrize("checksum", [None, "crc64nvme"])
def test_altered_bytes_of_a_get_driven_by_callbacks_are_retried_never_returned(
        checksum: str | None) -> None:
    store = MemoryStore()
    data = bytes(range(256)) * 40
    store.put("k", data, checksum=checksum)
    store.mangle = flip_once(2)
    origin = Origin(store, max_connections=4, deadline=30, backoff=FAST)
    sunk: list[bytes] = []
    got = trio.run(lambda: soon(origin, "k", etag(store, "k"), 0, len(data), whole=True,
                                sink=sunk.append))
    assert got.data == data
    assert sunk == [data]  # (altered bytes never reach the cache)
    assert store.calls["get"] == 3


def test_a_get_driven_by_callbacks_fails_at_once_on_a_permanent_error() -> None:
    store = store_with(k=b"old")
    old = etag(store, "k")
    store.put("k", b"new")
    origin = Origin(store, max_connections=4, deadline=30, backoff=FAST)
    with pytest.raises(ObjectChanged):
        trio.run(lambda: soon(origin, "k", old, 0, 3, whole=True))
    assert store.calls["get"] == 1
    origin = Origin(store, max_connections=4, deadline=30, backoff=FAST)  # (one per run)
    with pytest.raises(NoSuchKey):
        trio.run(lambda: soon(origin, "gone", old, 0, 3, whole=True))
    assert store.calls["get"] == 2


def stall_first_n(n: int, aborted: threading.Event) -> Any:
    """An ``on_get``: the first ``n`` requests send their headers, then silence until
    aborted."""
    count = {"n": 0}
    lock = threading.Lock()

    def on_get(key: str, exchange: Exchange) -> None:
        with lock:
            count["n"] += 1
            mine = count["n"] <= n
        if mine:
            exchange.received()
            while not exchange.aborted:
                time.sleep(0.01)
            aborted.set()
            raise TransientStoreError("aborted", reason="stopping")
    return on_get


def test_a_silent_get_driven_by_callbacks_is_hedged_and_the_loser_aborted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(origin_mod, "HEDGE_FLOOR", 0.2)
    store = store_with(k=b"x" * 1000)
    aborted = threading.Event()
    store.on_get = stall_first_n(1, aborted)
    origin = Origin(store, max_connections=4, deadline=600, backoff=FAST)
    sent = sample("cachefs_s3_hedges_sent_total")
    won = sample("cachefs_s3_hedges_won_total")

    async def main() -> float:
        t0 = time.monotonic()
        got = await soon(origin, "k", etag(store, "k"), 0, 1000, whole=True)
        assert got.data == b"x" * 1000
        return time.monotonic() - t0

    took = trio.run(main)
    assert 0.2 <= took < 5.0  # (not before the hedge delay)
    assert aborted.wait(5)
    assert store.calls["get"] == 2
    assert sample("cachefs_s3_hedges_sent_total") == sent + 1
    assert sample("cachefs_s3_hedges_won_total") == won + 1


def test_a_get_driven_by_callbacks_silent_past_the_deadline_fails_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its first attempt is cut at the retry deadline (its hedge too), with the
    deadline's error and count, and its requests are aborted."""
    monkeypatch.setattr(origin_mod, "HEDGE_FLOOR", 0.2)
    store = store_with(k=b"x" * 10)
    aborted = threading.Event()
    store.on_get = stall_first_n(100, aborted)
    origin = Origin(store, max_connections=4, deadline=0.8, backoff=FAST)
    exceeded = sample("cachefs_s3_deadline_exceeded_total", {"op": "get"})

    async def main() -> float:
        t0 = time.monotonic()
        with pytest.raises(TransientStoreError, match="retry deadline"):
            await soon(origin, "k", etag(store, "k"), 0, 10, whole=True)
        return time.monotonic() - t0

    took = trio.run(main)
    assert 0.8 <= took < 3.0
    assert aborted.wait(5)
    assert store.calls["get"] == 2  # the GET and its hedge, both cut
    assert sample("cachefs_s3_deadline_exceeded_total", {"op": "get"}) == exceeded + 1


@pytest.mark.parametrize("how", ["close", "cancel"])
def test_a_get_driven_by_callbacks_ends_at_once_when_cachefs_stops(how: str) -> None:
    """Origin.close (unmount) or the end of run_soon (the fetcher's): the GET in flight
    is aborted and told "cachefs is stopping" at once, not at its deadline."""
    store = store_with(k=b"x" * 10)
    aborted = threading.Event()
    store.on_get = stall_first_n(100, aborted)
    origin = Origin(store, max_connections=4, deadline=600, backoff=FAST)
    told: list[BaseException | None] = []

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            await nursery.start(origin.run_soon)
            assert origin.get_soon("k", etag(store, "k"), 0, 10, whole=True,
                                   done=lambda got, error: told.append(error))
            await trio.sleep(0.3)
            t0 = time.monotonic()
            if how == "close":
                origin.close()
                while not told:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        return time.monotonic() - t0

    assert trio.run(main) < 2.0
    assert len(told) == 1
    assert isinstance(told[0], TransientStoreError) and "stopping" in str(told[0])
    assert aborted.wait(5)


def test_landings_of_gets_driven_by_callbacks_wake_the_trio_thread_together() -> None:
    """GETs of get_soon that land while the first of them waits to be handed over (a 64th
    of S3's p99 first-byte latency, at most 2 ms) are handed to the trio thread with it,
    in one wake-up: each is answered once, with its bytes. Without latency samples none
    waits; a GET a task waits for (get) is handed over alone, at once."""
    store = MemoryStore()
    for i in range(20):
        store.put(f"k{i}", bytes([i]) * 1000)
    together = threading.Barrier(20, timeout=10)

    def fault(op: str, key: str) -> None:  # (the 20 GETs land within moments of each other)
        if op == "get" and key.startswith("k"):
            together.wait()

    store.fault = fault
    origin = Origin(store, max_connections=64, deadline=30, backoff=FAST)
    assert origin.latency.gather == 0  # (no samples: nothing waits)
    origin.latency.observe(0.5)
    assert origin.latency.gather == origin_mod.GATHER_MAX
    origin.latency.observe(0.032)
    origin.latency._samples.clear()
    origin.latency._ordered.clear()
    origin.latency.observe(0.064)
    assert origin.latency.gather == pytest.approx(0.001)
    origin.latency.observe(0.5)
    handed: list[int] = []
    take = origin._take_landings

    def counted() -> None:
        handed.append(len(origin._landings))
        take()

    origin._take_landings = counted  # type: ignore[method-assign]
    told: dict[str, list[Any]] = {}

    async def main() -> None:
        everyone = trio.Event()

        def done_for(key: str) -> Any:
            def done(got: Any, error: BaseException | None) -> None:
                told.setdefault(key, []).append(got.data if error is None else error)
                if len(told) == 20:
                    everyone.set()
            return done

        async with trio.open_nursery() as nursery:
            await nursery.start(origin.run_soon)
            for i in range(20):
                assert origin.get_soon(f"k{i}", etag(store, f"k{i}"), 0, 1000,
                                       done=done_for(f"k{i}"), whole=True, background=True)
            with trio.fail_after(10):
                await everyone.wait()
            assert len(handed) <= 3 and sum(handed) == 20, handed
            store.put("alone", b"x" * 10)
            got = await origin.get("alone", etag(store, "alone"), 0, 10, whole=True)
            assert got.data == b"x" * 10
            assert sum(handed) == 20  # (not gathered)
            await trio.sleep(0.05)  # (told once: a second call would show)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert told == {f"k{i}": [bytes([i]) * 1000] for i in range(20)}
    assert origin.limit.all.available_tokens == 64

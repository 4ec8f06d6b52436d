"""Async S3 requests: retries until a deadline, adaptive concurrency, hedged GETs.

:class:`Origin` is how the rest of cachefs talks to S3 at run time (the
fetcher's block GETs, the metadata listings, the checksum HEADs). It runs the
blocking calls of an :class:`~cachefs.s3.store.ObjectStore` in worker threads
and decides when, how often and how many of them are sent.

**Retries.** A transient failure (5xx, 503 SlowDown / 429, a reset or refused
connection, a timeout, a short body, bytes that fail their checksum) is
retried until the request's deadline (``--retry-deadline``, counted from its
first attempt), not a fixed number of times. The waits are exponential
backoff with full jitter, U(0, min(cap, base * 2**n)), each a ``trio.sleep``
taken while holding no connection slot; the cap is 10 s after S3 asked for
less (throttling, 5xx) and 2 s after a refused, reset or silent connection. The last attempt is made at the
deadline; if it fails too, its error is raised (EIO at the FUSE layer).
When S3 answers again after an outage (not after throttling), every request
waiting to retry is woken at once, so reads resume as soon as S3 is back
rather than after their backoff.
Permanent errors (ObjectChanged -> ESTALE, NoSuchKey, AccessDenied...) are
raised at once.

**Adaptive concurrency** (:class:`AdaptiveLimit`). Requests in flight are
bounded by a limit that starts at ``--max-connections``. A throttled answer
(503 SlowDown, 429) cuts it to :data:`DECREASE` of itself, at most once per
round (only a request sent after the last cut may cut again); each success
adds 1/limit (one per round of the whole window), and once no throttle has
been seen for :data:`CALM` seconds each success adds 1 (slow start) until the
maximum is back. It is the AIMD of the AWS SDKs' adaptive retry mode, applied
to the number of connections instead of a request rate: throttling slows
cachefs down instead of failing reads.

**Hedging** (:class:`LatencyTracker`, "The Tail at Scale"). A GET whose answer
has been silent (no first byte, or no further byte of its body) for longer
than max(:data:`HEDGE_FLOOR`, :data:`HEDGE_MULTIPLE` x p99 of recent
first-byte latencies) gets a second request on another connection; the first
complete answer wins and the other is aborted (its socket shut down). Hedges
use only spare connections, and at most :data:`HEDGE_SHARE` of requests (a
token bucket with a burst of :data:`HEDGE_BURST`). A slow but progressing
body is neither hedged nor killed: the socket timeout is an idle timeout
between bytes, max(:data:`IDLE_FLOOR`, :data:`IDLE_MULTIPLE` x p99), at most
:data:`IDLE_CAP`, never a bound on a whole answer. Recent latencies: those of
the last 256 answers, none older than :data:`LATENCY_MAX_AGE`, and none of an
attempt in flight at any moment of an outage (from a failure that is not
throttling until S3 answers again): answered when S3 came back, it measures
the outage, not S3 (:meth:`Origin._landed`). Slow answers while S3 answers,
throttling included, raise the delay as they should.

**Integrity.** A whole-object GET is checked in its worker thread against
what S3 stated (:func:`cachefs.s3.integrity.check_whole`); a mismatch is a
transient failure (counted, retried, never returned). If two answers carry
the very same bytes and both disagree, S3's statement, not the transfer, is
wrong: the bytes are served, logged and counted, and after
:data:`MD5_DISAGREEMENTS_TO_STOP` such objects ETags are no longer taken for
MD5 digests on this mount (some S3-compatible servers make other ETags).
Ranged GETs may compute a block CRC in the worker thread for the caller's
full-object check (see :mod:`cachefs.read.assembled`).

**Stopping.** :meth:`Origin.close` (unmount) aborts every request in flight
and ends every retry wait: callers get TransientStoreError("cachefs is
stopping") at once. Worker threads are abandoned when their caller is
cancelled, after their socket is shut down, so neither unmount nor a cancelled
reader waits for a blocked thread; an abandoned thread keeps its connection
slot (and background slot) until it returns.

**Threads.** Each request runs in a thread of trio's thread cache
(``trio.lowlevel.start_thread_soon``); its outcome is handed to the trio thread
with ``run_sync_soon`` (:meth:`Origin._landed`), where the waiting task is
rescheduled; the landings of :meth:`Origin.get_soon`'s GETs are gathered for up to
:data:`GATHER_MAX` and handed over together (:meth:`Origin._start`): each hand-over
wakes the trio thread. No task, nursery or cancel scope is made per request beyond the
waiting task's own: the trio thread's cost per GET bounds cold small-file
throughput. A thread is named ``cachefs-s3`` once, at its first request
(:func:`_name_thread`), not per request.

**GETs driven by callbacks** (:meth:`Origin.get_soon`: the fetcher's loads of
cold small files found not on disk). Not even a waiting task: the GET is sent
at once (or, with no connection free, when one is given back, behind the tasks
waiting in the limiter; after :data:`SOON_QUEUE_WAIT` as a task in the limiter's
order), its landing answers it through a callback on the trio
thread, and one task (:meth:`Origin.run_soon`, owned by the fetcher) watches
every such GET in flight: it sends the hedge of one silent for the hedge delay
and cuts one at the retry deadline, as :meth:`Origin._hedged` and
:meth:`Origin._retrying` do for a task. A first attempt that fails is retried
by a task of that watcher's nursery, from that failure and with the same
deadline; so every other path (outage, backoff, last try, the log) is
:meth:`Origin.get`'s own code. Such a GET is told its outcome exactly once:
its answer, its error, or "cachefs is stopping" (:meth:`Origin.close`, or the
watcher's end).

Concurrency: everything here runs on the trio thread, except the functions
handed to worker threads, which touch only their arguments, the Exchange and
(to deliver their outcome) the trio token, and for gathered landings
``_landings`` and ``_landings_due`` under ``_landings_lock`` and
``LatencyTracker.gather`` (read).
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import dataclasses
import functools
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import outcome
import trio

from cachefs import metrics
from cachefs.errors import IntegrityError, StoreError, TransientStoreError
from cachefs.s3 import integrity
from cachefs.s3.integrity import Checksum
from cachefs.s3.store import Body, Exchange, ListPage, ObjectInfo, ObjectStore

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Default ``--retry-deadline`` (5 minutes): more than twice the 2 minutes of outage or
#: throttling reads must ride out (503 storms, endpoint and NAT failovers last seconds
#: to minutes; longer outages are regional incidents lasting hours, which no deadline
#: rides out). It also bounds how long a process stuck in a read ignores even kill -9
#: (the kernel waits uninterruptibly for a FUSE request the daemon has taken), and stays
#: at half of PyTorch's 10-minute NCCL collective timeout, so the failing rank's own log
#: says why before its peers' watchdog fires.
DEFAULT_DEADLINE = 300.0
DECREASE = 0.7  # the SDKs' CUBIC beta
CALM = 5.0  # seconds without throttling before the limit grows fast again
HEDGE_FLOOR = 1.0
HEDGE_MULTIPLE = 4.0
#: Seconds after which a first-byte latency no longer counts (LatencyTracker). A mount
#: reading from S3 fills the 256-sample window in less (~25 s at the ~10 GETs/s of one
#: reading large shard blocks, a quiet one), so this changes only quieter mounts: they
#: forget a burst of slow answers as soon as such a mount does, not after 256 more GETs
#: (many minutes, or never on a mount gone idle). Not shorter: a mount making a GET every
#: few seconds still takes its p99 from several answers, not the last one alone.
LATENCY_MAX_AGE = 30.0
IDLE_FLOOR = 5.0
IDLE_MULTIPLE = 10.0
IDLE_CAP = 30.0
HEDGE_SHARE = 0.1
HEDGE_BURST = 10.0
MD5_DISAGREEMENTS_TO_STOP = 3
#: Seconds (at most the retry deadline) after a request gave up at the deadline during
#: which a request for the same thing, S3 silent since, gets a last try (Origin._retrying) ...
GAVE_UP_MEMORY = 5.0
#: ... and has this long (seconds), retries included, instead of the deadline.
LAST_TRY = 2.0
#: Seconds a GET of :meth:`Origin.get_soon` waits for a connection in its own queue before
#: it becomes a task waiting in the limiter: tasks that come to the limiter while it waits
#: go first (the limiter hands a connection given back to a waiting task at once), so a
#: stream of them (demand reads) could hold it back until its deadline; once a task, it
#: takes its turn in the limiter's order.
SOON_QUEUE_WAIT = 1.0
#: ... remembered for this many places (objects, listings) at most.
GAVE_UP_KEPT = 4096
#: The landing of a GET of :meth:`Origin.get_soon` that finds no other landing waiting
#: to be handed to the trio thread waits in its worker thread this share of S3's
#: first-byte latency (p99) ... (see Origin._start)
GATHER_SHARE = 1 / 64
#: ... and at most this long (seconds), so that the landings within it wake the trio
#: thread once: each wake-up costs it ~50 us of CPU on top of a landing's own work
#: (benchmarks/RESULTS.md, twenty-seventh round).
GATHER_MAX = 0.002
_LOG_EVERY = 10.0  # seconds between "still failing" lines per operation
#: The name of a worker thread that makes S3 requests (``top -H``, the benchmarks).
_THREAD_NAME = "cachefs-s3"
_PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True)
# Metric children bound once (a labels() lookup costs ~2 us per GET).
_VERIFIED_BYTES = {check: metrics.S3_VERIFIED_BYTES.labels(check)
                   for check in (*integrity.CHECKS, "etag_md5", "none")}


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter: wait U(0, min(cap, base * 2**n)).

    ``cap`` bounds the waits after S3 itself asked for less (503 SlowDown, 429, 5xx);
    ``network_cap`` those after a refused, reset or silent connection, which cost S3
    nothing: it is what bounds how long reads lag behind an endpoint that comes back."""

    base: float = 0.2
    cap: float = 10.0
    network_cap: float = 2.0

    def delay(self, attempt: int, rng: random.Random, *, from_s3: bool = True) -> float:
        cap = self.cap if from_s3 else min(self.cap, self.network_cap)
        return rng.uniform(0, min(cap, self.base * 2.0 ** min(attempt, 32)))


class LatencyTracker:
    """Recent first-byte latencies; the hedge delay and idle timeout derive from their p99.

    Recent: the last ``window`` samples, none older than :data:`LATENCY_MAX_AGE` seconds (with
    none, the floors, as on a new mount). What is a sample is the caller's call: the
    :class:`Origin` leaves out answers that waited through an outage (:meth:`Origin._landed`).
    The p99 is that of the window at every sample and every read (a sorted copy of the window
    is kept, each sample inserted and removed by bisection: no sort), and
    ``cachefs_s3_hedge_delay_seconds`` is set whenever the hedge delay changes: at a sample,
    or when samples age out (seen at the next read of the delay or timeout, that is the next
    request; a mount that makes none shows the delay its last request had). Trio thread only.
    """

    def __init__(self, window: int = 256, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._window = window
        self._clock = clock
        # (when observed, seconds), oldest first; and the same seconds in order
        self._samples: deque[tuple[float, float]] = deque()
        self._ordered: list[float] = []
        self._p99: float | None = None
        self._delay = self._hedge_delay()
        #: How long a GET's landing of get_soon waits to be handed over with others (see
        #: Origin._start): GATHER_SHARE of the p99, at most GATHER_MAX; 0 without
        #: samples. Written with the p99; read by worker threads (one attribute read).
        self.gather = 0.0
        metrics.S3_HEDGE_DELAY.set(self._delay)

    def observe(self, seconds: float) -> None:
        now = self._clock()
        self._samples.append((now, seconds))
        bisect.insort(self._ordered, seconds)
        if len(self._samples) > self._window:
            self._drop_oldest()
        self._forget(now)
        self._changed()

    def _drop_oldest(self) -> None:
        _, seconds = self._samples.popleft()
        del self._ordered[bisect.bisect_left(self._ordered, seconds)]

    def _forget(self, now: float) -> bool:
        """Drop the samples older than :data:`LATENCY_MAX_AGE`; whether there were any."""
        samples = self._samples
        oldest = now - LATENCY_MAX_AGE
        if not samples or samples[0][0] > oldest:
            return False
        while samples and samples[0][0] <= oldest:
            self._drop_oldest()
        return True

    def _current(self) -> None:
        if self._forget(self._clock()):
            self._changed()

    def _changed(self) -> None:
        ordered = self._ordered
        n = len(ordered)
        self._p99 = ordered[min(n - 1, math.ceil(0.99 * n) - 1)] if n else None
        self.gather = min(GATHER_MAX, GATHER_SHARE * (self._p99 or 0.0))
        delay = self._hedge_delay()
        if delay != self._delay:
            self._delay = delay
            metrics.S3_HEDGE_DELAY.set(delay)

    def _hedge_delay(self) -> float:
        return max(HEDGE_FLOOR, HEDGE_MULTIPLE * (self._p99 or 0.0))

    @property
    def p99(self) -> float | None:
        self._current()
        return self._p99

    @property
    def hedge_delay(self) -> float:
        self._current()
        return self._hedge_delay()

    @property
    def idle_timeout(self) -> float:
        self._current()
        return min(IDLE_CAP, max(IDLE_FLOOR, IDLE_MULTIPLE * (self._p99 or 0.0)))


class AdaptiveLimit:
    """The number of S3 requests in flight: AIMD driven by throttling (see module doc).

    ``all`` bounds every request; ``background`` (3/4 of it) is taken in addition by
    prefetch and warm requests, so demand reads always find a connection.
    """

    def __init__(self, maximum: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.maximum = maximum
        self._window = float(maximum)
        self._clock = clock
        self._last_cut = -math.inf
        self._last_throttle = -math.inf
        self.all = trio.CapacityLimiter(maximum)
        self.background = trio.CapacityLimiter(max(1, maximum * 3 // 4))
        metrics.S3_CONCURRENCY_LIMIT.set(maximum)

    @property
    def limit(self) -> int:
        return int(self.all.total_tokens)

    def throttled(self, sent_at: float | None) -> None:
        now = self._clock()
        self._last_throttle = now
        if sent_at is not None and sent_at < self._last_cut:
            return  # sent before the last cut: that cut already answered this round
        self._last_cut = now
        self._window = max(1.0, self._window * DECREASE)
        self._apply()

    def succeeded(self) -> None:
        if self._window >= self.maximum:
            return
        if self._clock() - self._last_throttle >= CALM:
            self._window += 1.0
        else:
            self._window += 1.0 / self._window
        self._window = min(float(self.maximum), self._window)
        self._apply()

    def _apply(self) -> None:
        n = max(1, int(self._window))
        if n != self.all.total_tokens:
            self.all.total_tokens = n
            self.background.total_tokens = max(1, n * 3 // 4)
            metrics.S3_CONCURRENCY_LIMIT.set(n)


@dataclasses.dataclass(slots=True)
class Got:
    """A GET's bytes, the check they passed (an integrity CHECKS name, ``etag_md5`` or
    ``none``) and, if asked for, their CRC."""

    data: bytes
    check: str = "none"
    crc: int | None = None


@dataclasses.dataclass(slots=True)
class _Episode:
    """A run of failures of one operation (for the log)."""

    started: float
    failures: int = 0
    last_failure: float = 0.0
    last_log: float = -math.inf


class _Waiting(Generic[T]):
    """The trio task waiting for one request's jobs (a GET and its hedge), and the jobs
    that have landed, in the order they did (trio thread only)."""

    __slots__ = ("landed", "task")

    def __init__(self) -> None:
        self.task: trio.lowlevel.Task | None = None
        self.landed: list[_Job[T]] = []


class _Job(Generic[T]):
    """One blocking call in a worker thread: its exchange, the connection tokens it
    holds (it is their borrower), its outcome once landed, and the count of outages begun
    or ended when it started (``Origin._outage_changes``) (trio thread only)."""

    __slots__ = ("background", "exchange", "outages", "result", "waiting")

    def __init__(self, exchange: Exchange, waiting: _Waiting[T], background: bool) -> None:
        self.exchange = exchange
        # None once landed: the job is then in ``waiting.landed``, and a job that kept
        # ``waiting`` would make a cycle (job -> waiting -> landed -> job) holding the
        # answer's bytes until a full collection of the cyclic GC, which the daemon
        # spaces out (cachefs.gcpolicy): GiBs of blocks read long ago stayed in memory.
        self.waiting: _Waiting[T] | None = waiting
        self.background = background
        self.result: outcome.Outcome[T] | None = None
        self.outages = 0


class _Soon(_Waiting[Got]):
    """A GET driven by callbacks (:meth:`Origin.get_soon`): the jobs of its first
    attempt (a GET and perhaps its hedge), what its retries need, and whom to tell
    (trio thread only). ``over`` once its first attempt has ended, however: its jobs
    still in flight are aborted, and their landings change nothing."""

    __slots__ = ("background", "cut_at", "done", "failed", "fetch", "first", "hedge", "jobs",
                 "over", "where")

    def __init__(self, fetch: Callable[[Exchange], Got], where: str, background: bool,
                 first: float, cut_at: float, done: Callable[[Got | None, BaseException | None],
                                                             None]) -> None:
        super().__init__()
        self.fetch = fetch
        self.where = where
        self.background = background
        self.first = first  # trio's clock
        self.cut_at = cut_at  # trio's clock: the retry deadline (inf: none)
        self.done: Callable[[Got | None, BaseException | None], None] | None = done
        self.failed: list[object] = []  # what answers that failed their check computed
        self.jobs: list[_Job[Got]] = []
        self.hedge: _Job[Got] | None = None
        self.over = False


class Origin:
    """S3 for the async rest of cachefs: see the module docstring."""

    def __init__(self, store: ObjectStore, *, max_connections: int = 64,
                 deadline: float = DEFAULT_DEADLINE, backoff: Backoff | None = None,
                 rng: random.Random | None = None) -> None:
        self.store = store
        self.bucket = store.bucket
        self.deadline = deadline
        self.limit = AdaptiveLimit(max_connections)
        self.latency = LatencyTracker()
        self.backoff = backoff or Backoff()
        self._rng = rng or random.Random()
        self._hedge_tokens = HEDGE_BURST
        self._exchanges: set[Exchange] = set()
        self._closed = False
        # Set to wake every retry wait: at close, and when S3 answers again after an
        # outage (not after throttling, where a burst is the last thing S3 wants).
        self._wake = trio.Event()
        # An outage: from a failure that is not throttling until S3 answers again. Outages
        # begun or ended: a job that saw this count change, or started during one, waited
        # through an outage (its first byte is no sample of S3's latency: see _landed).
        self._outage = False
        self._outage_changes = 0
        self._episodes: dict[str, _Episode] = {}
        # Where a request gave up at the retry deadline -> when (trio thread; cleared when
        # S3 answers anything): see _retrying
        self._gave_up: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._last_warning: dict[str, float] = {}
        # op -> (when a give-up was last logged, give-ups not logged since): one line per
        # _LOG_EVERY seconds and operation (an outage past the deadline gave up hundreds of
        # prefetches, each an ERROR line)
        self._gave_up_logged: dict[str, tuple[float, int]] = {}
        self._md5_disagreements = 0
        self.check_etags = True
        self._token: trio.lowlevel.TrioToken | None = None
        # GETs driven by callbacks whose first attempt is in flight (get_soon), oldest
        # first; the nursery that owns their retries, and the scope of the one task that
        # watches their hedge delays and deadlines (run_soon: trio thread)
        self._soon: dict[_Soon, None] = {}
        # ... and those waiting for a connection (or background slot), in their order
        self._soon_queue: deque[_Soon] = deque()
        self._soon_nursery: trio.Nursery | None = None
        self._soon_scope: trio.CancelScope | None = None
        # Landings of get_soon's GETs waiting to be handed to the trio thread together
        # (worker threads append; _take_landings takes them), and whether a hand-over of
        # them is under way (see _start): both under _landings_lock
        self._landings: list[tuple[_Job[Any], outcome.Outcome[Any]]] = []
        self._landings_due = False
        self._landings_lock = threading.Lock()

    # -- lifecycle ------------------------------------------------------------------
    def close(self) -> None:
        """Stop: abort every request in flight, end every retry wait (trio thread)."""
        self._closed = True
        self._wake.set()
        for exchange in list(self._exchanges):
            exchange.abort()
        queued, self._soon_queue = self._soon_queue, deque()
        for rec in queued:  # (waiting for a connection: nothing to abort)
            if not rec.over:
                self._soon_end(rec)
                self._soon_tell(rec, None, self._stopping(rec.where))

    @property
    def closed(self) -> bool:
        return self._closed

    def _stopping(self, where: str) -> TransientStoreError:
        return TransientStoreError(f"{where}: cachefs is stopping", reason="stopping")

    # -- requests -------------------------------------------------------------------
    async def get(self, key: str, etag: str, start: int, end: int, *, whole: bool = False,
                  background: bool = False, crc_kind: str | None = None,
                  sink: Callable[[bytes], None] | None = None) -> Got:
        """Bytes ``[start, end)`` of version ``etag`` of ``key``.

        ``whole``: the range is the whole object; the answer is checked against what S3
        states about it. ``background``: prefetch or warm (takes the background share of
        the connections). ``crc_kind``: also compute the bytes' CRC of that kind (in the
        worker thread). ``sink`` (whole-object GETs only): called in the worker thread
        with the bytes once they passed that check (the fetcher writes them to the disk
        cache there, saving a second thread hop); it must not raise, and it may run for
        more than one answer (a hedged GET whose two answers both arrive) or for none
        (bytes served after two identical answers disagreed with the ETag, see
        :meth:`_disagreement`). Raises ObjectChanged, NoSuchKey, AccessDenied... at once,
        and TransientStoreError once the retry deadline has passed.
        """
        where = f"s3://{self.bucket}/{key}"
        failed: list[object] = []  # what the answers that failed their check computed
        fetch = self._get_fetch(key, etag, start, end, whole=whole, crc_kind=crc_kind,
                                sink=sink, where=where)

        async def attempt() -> Got:
            try:
                return await self._hedged(fetch, background=background)
            except IntegrityError as exc:
                return self._check_failed(exc, failed, where)

        got = await self._retrying("get", where, attempt)
        (_VERIFIED_BYTES.get(got.check) or metrics.S3_VERIFIED_BYTES.labels(got.check)).inc(
            len(got.data))
        return got

    def _get_fetch(self, key: str, etag: str, start: int, end: int, *, whole: bool,
                   crc_kind: str | None, sink: Callable[[bytes], None] | None,
                   where: str) -> Callable[[Exchange], Got]:
        """The blocking call of one attempt of :meth:`get` (run in a worker thread)."""
        check_etags = self.check_etags
        store = self.store

        def fetch(exchange: Exchange) -> Got:  # worker thread
            body = store.get(key, etag, start, end, whole=whole, exchange=exchange,
                             md5=whole and check_etags)
            if whole:
                check = integrity.check_whole(body.data, where=where, stated=body.checksum,
                                              etag=etag, etag_md5=body.etag_md5 and check_etags,
                                              md5=body.md5)
                if sink is not None:
                    sink(body.data)
                return Got(body.data, check)
            return Got(body.data, "none",
                       integrity.crc(crc_kind, body.data) if crc_kind else None)
        return fetch

    def _check_failed(self, exc: IntegrityError, failed: list[object], where: str) -> Got:
        """An answer of a GET failed its check: counted, and raised to be retried, unless
        an earlier answer's bytes failed it the same way (:meth:`_disagreement`)."""
        metrics.S3_INTEGRITY_ERRORS.labels(exc.check).inc()
        if exc.computed in failed:
            return self._disagreement(exc, where)
        failed.append(exc.computed)
        log.warning("%s", exc)
        raise exc

    async def open_connections(self, n: int) -> int:
        """Open up to ``n`` connections to S3 ahead of the first requests, when the store
        keeps a pool of them (:meth:`cachefs.s3.boto.S3Store.prewarm`); returns how many
        were opened. Waits in worker threads (abandoned if cancelled: they only connect)."""
        prewarm: Callable[[int], int] | None = getattr(self.store, "prewarm", None)
        if prewarm is None or n <= 0:
            return 0
        opened: int = await trio.to_thread.run_sync(prewarm, n, abandon_on_cancel=True)
        return opened

    async def list_page(self, prefix: str, token: str | None,
                        start_after: str | None = None, *, flat: bool = False) -> ListPage:
        """One page of the listing of ``prefix`` (see ObjectStore.list_page)."""
        async def attempt() -> ListPage:
            return await self._call(
                lambda ex: self.store.list_page(prefix, token, start_after, exchange=ex,
                                                flat=flat),
                self._exchange(), background=False)
        return await self._retrying("list", f"s3://{self.bucket}/{prefix}", attempt)

    def blocking(self) -> BlockingOrigin:
        """This origin as a blocking :class:`ObjectStore`, for code that runs in trio worker
        threads (the listing ranges of :mod:`cachefs.cache.metadata`)."""
        return BlockingOrigin(self)

    async def full_checksum(self, key: str, etag: str) -> Checksum | None:
        """The full-object checksum S3 keeps for this version, or None (HEAD)."""
        async def attempt() -> Checksum | None:
            return await self._call(lambda ex: self.store.full_checksum(key, etag, ex),
                                    self._exchange(), background=True)
        return await self._retrying("head", f"s3://{self.bucket}/{key}", attempt)

    # -- retries ----------------------------------------------------------------------
    async def _retrying(self, op: str, where: str, attempt: Callable[[], Awaitable[T]], *,
                        first: float | None = None,
                        failure: TransientStoreError | None = None) -> T:
        """Run ``attempt`` until it succeeds, retrying transient failures with backoff until
        the retry deadline. Every attempt is cut off at the deadline (its own timeouts, and
        its hedge's, could run for seconds past it: a read then waited twice the deadline
        and more). And a request for
        what gave up at the deadline moments ago (:data:`GAVE_UP_MEMORY`), S3 silent
        since, has :data:`LAST_TRY` seconds, not a deadline of its own: a read that failed
        is asked for again by the kernel (the page-cache read after its readahead), which
        waited the deadline all over again; a reader's retry once S3 is back still works.

        ``first`` and ``failure``: the request's first attempt was made at ``first``
        (trio's clock) without this loop, and failed with ``failure`` (a GET driven by
        callbacks, :meth:`get_soon`): the loop goes on from there as if its own first
        attempt had failed so, with the same deadline (and no last try: that attempt was
        made when no request that gave up was remembered)."""
        if first is None:
            first = trio.current_time()
        gave_up = self._gave_up.get(where) if failure is None else None
        last_try = gave_up is not None and first - gave_up < min(self.deadline, GAVE_UP_MEMORY)
        deadline_at = first + (min(LAST_TRY, self.deadline) if last_try else self.deadline)
        # (a deadline of 0: one attempt, no retry, bounded by its own timeouts only)
        cut_at = deadline_at if self.deadline > 0 else math.inf
        n = 0
        while True:
            if self._closed:
                raise self._stopping(where)
            try:
                if failure is not None:
                    failed, failure = failure, None
                    raise failed
                with trio.move_on_at(cut_at) as late:
                    result = await attempt()
                if late.cancelled_caught:
                    raise TransientStoreError(f"{where}: no answer by the retry deadline",
                                              reason="timeout")
            except TransientStoreError as exc:
                if self._closed:
                    raise self._stopping(where) from exc
                left = deadline_at - trio.current_time()
                if left <= 0:
                    metrics.S3_DEADLINE_EXCEEDED.labels(op).inc()
                    self._log_give_up(op, where, trio.current_time() - first, exc)
                    self._gave_up[where] = trio.current_time()
                    if len(self._gave_up) > GAVE_UP_KEPT:
                        self._gave_up.popitem(last=False)
                    how = "a last try after giving up moments ago" if last_try else "retry deadline"
                    raise TransientStoreError(
                        f"{where}: S3 kept failing for {trio.current_time() - first:.0f} s "
                        f"({how}): {exc}", throttled=exc.throttled, reason=exc.reason) from exc
                metrics.S3_RETRIES.labels(op, exc.reason).inc()
                self._note_failure(op, exc)
                if not exc.throttled and not self._outage:
                    self._outage = True
                    self._outage_changes += 1
                from_s3 = exc.throttled or exc.reason == "server_error"
                delay = min(self.backoff.delay(n, self._rng, from_s3=from_s3), left)
                n += 1
                with trio.move_on_after(delay):
                    await self._wake.wait()
                continue
            self._answered(op)
            return result

    def _answered(self, op: str) -> None:
        """A request of ``op`` succeeded (trio thread): the log's episode ends, what gave
        up may be asked for again, and an outage is over."""
        if self._episodes:
            self._note_success(op)
        if self._gave_up:  # S3 answers again: what gave up may be asked for again
            self._gave_up.clear()
        if self._outage:  # S3 answers again: requests waiting to retry go now
            self._outage = False
            self._outage_changes += 1
            self._wake.set()
            self._wake = trio.Event()

    def _disagreement(self, exc: IntegrityError, where: str) -> Got:
        """Two answers with the same bytes both failed their check: not the transfer but
        S3's statement disagrees with its bytes. An ETag is not promised to be an MD5
        (SSE-KMS behind a proxy that drops its header, some S3-compatible servers): the
        bytes are served. A stated checksum is S3's explicit word on the content: the
        read fails (EIO) at once rather than serving bytes S3 says are not the object."""
        metrics.S3_CHECKSUM_DISAGREEMENTS.labels(exc.check).inc()
        if exc.check != "etag_md5":
            log.error("%s: S3 serves bytes that disagree with its own stored %s (the same "
                      "bytes twice): not serving them", where, exc.check)
            raise StoreError(f"{where}: S3's stored {exc.check} disagrees with the bytes it "
                             "serves") from exc
        log.warning("%s: two answers with identical bytes disagree with the ETag: it is not "
                    "an MD5 of the content; serving the bytes", where)
        if self.check_etags:
            self._md5_disagreements += 1
            if self._md5_disagreements >= MD5_DISAGREEMENTS_TO_STOP:
                self.check_etags = False
                log.warning("the ETags of s3://%s are not MD5 digests of the content "
                            "(%d objects): whole-object reads are no longer checked "
                            "against ETags", self.bucket, self._md5_disagreements)
        return Got(exc.data, "disagreed")

    # -- one attempt -------------------------------------------------------------------
    def _exchange(self) -> Exchange:
        return Exchange(self.latency.idle_timeout)

    def _start(self, fn: Callable[[Exchange], T], job: _Job[T], *,
               gathered: bool = False) -> None:
        """Run ``fn(job.exchange)`` in a worker thread; its outcome lands on the trio thread
        (:meth:`_landed`). The job holds its connection tokens already.

        ``gathered`` (the GETs of :meth:`get_soon`, which no task waits for): the
        outcome is handed over with the others that land meanwhile. The first of them
        waits ``latency.gather`` in its worker thread (GATHER_SHARE of S3's p99
        first-byte latency, at most GATHER_MAX) before it wakes the trio thread; those
        landing during that wait join it, without a wake-up of their own
        (:meth:`_take_landings`). A cold pass of small files woke the trio thread once
        per GET, ~50 us of its CPU each beside the landing's own work; the cost is that
        much later an answer (a connection given back, a reader joined to the load
        answered): 2 ms of GETs of 100 ms or more."""
        self._exchanges.add(job.exchange)
        job.outages = self._outage_changes
        self._hedge_tokens = min(HEDGE_BURST, self._hedge_tokens + HEDGE_SHARE)
        token = self._token
        if token is None:
            token = self._token = trio.lowlevel.current_trio_token()
        exchange = job.exchange
        landed = self._landed

        def run() -> T:  # worker thread
            if threading.current_thread().name != _THREAD_NAME:
                _name_thread()
            exchange.sending()
            return fn(exchange)

        def deliver(result: outcome.Outcome[T]) -> None:  # worker thread
            try:
                token.run_sync_soon(landed, job, result)
            except trio.RunFinishedError:
                pass  # the daemon is gone: nothing waits for it any more

        if gathered:
            latency, lock, take = self.latency, self._landings_lock, self._take_landings

            def deliver_gathered(result: outcome.Outcome[T]) -> None:  # worker thread
                with lock:
                    self._landings.append((job, result))
                    if self._landings_due:
                        return  # (handed over with the first, which waits)
                    self._landings_due = True
                wait = latency.gather
                if wait > 0:
                    time.sleep(wait)
                try:
                    token.run_sync_soon(take)
                except trio.RunFinishedError:  # the daemon is gone: nothing waits for them
                    with lock:
                        self._landings.clear()
                        self._landings_due = False

            trio.lowlevel.start_thread_soon(run, deliver_gathered)
            return
        trio.lowlevel.start_thread_soon(run, deliver)

    def _take_landings(self) -> None:
        """The landings gathered by :meth:`_start` (trio thread): each goes on as any
        landing does (:meth:`_landed`), in the order they landed."""
        with self._landings_lock:
            landings, self._landings = self._landings, []
            self._landings_due = False
        for job, result in landings:
            self._landed(job, result)

    def _landed(self, job: _Job[T], result: outcome.Outcome[T]) -> None:
        """A worker thread's outcome, on the trio thread: the connection's tokens go back
        (only now: an abandoned thread keeps its slot until it returns), the limit and
        latency learn from it, and the waiting task (if any) is woken.

        The first-byte latency of an answer is a sample of S3's latency only if no outage
        was in progress at any moment from its start to its answer: not if it was started
        during one or one began meanwhile (the count of outages begun or ended changed),
        nor if one is in progress now (the answer that ends it lands before _retrying sees
        it). Such an answer was sent before S3 came back after an outage and measures the
        outage: a 25 s outage left a p99 of seconds, the hedge delay at ~17 s and the idle
        timeout at its cap for the next 256 GETs. (An attempt in flight when a lone
        failure is taken for an outage, S3 answering again moments later, is left out too.)
        """
        job.result = result
        self._exchanges.discard(job.exchange)
        self.limit.all.release_on_behalf_of(job)
        if job.background:
            self.limit.background.release_on_behalf_of(job)
        if isinstance(result, outcome.Value):
            latency = job.exchange.first_byte_latency
            if latency is not None and job.outages == self._outage_changes and not self._outage:
                self.latency.observe(latency)
            self.limit.succeeded()
        elif (isinstance(result, outcome.Error) and isinstance(result.error, TransientStoreError)
              and result.error.throttled):
            self.limit.throttled(job.exchange.sent_at)
        if self._soon_queue:
            self._soon_pump()
        waiting, job.waiting = job.waiting, None  # (no cycle: see _Job)
        assert waiting is not None  # (a job lands once)
        waiting.landed.append(job)
        if isinstance(waiting, _Soon):
            self._soon_landed(waiting, job)  # type: ignore[arg-type]
            return
        task, waiting.task = waiting.task, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    async def _submit(self, fn: Callable[[Exchange], T], exchange: Exchange,
                      waiting: _Waiting[T], *, background: bool) -> _Job[T]:
        """Take a connection (and a background slot) and start ``fn`` on it."""
        if self._closed:
            raise self._stopping(f"s3://{self.bucket}")
        job = _Job(exchange, waiting, background)
        # A free token is taken without the limiter's checkpoint (a trip through the
        # scheduler per limiter, per GET, on the trio thread): the caller's wait for the
        # answer is its checkpoint. Without one, the request queues in the limiter's order.
        if background:
            await _acquire(self.limit.background, job)
        try:
            await _acquire(self.limit.all, job)
        except BaseException:
            if background:
                self.limit.background.release_on_behalf_of(job)
            raise
        if self._closed:  # closed while this waited for a connection
            self._give_back(job)
            raise self._stopping(f"s3://{self.bucket}")
        try:
            self._start(fn, job)
        except BaseException:  # no thread to be had: nothing was sent
            self._give_back(job)
            raise
        return job

    def _give_back(self, job: _Job[T], *, pump: bool = True) -> None:
        """Return the tokens of a job that never ran."""
        self._exchanges.discard(job.exchange)
        self.limit.all.release_on_behalf_of(job)
        if job.background:
            self.limit.background.release_on_behalf_of(job)
        if pump and self._soon_queue:
            self._soon_pump()

    @staticmethod
    async def _wait(waiting: _Waiting[T], timeout: float) -> None:
        """Until one more job of ``waiting`` has landed, or ``timeout`` seconds."""
        with trio.move_on_after(timeout):
            waiting.task = trio.lowlevel.current_task()

            def abort(_: object) -> trio.lowlevel.Abort:
                waiting.task = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)

    async def _call(self, fn: Callable[[Exchange], T], exchange: Exchange, *,
                    background: bool) -> T:
        """Run ``fn(exchange)`` in a worker thread under the connection limit."""
        waiting: _Waiting[T] = _Waiting()
        job = await self._submit(fn, exchange, waiting, background=background)
        try:
            while job.result is None:
                await self._wait(waiting, math.inf)
        except BaseException:
            exchange.abort()  # cancelled: the abandoned thread stops at once
            raise
        return job.result.unwrap()

    def _may_hedge(self) -> bool:
        if self._closed or self._hedge_tokens < 1 or self.limit.all.available_tokens < 1:
            return False
        self._hedge_tokens -= 1
        return True

    def _start_hedge(self, fn: Callable[[Exchange], T], waiting: _Waiting[T], *,
                     background: bool) -> _Job[T] | None:
        """A second request on a spare connection (and background slot), or None."""
        if not self._may_hedge():
            return None
        job = _Job(self._exchange(), waiting, background)
        if background:
            try:
                self.limit.background.acquire_on_behalf_of_nowait(job)
            except trio.WouldBlock:
                return None
        try:
            self.limit.all.acquire_on_behalf_of_nowait(job)  # _may_hedge saw a spare one
        except trio.WouldBlock:  # (but tasks already queue for it)
            if background:
                self.limit.background.release_on_behalf_of(job)
            return None
        try:
            self._start(fn, job)
        except BaseException:
            self._give_back(job)
            raise
        return job

    async def _hedged(self, fn: Callable[[Exchange], T], *, background: bool) -> T:
        """One attempt of a GET: a second request if the first goes silent, first
        complete answer wins, the other is aborted.

        No task or nursery per request: the caller waits for its jobs itself (a GET's
        cost on the trio thread bounds cold small-file throughput), waking at the hedge
        delay to check whether the first request went silent."""
        waiting: _Waiting[T] = _Waiting()
        primary = await self._submit(fn, self._exchange(), waiting, background=background)
        jobs = [primary]
        hedge: _Job[T] | None = None
        try:
            while True:
                answered = [j for j in waiting.landed if isinstance(j.result, outcome.Value)]
                if answered or len(waiting.landed) == len(jobs):
                    break
                delay = self.latency.hedge_delay
                sent_at = primary.exchange.sent_at
                if hedge is None and primary.result is None and sent_at is not None:
                    delay = primary.exchange.progress_at + delay - time.monotonic()
                    if delay <= 0:
                        hedge = self._start_hedge(fn, waiting, background=background)
                        if hedge is not None:
                            jobs.append(hedge)
                            metrics.S3_HEDGES_SENT.inc()
                            log.debug("hedging a GET silent for %.1f s",
                                      time.monotonic() - primary.exchange.progress_at)
                            continue
                        delay = self.latency.hedge_delay / 4
                await self._wait(waiting, max(delay, 0.01))
        finally:
            for job in jobs:
                if job.result is None:
                    job.exchange.abort()  # the loser, or everything when cancelled
        if answered:
            winner = answered[0]
            if winner is hedge:
                metrics.S3_HEDGES_WON.inc()
            return winner.result.unwrap()  # type: ignore[union-attr]
        errors: list[StoreError] = []
        for job in waiting.landed:
            assert isinstance(job.result, outcome.Error)
            if not isinstance(job.result.error, StoreError):
                job.result.unwrap()  # a bug: raised as it is
            errors.append(job.result.error)
        permanent = [e for e in errors if not isinstance(e, TransientStoreError)]
        raise (permanent or errors)[0]

    # -- GETs driven by callbacks ------------------------------------------------------
    async def run_soon(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                       ) -> None:
        """Own the GETs of :meth:`get_soon` until cancelled: one task watches the hedge
        delay and retry deadline of every such GET whose first attempt is in flight, and
        their retries run as tasks of this one's nursery. When it ends (cancelled: the
        fetcher's end), every such GET not yet answered is told
        TransientStoreError("cachefs is stopping") and its requests are aborted. At most
        one runs per origin."""
        if self._soon_nursery is not None:
            raise RuntimeError("Origin.run_soon is running already")
        try:
            async with trio.open_nursery() as nursery:
                self._soon_nursery = nursery
                task_status.started()
                next_at = math.inf
                while True:
                    with trio.CancelScope(deadline=next_at) as scope:
                        self._soon_scope = scope
                        await trio.sleep_forever()
                    self._soon_scope = None
                    next_at = self._soon_watch()
        finally:
            self._soon_nursery = self._soon_scope = None
            self._soon_queue.clear()
            for rec in list(self._soon):
                self._soon_end(rec)
                self._soon_tell(rec, None, self._stopping(rec.where))

    def get_soon(self, key: str, etag: str, start: int, end: int, *,
                 done: Callable[[Got | None, BaseException | None], None],
                 whole: bool = False, background: bool = False, crc_kind: str | None = None,
                 sink: Callable[[bytes], None] | None = None) -> bool:
        """:meth:`get` without a task: start it and return True, and ``done(got, None)``
        or ``done(None, error)`` is called once, later, on the trio thread, with what
        :meth:`get` would have returned or raised. Or start nothing and return False
        (then ask :meth:`get`): when :meth:`run_soon` is not running, cachefs is
        stopping, S3 is failing (an outage, or a request that gave up at its deadline is
        remembered: those paths are :meth:`get`'s alone), or no worker thread can be
        started.

        The same request, checks, hedge, limits, deadline and metrics as :meth:`get`,
        without a task, coroutine or cancel scope per GET on the trio thread (their cost
        bounded cold small-file throughput): the worker thread's landing
        (:meth:`_landed`) answers, the watcher of :meth:`run_soon` sends the hedge of a
        silent GET and cuts one at the retry deadline, and only a first attempt that
        fails (or is cut) goes on as a task of :meth:`run_soon`'s nursery running
        :meth:`_retrying` from that failure, with the same deadline. With no connection
        (or background slot) free, the GET waits in ``_soon_queue``, in order, behind the
        tasks waiting in the limiter (demand reads among them), and is sent when one is
        given back (:meth:`_soon_pump`); its deadline runs meanwhile, as a task's does
        while it waits in the limiter. Tasks that come later go first too, so one that has
        waited :data:`SOON_QUEUE_WAIT` becomes a task of :meth:`run_soon`'s nursery
        waiting in the limiter (:meth:`_soon_retry`, with no failure to go on from): its
        wait behind later tasks is bounded. That queue holds at most the loads its caller
        has started (the fetcher's each hold a memory reservation). ``done`` must not raise
        (it is logged). Trio thread."""
        if self._soon_nursery is None or self._closed or self._outage or self._gave_up:
            return False
        where = f"s3://{self.bucket}/{key}"
        fetch = self._get_fetch(key, etag, start, end, whole=whole, crc_kind=crc_kind,
                                sink=sink, where=where)
        now = trio.current_time()
        rec = _Soon(fetch, where, background, now,
                    now + self.deadline if self.deadline > 0 else math.inf, done)
        try:
            queued = bool(self._soon_queue) or not self._soon_send(rec)
        except Exception:  # no thread to be had: nothing was sent (get() says why)
            return False
        self._soon[rec] = None
        if queued:
            self._soon_queue.append(rec)  # (its deadline runs: the watcher cuts it there)
            scope = self._soon_scope
            due = min(rec.cut_at, now + SOON_QUEUE_WAIT)
            if scope is not None and due < scope.deadline:
                scope.deadline = due
        return True

    def _soon_send(self, rec: _Soon) -> bool:
        """Take a connection (and a background slot) for ``rec`` and send its GET; False
        when none is free (a task waiting for one in the limiter goes first). Raises what
        starting its worker thread raised (nothing was sent)."""
        background = rec.background
        limit = self.limit
        if limit.all.available_tokens < 1 or (
                background and limit.background.available_tokens < 1):
            return False  # (the usual case in the queue: no job made in vain)
        job = _Job(self._exchange(), rec, background)
        if background:
            try:
                limit.background.acquire_on_behalf_of_nowait(job)
            except trio.WouldBlock:
                return False
        try:
            limit.all.acquire_on_behalf_of_nowait(job)
        except trio.WouldBlock:
            if background:
                limit.background.release_on_behalf_of(job)
            return False
        try:
            self._start(rec.fetch, job, gathered=True)
        except BaseException:  # no thread to be had: nothing was sent
            self._give_back(job, pump=False)
            raise
        rec.jobs.append(job)
        scope = self._soon_scope
        if scope is not None:  # (the first hedge check: the delay after the start)
            check_at = min(trio.current_time() + self.latency.hedge_delay, rec.cut_at)
            if check_at < scope.deadline:
                scope.deadline = check_at
        return True

    def _soon_pump(self) -> None:
        """Send the GETs of :meth:`get_soon` waiting for a connection while one is free
        (trio thread: after a connection was given back or the limit grew)."""
        queue = self._soon_queue
        while queue:
            rec = queue[0]
            if rec.over:  # (cut at its deadline, or cachefs stopping)
                queue.popleft()
                continue
            try:
                if not self._soon_send(rec):
                    return
            except Exception as exc:  # (as get() raises it)
                self._soon_end(rec)
                self._soon_tell(rec, None, exc)
            queue.popleft()

    def _soon_watch(self) -> float:
        """Send the hedge of each GET of :meth:`get_soon` silent for the hedge delay, and
        cut those past their deadline (as :meth:`_hedged` and :meth:`_retrying` do for a
        task); returns when to look again (trio's clock)."""
        now = trio.current_time()
        mono = time.monotonic()
        next_at = math.inf
        for rec in list(self._soon):
            if now >= rec.cut_at:
                self._soon_end(rec)
                self._soon_failed(rec, TransientStoreError(
                    f"{rec.where}: no answer by the retry deadline", reason="timeout"))
                continue
            if not rec.jobs:  # (waiting in the queue for a connection)
                if now >= rec.first + SOON_QUEUE_WAIT:
                    self._soon_to_task(rec)
                else:
                    next_at = min(next_at, rec.first + SOON_QUEUE_WAIT)
                    next_at = min(next_at, rec.cut_at)
                continue
            if rec.hedge is None and rec.jobs:
                primary = rec.jobs[0]
                delay = self.latency.hedge_delay
                if primary.exchange.sent_at is not None:
                    delay = primary.exchange.progress_at + delay - mono
                    if delay <= 0:
                        hedge = self._start_hedge(rec.fetch, rec, background=rec.background)
                        if hedge is not None:
                            rec.jobs.append(hedge)
                            rec.hedge = hedge
                            metrics.S3_HEDGES_SENT.inc()
                            log.debug("hedging a GET silent for %.1f s",
                                      mono - primary.exchange.progress_at)
                            delay = math.inf
                        else:
                            delay = self.latency.hedge_delay / 4
                next_at = min(next_at, now + max(delay, 0.01))
            next_at = min(next_at, rec.cut_at)
        return next_at

    def _soon_landed(self, rec: _Soon, job: _Job[Got]) -> None:
        """A job of a GET of :meth:`get_soon` has landed (trio thread, from
        :meth:`_landed`): the first complete answer wins (the other request is aborted);
        when every job failed, the failure goes on as :meth:`_hedged`'s would."""
        if rec.over:
            return
        result = job.result
        if isinstance(result, outcome.Value):
            self._soon_end(rec)
            if job is rec.hedge:
                metrics.S3_HEDGES_WON.inc()
            self._soon_answered(rec, result.value)
            return
        if len(rec.landed) < len(rec.jobs):
            return  # the other request may still answer
        self._soon_end(rec)
        errors: list[StoreError] = []
        for landed in rec.landed:
            assert isinstance(landed.result, outcome.Error)
            error = landed.result.error
            if not isinstance(error, StoreError):
                self._soon_tell(rec, None, error)  # a bug: told as it is
                return
            errors.append(error)
        permanent = [e for e in errors if not isinstance(e, TransientStoreError)]
        self._soon_failed(rec, (permanent or errors)[0])

    def _soon_failed(self, rec: _Soon, exc: StoreError) -> None:
        """The first attempt of a GET of :meth:`get_soon` failed with ``exc``: told at
        once if it is permanent or cachefs is stopping, else retried by a task of
        :meth:`run_soon`'s nursery (:meth:`_soon_retry`)."""
        if isinstance(exc, IntegrityError):
            try:
                got = self._check_failed(exc, rec.failed, rec.where)
            except IntegrityError:
                pass  # retried below
            except StoreError as stated:  # S3's statement disagrees with its bytes
                self._soon_tell(rec, None, stated)
                return
            else:
                self._soon_answered(rec, got)
                return
        if not isinstance(exc, TransientStoreError):
            self._soon_tell(rec, None, exc)
            return
        if self._closed:
            self._soon_tell(rec, None, self._stopping(rec.where))
            return
        self._soon_as_task(rec, exc)

    def _soon_to_task(self, rec: _Soon) -> None:
        """A GET of :meth:`get_soon` that waited :data:`SOON_QUEUE_WAIT` in the queue goes
        on as a task waiting in the limiter (trio thread; from the watcher)."""
        self._soon_end(rec)  # (out of the queue and the watch: the pump skips it)
        self._soon_as_task(rec, None)

    def _soon_as_task(self, rec: _Soon, failure: TransientStoreError | None) -> None:
        """Go on with ``rec`` as a task of :meth:`run_soon`'s nursery (:meth:`_soon_retry`),
        or tell it cachefs is stopping when that nursery has ended."""
        nursery = self._soon_nursery
        try:
            if nursery is None:
                raise RuntimeError("run_soon has ended")
            nursery.start_soon(self._soon_retry, rec, failure)
        except RuntimeError:  # (run_soon is ending: cachefs is stopping)
            self._soon_tell(rec, None, self._stopping(rec.where))

    async def _soon_retry(self, rec: _Soon, failure: TransientStoreError | None) -> None:
        """Retry a GET of :meth:`get_soon` whose first attempt failed (``failure``), or
        make its first (None: it waited too long for a connection, :meth:`_soon_to_task`),
        as :meth:`get` would have (a task of :meth:`run_soon`'s nursery), and tell its
        outcome."""
        async def attempt() -> Got:
            try:
                return await self._hedged(rec.fetch, background=rec.background)
            except IntegrityError as exc:
                return self._check_failed(exc, rec.failed, rec.where)

        try:
            got = await self._retrying("get", rec.where, attempt, first=rec.first,
                                       failure=failure)
        except Exception as exc:
            self._soon_tell(rec, None, exc)
        except BaseException:  # cancelled: the fetcher (run_soon) is ending
            self._soon_tell(rec, None, self._stopping(rec.where))
            raise
        else:
            self._soon_answered(rec, got, retried=True)

    def _soon_answered(self, rec: _Soon, got: Got, *, retried: bool = False) -> None:
        if not retried:  # (_retrying did this for a retried one)
            self._answered("get")
        (_VERIFIED_BYTES.get(got.check) or metrics.S3_VERIFIED_BYTES.labels(got.check)).inc(
            len(got.data))
        self._soon_tell(rec, got, None)

    def _soon_end(self, rec: _Soon) -> None:
        """The first attempt of ``rec`` is over: forget it, abort its requests in flight."""
        rec.over = True
        self._soon.pop(rec, None)
        for job in rec.jobs:
            if job.result is None:
                job.exchange.abort()  # the loser, or everything when cut or stopping

    @staticmethod
    def _soon_tell(rec: _Soon, got: Got | None, error: BaseException | None) -> None:
        done, rec.done = rec.done, None
        if done is None:
            return  # (told already)
        try:
            done(got, error)
        except Exception:  # (a caller's bug must not end the trio thread's callback)
            log.exception("telling a GET's outcome failed")

    # -- the log ------------------------------------------------------------------------
    def _note_failure(self, op: str, exc: TransientStoreError) -> None:
        now = trio.current_time()
        episode = self._episodes.get(op)
        if episode is None:
            episode = self._episodes[op] = _Episode(now)
        episode.failures += 1
        episode.last_failure = now
        if now - self._last_warning.get(op, -math.inf) < _LOG_EVERY:
            return
        self._last_warning[op] = now
        if episode.failures == 1:
            log.warning("S3 %s failed (%s); retrying for up to %gs", op, exc, self.deadline)
        else:
            log.warning("S3 %s still failing: %d failures in %.0f s (last: %s)", op,
                        episode.failures, now - episode.started, exc)

    def _log_give_up(self, op: str, where: str, waited: float, exc: Exception) -> None:
        """One ERROR line per operation and :data:`_LOG_EVERY` seconds for requests that
        gave up at the deadline, naming how many more did since the last line (each is
        counted in ``cachefs_s3_deadline_exceeded_total`` and failed its read, listing or
        prefetch)."""
        now = trio.current_time()
        last, quiet = self._gave_up_logged.get(op, (-math.inf, 0))
        if now - last < _LOG_EVERY:
            self._gave_up_logged[op] = (last, quiet + 1)
            return
        more = f" ({quiet} more S3 {op} requests gave up since the last such line)" if quiet else ""
        log.error("%s: giving up after %.0f s of retries (--retry-deadline %gs): %s%s",
                  where, waited, self.deadline, exc, more)
        self._gave_up_logged[op] = (now, 0)

    def _note_success(self, op: str) -> None:
        episode = self._episodes.get(op)
        if episode is None:
            return
        now = trio.current_time()
        if now - episode.last_failure < 1.0:
            return  # still in the thick of it
        del self._episodes[op]
        log.info("S3 %s answering again after %.1f s (%d failures retried)", op,
                 episode.last_failure - episode.started, episode.failures)


async def _acquire(limiter: trio.CapacityLimiter, borrower: object) -> None:
    """``limiter.acquire_on_behalf_of(borrower)``, without a checkpoint when a token is free
    (the limiter's nowait honours its queue: none is free while tasks wait for one)."""
    try:
        limiter.acquire_on_behalf_of_nowait(borrower)
    except trio.WouldBlock:
        await limiter.acquire_on_behalf_of(borrower)


def _name_thread() -> None:
    """Name the calling worker thread :data:`_THREAD_NAME`, for Python and the OS (Linux
    ``PR_SET_NAME``). Done once per thread, not per request: a name given to trio per job
    is set and reset around every one (two system calls and ~7 us under the interpreter
    lock per GET). A job of another kind that trio names renames the thread; its next
    S3 request names it again."""
    threading.current_thread().name = _THREAD_NAME
    _libc.prctl(_PR_SET_NAME, _THREAD_NAME.encode(), 0, 0, 0)


class BlockingOrigin:
    """An :class:`Origin` for trio worker threads: each call runs the origin's async
    request on the trio thread (``trio.from_thread.run``) and waits for it, so it gets the
    same retries, deadline and connection limit; the calling thread holds no connection
    while it waits. Only for threads started by ``trio.to_thread.run_sync``."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.bucket = origin.bucket

    def list_page(self, prefix: str, token: str | None, start_after: str | None = None,
                  exchange: Exchange | None = None, *, flat: bool = False) -> ListPage:
        return trio.from_thread.run(
            functools.partial(self.origin.list_page, prefix, token, start_after, flat=flat))

    def head(self, key: str) -> ObjectInfo:
        return self.origin.store.head(key)

    def get_range(self, key: str, etag: str, start: int, end: int) -> bytes:
        async def get() -> bytes:
            return (await self.origin.get(key, etag, start, end)).data
        return trio.from_thread.run(get)

    def get(self, key: str, etag: str, start: int, end: int, *, whole: bool = False,
            exchange: Exchange | None = None, md5: bool = False) -> Body:
        async def get() -> Body:  # (checked by Origin.get already)
            return Body((await self.origin.get(key, etag, start, end, whole=whole)).data)
        return trio.from_thread.run(get)

    def full_checksum(self, key: str, etag: str,
                      exchange: Exchange | None = None) -> Checksum | None:
        return trio.from_thread.run(self.origin.full_checksum, key, etag)


__all__ = ["AdaptiveLimit", "Backoff", "BlockingOrigin", "Got", "LatencyTracker", "Origin"]

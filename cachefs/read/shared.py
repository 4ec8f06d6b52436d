"""The shared cache tier: one in-region copy of each block for the whole cluster.

A :class:`~cachefs.read.tiers.Tier` on an S3-compatible store in the compute
region (an S3 Express One Zone directory bucket, a standard bucket, a SeaweedFS
cluster on the nodes' NVMe...), between a node's local disk cache and the
origin. Every node that mounts the same source with the same ``--block-size``
and ``--shared-cache`` reads and fills the same objects, so a block crosses
regions once per cluster instead of once per node.

Naming (:class:`SharedLayout`): block ``i`` of version ``etag`` of ``key`` in
source bucket ``b``, cut in blocks of ``bs`` bytes, is the object
``PREFIX/v1/H/IIIIIIIIII`` with ``H`` = the first 40 hex digits of
sha256(b, key, etag, bs) and ``I`` the block index, so a new version of an
object never meets the old one's blocks. Each object carries user metadata
``cachefs-block: v1:<identity>:<length>:<xxh3-64 of the bytes>`` where the
identity is sha256 of all five fields; a GET is verified against it. A
missing, corrupt (length or checksum) or foreign (another identity, no
stamp) object is a miss: the reader goes to the origin, and the block it gets
there replaces the bad object.

Contract (as every tier): :meth:`SharedTier.get` returns verified bytes or
None and never raises; :meth:`SharedTier.put` never waits and never raises.

* Publishing: a block that came from the origin is offered to a bounded
  :class:`~cachefs.read.publishq.PublishQueue`; ``publishers`` tasks write
  queued blocks with ``If-None-Match: *`` (an object already there is left
  alone). A full queue drops the block (``cachefs_shared_publishes_total
  {result="dropped_full"}``); the reader never waits for a publish.
* Fetch leases: after a miss, the node writes a small lease object
  (``PREFIX/leases/H/I.WINDOW``) with ``If-None-Match: *``. The winner fetches
  the block from the origin and publishes it; a node whose lease write gets
  412 polls the shared tier for up to ``lease_wait`` seconds and then fetches
  from the origin itself. A lease holds its node's identity (``node``: made once
  and kept in the node's cache directory, with the host's name, see
  :func:`cachefs.startup.node_identity`), so a lease found taken is read once
  (one small GET) and, when it is this node's own -- written before a crash
  and restart on the same cache directory, or earlier in this run -- taken
  over at once (``reclaimed``) instead of waited for. Lease keys change every ``lease_window`` seconds
  (wall clock), so a lease of a node that died expires without a delete (and
  costs at most one ``lease_wait`` per block before that: the node that gave up
  waiting fetches and publishes the block itself); a long window keeps leases
  taken at the end of one epoch valid while their blocks are published. At
  start the tier checks that the store honours ``If-None-Match`` (a second
  conditional write of one key must fail); if not, leases are off and it says
  so once. Until a check gets through, leases are taken as if it did (S3, S3
  Express, SeaweedFS and MinIO do); a check that fails (the tier is down at
  mount) is made again after the breaker's cooldown, doubled after each failure
  up to ``PROBE_MAX``, and when the tier did not answer it, as soon as another
  request to the tier is answered but never within a cooldown of the last
  check: a node mounted while its tier was down checks it once it is back,
  with at most one check (three small requests) per cooldown, not per request.
  A lease costs one in-region write per miss and pays off only when
  another node misses the same block at the same moment, which disjoint
  readers (DistributedSampler) never do. So a miss first writes its lease in
  the background and fetches at once (nodes that miss the block a moment later
  still find the lease and wait); only once a lease was found taken
  (``raced``: both nodes fetched that block) do misses wait for their lease's
  answer before fetching, until ``LEASE_HISTORY`` leases in a row were won.
* Never a single point of failure: every request has a latency budget
  (``timeout``): the client's socket timeouts fail a request whose store does
  not answer within it (in the worker thread), and the trio side gives up on
  a request after ``HARD_LIMIT`` budgets whatever it is doing. An error or a
  timeout is a miss, and ``breaker_threshold`` of them in a row open the
  :class:`~cachefs.read.breaker.CircuitBreaker`: lookups and publishes are
  then skipped at once until a trial request succeeds. Time spent waiting for
  a free worker thread (local congestion) is not the store's fault and does
  not count against the budget. Writes refused for good reasons (access
  denied, store full, no such bucket) stop publishing and leases only (one log
  line); reads go on. A write is tried again after ``REFUSED_RETRY_FIRST``
  seconds, doubled at each refusal up to ``PUBLISH_RETRY`` (a read-only tier is
  asked about once every 5 minutes), and sooner -- no sooner than
  ``REFUSED_RETRY_MIN`` after the refusal -- once the tier answers again after
  the breaker opened: a bucket deleted and made again refuses writes and fails
  reads until it is back, and publishing resumes with the reads. Writes the store answers with a
  throttle or a server error (503 SlowDown, 500: every node publishing at once,
  a store short of space) say nothing of its reads, so they never feed the
  breaker: ``breaker_threshold`` of them in a row pause publishing and leases
  (one log line) for ``breaker_cooldown`` seconds, doubled at each pause up to
  ``THROTTLE_MAX``, until a write succeeds (one line). A write that gets no
  answer (a timeout, a refused or reset connection) feeds the breaker as a
  read's does.
* Withdrawal: blocks whose bytes failed a check after they were offered
  (the combined CRC of a multi-block object, see :mod:`cachefs.read.assembled`)
  are taken back (:meth:`SharedTier.withdraw`): a queued publish is dropped, a
  publish being written deletes its object once written, and what may already
  be in the tier is deleted (in the background, retried ``WITHDRAW_ATTEMPTS``
  times). Until this node publishes the block again, its own lookups of it are
  misses (a delete that failed must not make it serve the bytes back), and its
  next publish overwrites. Another node that read the block from the tier
  before the delete keeps its copy (that node's own checks apply to what it
  fetched from the origin only).
* Cluster warm: :meth:`shard_of` assigns every block to one of N nodes by its
  identity hash (stable across nodes); :meth:`ensure_published` makes sure a
  block this node holds is in the shared tier (``cachefs warm --shard``).

Concurrency: every method runs on the trio thread; blocking client calls run
in worker threads under ``threads`` (a CapacityLimiter); a call over budget is
abandoned (its thread ends when the socket times out). The publisher tasks and
the start-up probe and background lease writes are owned by :meth:`run`'s
nursery.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import trio
import xxhash

from cachefs import metrics
from cachefs.errors import AccessDenied, CredentialsError, StoreError, TransientStoreError
from cachefs.read.breaker import CircuitBreaker
from cachefs.read.publishq import Publish, PublishQueue
from cachefs.read.tiers import BlockRef
from cachefs.s3.objects import ObjectClient, RequestTimeout, Response

log = logging.getLogger(__name__)

FORMAT = "v1"
STAMP = "cachefs-block"  # user metadata key (x-amz-meta-cachefs-block)
PUBLISH_RETRY = 300.0  # longest pause of publishing after a refused write (s)
REFUSED_RETRY_FIRST = 15.0  # its first pause, doubled at each refused retry (s)
REFUSED_RETRY_MIN = 10.0  # a write is tried again no sooner after a refusal (s)
THROTTLE_MAX = 60.0  # longest pause of publishing while the store throttles writes (s)
WARM_PUBLISH_ATTEMPTS = 6  # writes of one block a warm tries while the store throttles them
WARM_RETRY_FIRST = 0.5  # its first wait before trying again (s), doubled each time
HARD_LIMIT = 3  # budgets after which the trio side abandons a request
LEASE_HISTORY = 32  # leases won in a row after contention before misses stop waiting on them
MAX_ANNOUNCING = 64  # lease writes in flight in the background, at most
LEASE_GRACE = 0.1  # without contention, a miss waits this share of the budget for its lease
POLL_FIRST, POLL_MAX = 0.05, 0.4  # a lease loser's polls: backoff from, up to (s)
WITHDRAW_ATTEMPTS = 4  # deletes of a withdrawn block tried, 1 s apart
PROBE_MAX = 60.0  # longest wait between start-up checks while they fail (s)

T = TypeVar("T")


class BudgetExceeded(RequestTimeout):
    """A shared-tier request did not finish within HARD_LIMIT latency budgets."""


class _LeaseWrite:
    """A lease write in the background: its answer, and whether its miss went ahead."""

    __slots__ = ("abandoned", "done", "won")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.won: bool | None = None
        self.abandoned = False


@dataclasses.dataclass(frozen=True)
class SharedSettings:
    timeout: float = 1.0  # latency budget of one lookup, lease or HEAD
    publish_timeout: float = 5.0  # of one block PUT (background)
    queue_bytes: int = 64 << 20
    publishers: int = 8
    threads: int = 32
    leases: bool = True
    lease_window: float = 600.0
    lease_wait: float = 2.0
    breaker_threshold: int = 3
    breaker_cooldown: float = 2.0
    remembered_keys: int = 65536  # keys known bad / leased / withdrawn (each bounded)


class SharedLayout:
    """Object names and stamps of the blocks of one source bucket and block size."""

    def __init__(self, prefix: str, source_bucket: str, block_size: int) -> None:
        self.prefix = prefix
        self.source_bucket = source_bucket
        self.block_size = block_size

    def _object(self, ref: BlockRef) -> str:
        text = f"{self.source_bucket}\0{ref.obj.key}\0{ref.obj.etag}\0{self.block_size}"
        return hashlib.sha256(text.encode()).hexdigest()[:40]

    def block_key(self, ref: BlockRef) -> str:
        return f"{self.prefix}{FORMAT}/{self._object(ref)}/{ref.index:010d}"

    def lease_key(self, ref: BlockRef, window: int) -> str:
        return f"{self.prefix}leases/{self._object(ref)}/{ref.index:010d}.{window}"

    def identity(self, ref: BlockRef) -> str:
        text = (f"{FORMAT}\0{self.source_bucket}\0{ref.obj.key}\0{ref.obj.etag}\0"
                f"{self.block_size}\0{ref.index}")
        return hashlib.sha256(text.encode()).hexdigest()

    def stamp(self, ref: BlockRef, data: bytes) -> str:
        return f"{FORMAT}:{self.identity(ref)}:{len(data)}:{xxhash.xxh3_64_hexdigest(data)}"

    def shard_of(self, ref: BlockRef, nodes: int) -> int:
        """The node (0..nodes-1) that warms this block: stable on every node."""
        return int(self.identity(ref)[:16], 16) % nodes

    def check_headers(self, ref: BlockRef, headers: dict[str, str]) -> str | None:
        """None when the stamp names this block with its length and the object has that
        length (Content-Length, when stated: an object cut short may keep its metadata),
        else "foreign"/"corrupt"."""
        stamp = headers.get(f"x-amz-meta-{STAMP}", "")
        fmt, _, rest = stamp.partition(":")
        identity, _, rest = rest.partition(":")
        length, _, _digest = rest.partition(":")
        if fmt != FORMAT or identity != self.identity(ref):
            return "foreign"
        if length != str(ref.length):
            return "corrupt"
        if headers.get("content-length", length) != length:
            return "corrupt"
        return None

    def verify(self, ref: BlockRef, resp: Response) -> tuple[bytes | None, str]:
        """(the block's bytes, "hit") or (None, "foreign" | "corrupt")."""
        problem = self.check_headers(ref, resp.headers)
        if problem is not None:
            return None, problem
        if len(resp.body) != ref.length or self.stamp(ref, resp.body) != resp.headers.get(
                f"x-amz-meta-{STAMP}"):
            return None, "corrupt"
        return resp.body, "hit"


class _Keys:
    """A bounded set of keys (the oldest forgotten first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def discard(self, key: str) -> None:
        self._keys.pop(key, None)

    def __contains__(self, key: str) -> bool:
        return key in self._keys


class SharedTier:
    """The shared tier of one mount (see the module docstring)."""

    name = "shared"

    def __init__(self, client: ObjectClient, layout: SharedLayout, *, label: str,
                 settings: SharedSettings | None = None, node: str | None = None) -> None:
        self.client = client
        self.layout = layout
        self.label = label  # s3://bucket/prefix, for log lines and status
        self.settings = s = settings or SharedSettings()
        self.breaker = CircuitBreaker(f"shared cache tier {label}", threshold=s.breaker_threshold,
                                      cooldown=s.breaker_cooldown)
        self.queue = PublishQueue(s.queue_bytes)
        self.leases_on = s.leases
        self.conditional_writes: bool | None = None  # None: not checked (yet)
        self._limiter = trio.CapacityLimiter(s.threads)
        self._bad = _Keys(s.remembered_keys)  # seen corrupt or foreign: overwrite on publish
        self._leased = _Keys(s.remembered_keys)  # this node holds the fetch lease
        self._withdrawn = _Keys(s.remembered_keys)  # failed a check: never served from here
        self._publish_off_until = 0.0  # monotonic; publishing refused until then
        # Writes were refused, and none has been taken since: a refusal at the retry is
        # not logged again, the first write taken is (a node with read-only credentials
        # logged two lines every PUBLISH_RETRY for its whole life)
        self._refusing = False
        # The next pause after a refused write; when (monotonic) the last one was refused.
        self._refused_pause = REFUSED_RETRY_FIRST
        self._refused_at = 0.0
        # Writes answered with a throttle or a server error, in a row; publishing paused
        # until (monotonic) while they go on; the next pause's length.
        self._throttled = 0
        self._throttled_until = 0.0
        self._throttle_pause = s.breaker_cooldown
        self._last_error = ""  # the last failure or refusal, for why_unpublished
        # Recent lease outcomes (True: another node held it); background lease writes.
        self._contention: deque[bool] = deque(maxlen=LEASE_HISTORY)
        self._announcing = 0
        self._nursery: trio.Nursery | None = None
        # Set when the tier answers a request, while a failed start-up check waits for it.
        self._answered: trio.Event | None = None
        # What this node's leases hold: the same across its restarts (the daemon passes
        # its cache directory's identity); without one, this run's alone.
        self._node = node or f"{socket.gethostname()}:{os.urandom(8).hex()}"
        metrics.SHARED_ENABLED.set(1)
        metrics.SHARED_PUBLISH_ENABLED.set(1)

    # -- tier protocol ------------------------------------------------------------------
    def contains(self, ref: BlockRef) -> bool:
        return False  # cannot tell without a request

    async def get(self, ref: BlockRef) -> bytes | None:
        if not self.breaker.allow():
            metrics.SHARED_LOOKUPS.labels("skipped").inc()
            return None
        key = self.layout.block_key(ref)
        if key in self._withdrawn:
            # This node took the block back (bad bytes); the tier may still hold them if
            # the delete failed. The origin, until this node publishes it again.
            metrics.SHARED_LOOKUPS.labels("skipped").inc()
            return None
        data, result = await self._lookup(ref, key)
        # Only a plain miss is worth a lease: a bad object is replaced by this node, and
        # a failing tier is left alone.
        if result != "miss" or not self.leases_on or not self.can_publish():
            return data
        return await self._lease_or_wait(ref, key)

    async def put(self, ref: BlockRef, data: bytes) -> None:
        if not self.can_publish():
            metrics.SHARED_PUBLISHES.labels("dropped_unavailable").inc()
            return
        key = self.layout.block_key(ref)
        item = Publish(key, ref, data, overwrite=key in self._bad, leased=key in self._leased)
        if not self.queue.offer(item):
            metrics.SHARED_PUBLISHES.labels("dropped_full").inc()

    async def withdraw(self, refs: Sequence[BlockRef]) -> None:
        """Take back blocks whose bytes failed a check (see the module docstring). Never
        waits for the store: the deletes run in :meth:`run`'s nursery."""
        keys = []
        for ref in refs:
            key = self.layout.block_key(ref)
            self._withdrawn.add(key)
            self._bad.add(key)  # the next publish overwrites whatever is there
            self._leased.discard(key)
            self.queue.withdraw(key)  # one being written deletes its own object afterwards
            keys.append(key)
        metrics.SHARED_PUBLISHES.labels("withdrawn").inc(len(keys))
        if self._nursery is None:  # not running (stopping): nothing can be written either
            log.warning("shared cache tier %s: not running; %d withdrawn blocks not deleted",
                        self.label, len(keys))
            return
        self._nursery.start_soon(self._delete_withdrawn, keys)

    async def _delete_withdrawn(self, keys: list[str]) -> None:
        """Delete withdrawn blocks from the tier, each tried WITHDRAW_ATTEMPTS times."""
        for key in keys:
            for attempt in range(WITHDRAW_ATTEMPTS):
                if attempt:
                    await trio.sleep(1.0)
                if key not in self._withdrawn:
                    break  # published again (verified bytes) meanwhile: keep that
                try:
                    await self._call(self.settings.publish_timeout, self.client.delete, key)
                except StoreError as exc:
                    log.debug("deleting withdrawn block %s failed: %s", key, exc)
                    continue
                break
            else:
                metrics.SHARED_PUBLISHES.labels("withdraw_failed").inc()
                log.warning("shared cache tier %s: could not delete %s (a block whose bytes "
                            "failed the origin's checksum); other nodes may read it until "
                            "it is replaced", self.label, key)

    # -- lifecycle ------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Own the publisher tasks and the start-up probe; returns when cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery  # also owns the background lease writes
            for _ in range(max(1, self.settings.publishers)):
                nursery.start_soon(self._publisher)
            nursery.start_soon(self._probe)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    async def drain(self) -> None:
        """Wait until every queued block has been published or given up."""
        await self.queue.wait_idle()

    def describe(self) -> dict[str, Any]:
        """The tier's state for ``cachefs status``. Read-only: may run in a worker thread."""
        off_until = max(self._publish_off_until, self._throttled_until)
        publishing = not self.breaker.is_open and (not off_until
                                                   or time.monotonic() >= off_until)
        return {"url": self.label, "endpoint": self.client.endpoint,
                "express_sessions": self.client.sessions is not None,
                "breaker": self.breaker.state, "publishing": publishing,
                "why": "" if publishing and not self.breaker.is_open else self.why_unpublished(),
                "leases": self.leases_on, "conditional_writes": self.conditional_writes}

    # -- requests ---------------------------------------------------------------------------
    async def _call(self, budget: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, timeout=budget, **kwargs)`` in a worker thread: the client fails a
        request the store does not answer within ``budget`` (RequestTimeout); the wait
        for a free thread does not count; past HARD_LIMIT budgets in all, the request is
        abandoned (BudgetExceeded). Raises StoreError."""
        call = functools.partial(fn, *args, timeout=budget, **kwargs)
        with trio.move_on_after(budget * HARD_LIMIT):
            return await trio.to_thread.run_sync(call, abandon_on_cancel=True,
                                                 limiter=self._limiter)
        raise BudgetExceeded(f"no answer within {budget * HARD_LIMIT:g}s")

    def _answer_seen(self) -> None:
        """A request to the tier was answered: the breaker closes, a failed start-up
        check waiting for an answer may go again (see :meth:`_probe`), and writes refused
        while it did not answer are tried again (no sooner than REFUSED_RETRY_MIN after the
        refusal)."""
        if self.breaker.is_open and self._publish_off_until:
            self._publish_off_until = min(self._publish_off_until,
                                          self._refused_at + REFUSED_RETRY_MIN)
        self.breaker.success()
        if self._answered is not None:
            self._answered.set()

    def _failed(self, exc: StoreError) -> None:
        self._last_error = str(exc)
        self.breaker.failure(str(exc))

    def why_unpublished(self) -> str:
        """Why blocks are not published now, for a person (``cachefs warm --shard``):
        the tier does not answer, refuses or throttles writes; "" when none is known."""
        why = f" ({self._last_error})" if self._last_error else ""
        if self.breaker.is_open:
            return f"it does not answer{why}"
        now = time.monotonic()
        if self._publish_off_until and now < self._publish_off_until:
            return f"it refuses writes{why}"
        if self._throttled_until and now < self._throttled_until:
            return f"it throttles writes{why}"
        return f"its last failure: {self._last_error}" if self._last_error else ""

    def can_publish(self) -> bool:
        if self.breaker.is_open:
            return False
        if self._publish_off_until and time.monotonic() >= self._publish_off_until:
            self._publish_off_until = 0.0  # a trial: the next write tells (see _wrote)
            metrics.SHARED_PUBLISH_ENABLED.set(1)
        if self._publish_off_until:
            return False
        if self._throttled_until:
            if time.monotonic() < self._throttled_until:
                return False
            self._throttled_until = 0.0  # a trial: the next write tells (see _wrote)
            metrics.SHARED_PUBLISH_ENABLED.set(1)
        return True

    def _wrote(self) -> None:
        """A write succeeded: the store takes writes (again)."""
        self._answer_seen()
        if self._refusing:
            self._refusing = False
            log.info("shared cache tier %s takes writes again: publishing", self.label)
        if self._throttled >= self.settings.breaker_threshold:
            log.info("shared cache tier %s takes writes again: publishing", self.label)
        self._throttled = 0
        self._throttle_pause = self.settings.breaker_cooldown
        self._refused_pause = REFUSED_RETRY_FIRST

    def _write_failed(self, exc: StoreError) -> bool:
        """A write failed: refusals stop publishing for a while, the rest feed the breaker.
        Returns whether the store answered it (a refusal, a throttle, a server error)."""
        self._last_error = str(exc)
        refused = isinstance(exc, (AccessDenied, CredentialsError)) or (
            not isinstance(exc, TransientStoreError))
        if not refused:
            if isinstance(exc, TransientStoreError) and exc.reason in ("throttled",
                                                                       "server_error"):
                self._write_throttled(exc)  # answered: nothing to say of reads
                return True
            self._failed(exc)
            return False
        if not self._publish_off_until and not self._refusing:
            log.warning("shared cache tier %s refuses writes (%s): not publishing, tried "
                        "again in %.0fs, then at doubling intervals up to %.0fs, or once it "
                        "answers again after an outage; reads from it go on", self.label,
                        exc, self._refused_pause, PUBLISH_RETRY)
        metrics.SHARED_PUBLISH_ENABLED.set(0)
        self._refusing = True
        now = time.monotonic()
        pause = min(PUBLISH_RETRY, self._refused_pause)
        if self._publish_off_until and self._refused_at and now < self._publish_off_until:
            # (a write in flight refused after another: the pause it began stands)
            return True
        self._refused_at = now
        self._publish_off_until = now + pause
        self._refused_pause = min(PUBLISH_RETRY, pause * 2)
        return True

    def _write_throttled(self, exc: StoreError) -> None:
        """A write answered with a throttle or a server error: pause publishing after
        ``breaker_threshold`` in a row (see the module docstring)."""
        self._throttled += 1
        if self._throttled < self.settings.breaker_threshold or self._throttled_until:
            return
        if self._throttled == self.settings.breaker_threshold:
            log.warning("shared cache tier %s throttles writes (%s): publishing paused, "
                        "reads from it go on", self.label, exc)
        self._throttled_until = time.monotonic() + self._throttle_pause
        self._throttle_pause = min(THROTTLE_MAX, self._throttle_pause * 2)
        metrics.SHARED_PUBLISH_ENABLED.set(0)

    async def _lookup(self, ref: BlockRef, key: str) -> tuple[bytes | None, str]:
        """GET and verify one block: (bytes, "hit") or (None, "miss" | "corrupt" |
        "foreign" | "error" | "timeout"), counted."""
        try:
            resp = await self._call(self.settings.timeout, self.client.get, key)
        except RequestTimeout as exc:
            metrics.SHARED_LOOKUPS.labels("timeout").inc()
            self._failed(exc)
            return None, "timeout"
        except StoreError as exc:
            metrics.SHARED_LOOKUPS.labels("error").inc()
            self._failed(exc)
            return None, "error"
        self._answer_seen()
        if resp is None:
            metrics.SHARED_LOOKUPS.labels("miss").inc()
            return None, "miss"
        data, result = self.layout.verify(ref, resp)
        metrics.SHARED_LOOKUPS.labels(result).inc()
        if data is None:
            log.warning("shared cache tier: %s object at %s (block %d of %s); fetching it from "
                        "the origin", result, key, ref.index, ref.obj.key)
            self._bad.add(key)
            return None, result
        metrics.SHARED_GET_BYTES.inc(len(data))
        return data, result

    def _contended(self) -> bool:
        """Wait for a lease's answer before fetching? While contention was seen among the
        last LEASE_HISTORY leases."""
        return any(self._contention)

    async def _write_lease(self, lease: str) -> bool | None:
        """One conditional lease write: True won (or this node's own already), False
        another node holds it, None the write failed (counted)."""
        try:
            won = await self._call(self.settings.timeout, self.client.put, lease,
                                   self._node.encode(), if_none_match=True, op="lease")
        except StoreError as exc:
            metrics.SHARED_LEASES.labels("error").inc()
            self._write_failed(exc)
            return None
        self._wrote()
        if not won and await self._own_lease(lease):
            metrics.SHARED_LEASES.labels("reclaimed").inc()
            return True  # (no contention: no other node is fetching the block)
        self._contention.append(not won)
        if won:
            metrics.SHARED_LEASES.labels("won").inc()
        return won

    async def _own_lease(self, lease: str) -> bool:
        """Whether the lease found taken is this node's own (see the module docstring);
        False when it cannot be read."""
        try:
            resp = await self._call(self.settings.timeout, self.client.get, lease)
        except StoreError as exc:
            self._failed(exc)
            return False
        self._answer_seen()
        return resp is not None and resp.body == self._node.encode()

    async def _background_lease(self, lease: str, key: str, write: _LeaseWrite) -> None:
        """Write a lease whose miss may not wait for the answer (see _lease_or_wait)."""
        try:
            write.won = await self._write_lease(lease)
        finally:
            self._announcing -= 1
            write.done.set()
        if write.abandoned and write.won is False:
            # The miss went ahead and fetched; so does the node holding the lease.
            metrics.SHARED_LEASES.labels("raced").inc()
            self._leased.discard(key)

    async def _lease_or_wait(self, ref: BlockRef, key: str) -> bytes | None:
        """After a miss: take the block's fetch lease (None: fetch it from the origin) or
        wait for the node that holds it to publish the block."""
        lease = self.layout.lease_key(ref, int(time.time() // self.settings.lease_window))
        if self._contended():
            won = await self._write_lease(lease)
        else:
            # Wait for the answer only briefly; the write goes on in the background.
            if self._nursery is None or self._announcing >= MAX_ANNOUNCING:
                metrics.SHARED_LEASES.labels("skipped").inc()
                return None
            write = _LeaseWrite()
            self._announcing += 1
            self._leased.add(key)
            self._nursery.start_soon(self._background_lease, lease, key, write)
            with trio.move_on_after(self.settings.timeout * LEASE_GRACE):
                await write.done.wait()
            if not write.done.is_set():
                write.abandoned = True
                return None
            won = write.won
        if won is None:
            return None
        if won:
            self._leased.add(key)
            return None
        deadline = trio.current_time() + self.settings.lease_wait
        delay = POLL_FIRST
        while trio.current_time() < deadline:
            await trio.sleep(min(delay, max(0.0, deadline - trio.current_time())))
            delay = min(delay * 2, POLL_MAX)
            if not self.breaker.allow():
                break
            data, result = await self._lookup(ref, key)
            if data is not None:
                metrics.SHARED_LEASES.labels("lost_served").inc()
                return data
            if result != "miss":
                break  # a bad object or a failing tier: the origin, now
        metrics.SHARED_LEASES.labels("lost_timeout").inc()
        return None

    # -- publishing ---------------------------------------------------------------------------
    async def _publisher(self) -> None:
        while True:
            item = await self.queue.take()
            stored = False
            try:
                stored = await self._publish(item)
                if stored and item.withdrawn:
                    # Withdrawn while it was written: what was written goes again.
                    stored = False
                    self._withdrawn.add(item.key)
                    await self._delete_withdrawn([item.key])
            finally:
                self.queue.finish(item, stored)

    async def _publish(self, item: Publish) -> bool:
        """Write one block; True when it is in the tier afterwards (else why not is in
        ``item.failure``: this write's own outcome, which concurrent writes do not change)."""
        if not self.can_publish() or not self.breaker.allow():
            metrics.SHARED_PUBLISHES.labels("dropped_unavailable").inc()
            item.failure = ("throttled" if self._throttled_until and not self.breaker.is_open
                            and not self._publish_off_until else "unavailable")
            return False
        try:
            new = await self._call(
                self.settings.publish_timeout, self.client.put, item.key, item.data,
                metadata={STAMP: self.layout.stamp(item.ref, item.data)},
                if_none_match=not item.overwrite)
        except StoreError as exc:
            metrics.SHARED_PUBLISHES.labels("failed").inc()
            log.debug("publishing %s failed: %s", item.key, exc)
            answered = self._write_failed(exc)
            item.failure = ("throttled" if isinstance(exc, TransientStoreError)
                            and exc.reason in ("throttled", "server_error")
                            else "refused" if answered else "failed")
            return False
        self._wrote()
        metrics.SHARED_PUBLISHES.labels("stored" if new else "present").inc()
        if new:
            metrics.SHARED_PUBLISHED_BYTES.inc(len(item.data))
        if item.withdrawn:
            return True  # the publisher deletes it again
        self._bad.discard(item.key)
        self._leased.discard(item.key)
        self._withdrawn.discard(item.key)
        return True

    async def ensure_published(self, ref: BlockRef,
                               read_local: Callable[[], Awaitable[bytes | None]]) -> bool:
        """Make sure block ``ref`` is in the shared tier, publishing this node's copy
        (``read_local``) if it is not; waits (used by ``cachefs warm --shard``). Returns
        whether the block is there.

        Asks the store every time (a HEAD), unless this node's own publish of the block
        is under way: a warm run again is how an operator puts back what the tier lost
        (a store restarted on emptied disks, a bucket emptied by hand or by a lifecycle
        rule), so what this node once saw there proves nothing. A write the tier
        throttles is tried again, after the tier's pause and at least 0.5, 1, 2... s,
        ``WARM_PUBLISH_ATTEMPTS`` times in all: a cluster warm is every node publishing at
        once, which is what makes a tier throttle."""
        key = self.layout.block_key(ref)
        pending = self.queue.pending(key)
        if pending is not None:
            await pending.done.wait()
            if pending.stored:
                return True
        if not self.breaker.allow():
            return False
        try:
            headers = await self._call(self.settings.timeout, self.client.head, key)
        except StoreError as exc:
            self._failed(exc)
            return False
        self._answer_seen()
        if headers is not None and self.layout.check_headers(ref, headers) is None:
            return True
        data = await read_local()
        if data is None or len(data) != ref.length:
            return False
        item = Publish(key, ref, data, overwrite=headers is not None)
        for attempt in range(WARM_PUBLISH_ATTEMPTS):
            if attempt:
                paused = max(0.0, self._throttled_until - time.monotonic())
                await trio.sleep(min(THROTTLE_MAX, max(paused, WARM_RETRY_FIRST * 2 ** (attempt - 1))))
            if await self._publish(item):
                return True
            # (this write's own outcome: another worker's write that succeeded meanwhile
            # ends the tier's count of throttled writes, not this block's need to wait)
            if item.failure != "throttled":
                return False  # refused or failing, not throttled: no point waiting
        return False

    def shard_of(self, ref: BlockRef, nodes: int) -> int:
        return self.layout.shard_of(ref, nodes)

    # -- start-up ---------------------------------------------------------------------------
    async def _probe(self) -> None:
        """Check the tier until a check gets through (see the module docstring for when
        a failed one is made again). One warning for the first failure, one line for
        the outcome."""
        cooldown = self.settings.breaker_cooldown
        delay = cooldown
        failures = 0
        while True:
            failed = await self._check(failures)
            if failed is None:
                return
            failures += 1
            answered = self._write_failed(failed)
            self._answered = trio.Event()
            try:
                await trio.sleep(cooldown)  # never more often than this
                with trio.move_on_after(max(0.0, delay - cooldown)):
                    if answered:  # refused or throttled: the full wait
                        await trio.sleep_forever()
                    else:  # it did not answer: again once the tier answers a request
                        await self._answered.wait()
            finally:
                self._answered = None
            delay = min(PROBE_MAX, delay * 2)

    async def _check(self, failures: int) -> StoreError | None:
        """Check access and whether the store honours If-None-Match (leases need it);
        the error when the check failed (the caller counts it), else None."""
        key = f"{self.layout.prefix}leases/probe-{self._node}-{os.urandom(4).hex()}"
        try:
            first = await self._call(self.settings.timeout * 5, self.client.put, key, b"1",
                                     if_none_match=True, op="lease")
            second = await self._call(self.settings.timeout * 5, self.client.put, key, b"2",
                                      if_none_match=True, op="lease")
            await self._call(self.settings.timeout * 5, self.client.delete, key)
        except StoreError as exc:
            if not failures:
                log.warning("shared cache tier %s: start-up check failed (%s); reads go to "
                            "the origin while it fails, and it is checked again once it "
                            "answers", self.label, exc)
            else:
                log.debug("shared cache tier %s: check failed again (%s)", self.label, exc)
            return exc
        self._wrote()
        self.conditional_writes = first and not second
        if not self.conditional_writes:
            self.leases_on = False
            log.warning("shared cache tier %s ignores If-None-Match: fetch leases off "
                        "(concurrent misses of one block may each fetch it from the origin)",
                        self.label)
        else:
            log.info("shared cache tier %s at %s ready (conditional writes honoured, fetch "
                     "leases %s); this node's leases hold %s", self.label,
                     self.client.endpoint, "on" if self.leases_on else "off", self._node)
        return None

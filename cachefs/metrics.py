"""Prometheus metrics: every metric cachefs exports is defined here, once.

Naming follows Prometheus conventions: ``cachefs_`` prefix, base units (bytes,
seconds), ``_total`` for counters, no per-path labels (label values come from
small fixed sets such as S3 operation names).

All cachefs metrics live in :data:`REGISTRY` (not the process-global default
registry) so tests can start several daemons' worth of components in one process.
The exposition (:data:`EXPOSED`, what /metrics serves) is REGISTRY plus the
process, platform and garbage-collector collectors, which the status snapshot
(:func:`totals`) never needs (the process collector reads /proc).

Thread-safety: prometheus_client metrics are thread-safe; they may be updated
from the trio thread and from worker threads alike.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from cachefs import __version__
from cachefs.errors import ConfigError

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry(auto_describe=True)


class CatchUp:
    """Registered first, so it runs first at every collection (a scrape, a status report):
    calls each function given to :meth:`add` -- work that changes counters after the fact,
    such as the bookkeeping of the opens the native loop answered (cachefs.fuse_ops) --
    so that what is collected includes it. Yields no metric."""

    def __init__(self) -> None:
        self._hooks: list[Callable[[], None]] = []

    def add(self, hook: Callable[[], None]) -> None:
        self._hooks.append(hook)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for hook in list(self._hooks):
            hook()
        return iter(())


CATCH_UP = CatchUp()
REGISTRY.register(CATCH_UP)
#: What /metrics serves: cachefs's own metrics and the process's.
EXPOSED = CollectorRegistry()
EXPOSED.register(REGISTRY)
ProcessCollector(registry=EXPOSED)
PlatformCollector(registry=EXPOSED)
# python_gc_collections_total{generation}: the collector's pauses hold the interpreter lock
# (see cachefs.gcpolicy); a full collection now and then is expected, a steady rate is not.
GCCollector(registry=EXPOSED)

#: The thread groups ``cachefs_thread_cpu_seconds_total{threads}`` counts by, from the
#: Python name of a thread (first matching prefix); the rest is "other" (trio's worker
#: threads writing the cache and listing, the metrics server, the status publisher).
THREAD_GROUPS = (("MainThread", "event_loop"), ("cachefs-fuse", "fuse"),
                 ("cachefs-s3", "s3"), ("cachefs-connect", "s3"),
                 ("cachefs-verify", "verify"), ("cachefs-readahead", "readahead"))


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def thread_group(name: str) -> str:
    """The ``threads`` label of a thread named ``name`` (see :data:`THREAD_GROUPS`)."""
    for prefix, group in THREAD_GROUPS:
        if name.startswith(prefix):
            return group
    return "other"


class ThreadCpu:
    """``cachefs_thread_cpu_seconds_total{threads}``: the daemon's CPU by what its threads
    do -- the trio thread (``event_loop``: when it nears one core, every cold read waits
    for it), the FUSE request workers, the S3 threads, passthrough's verifying threads.

    Read at each scrape from ``/proc/self/task/<tid>/schedstat``: the scheduler's count of
    the time each thread ran, in nanoseconds. Not ``stat``'s ticks (nor ``top -H``, which
    shows them): a thread that runs in bursts of microseconds between sleeps, as an S3
    thread does for each answer, is rarely running when a tick samples it; its ticks
    came to a twentieth of what the scheduler counted (benchmarks/RESULTS.md,
    nineteenth round). Each scrape adds every thread's growth since the last one to the
    group of the thread's current name, so a counter never goes back when a thread is
    renamed or ends. What threads that ended since the last scrape ran after it (trio's
    idle workers end after 10 s) is the process's total growth (``/proc/self/stat``, which
    keeps ended threads' time, to its 10 ms ticks) less the live threads': it goes to the
    group the threads that ended were in (to "other" when they were in several, or when
    none that ended was seen: a thread born and gone between two scrapes). Registered with
    :data:`EXPOSED` only: the status snapshot does not pay for reading a file per thread.
    Thread-safety: collections are serialised by a lock (scrapes may overlap)."""

    def __init__(self, proc: str = "/proc/self") -> None:
        self._proc = proc
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[int, str]] = {}  # tid -> (ns, group) at the last look
        self._process_ns: int | None = None
        self._carry = 0  # ns the live threads ran beyond the process's ticks (<= 0)
        self._totals: dict[str, int] = {group: 0 for _, group in THREAD_GROUPS}
        self._totals["other"] = 0

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily("cachefs_thread_cpu_seconds", "", labels=["threads"])]

    def _process_total(self) -> int | None:
        try:
            with open(f"{self._proc}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // _CLK_TCK
        except (OSError, ValueError, IndexError):
            return None

    def sample(self) -> dict[str, float]:
        """Seconds of CPU so far per thread group (what a collection exports)."""
        names = {str(t.native_id): t.name for t in threading.enumerate()}
        with self._lock:
            process = self._process_total()
            seen: dict[str, tuple[int, str]] = {}
            grown_live = 0
            try:
                tids = os.listdir(f"{self._proc}/task")
            except OSError:
                tids = []
            for tid in tids:
                try:
                    with open(f"{self._proc}/task/{tid}/schedstat", "rb") as f:
                        ran = int(f.read().split()[0])
                except (OSError, ValueError, IndexError):
                    continue  # (ended while read, or no schedstat in this kernel)
                group = thread_group(names.get(tid, ""))
                before = self._seen.get(tid, (0, group))[0]
                grown = ran - before if ran >= before else ran  # (a reused tid: a new thread)
                self._totals[group] += grown
                grown_live += grown
                seen[tid] = (ran, group)
            if process is not None and self._process_ns is not None:
                # Ran by threads gone since the last look; below zero, the ticks' rounding,
                # carried to the next look so the groups never sum past the process.
                unseen = process - self._process_ns - grown_live + self._carry
                ended = {group for tid, (_, group) in self._seen.items() if tid not in seen}
                if unseen > 0:
                    self._totals[ended.pop() if len(ended) == 1 else "other"] += unseen
                self._carry = min(unseen, 0)
            self._seen = seen
            if process is not None:
                self._process_ns = process
            return {group: ns / 1e9 for group, ns in self._totals.items()}

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "cachefs_thread_cpu_seconds",
            "CPU time of the daemon's threads by what they do (event_loop: the trio thread; "
            "fuse: request workers; s3: S3 requests; verify: passthrough's checks), as the "
            "scheduler counts it", labels=["threads"])
        for group, seconds in self.sample().items():
            family.add_metric([group], seconds)
        yield family


THREAD_CPU = ThreadCpu()
EXPOSED.register(THREAD_CPU)


#: Default scrape port: clear of node_exporter (9100), dcgm-exporter (9400),
#: 9109 and JuiceFS (9567).
DEFAULT_METRICS_PORT = 9477

# Latency buckets (seconds) resolving NVMe hits (tens of microseconds) up to
# cross-region misses (hundreds of milliseconds) and retried requests (seconds).
LATENCY_BUCKETS = (
    0.00002, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)

BUILD_INFO = Info("cachefs_build", "cachefs build information", registry=REGISTRY)
BUILD_INFO.info({"version": __version__})

# --- block cache -----------------------------------------------------------
CACHE_HIT_BYTES = Counter(
    "cachefs_cache_hit_bytes",
    "Bytes of file reads served from the block cache (a file read without the daemon, by "
    "passthrough or the C loop: its whole object at each open)",
    registry=REGISTRY)
CACHE_MISS_BYTES = Counter(
    "cachefs_cache_miss_bytes", "Bytes of file reads that had to be fetched from S3", registry=REGISTRY)
CACHE_HIT_REQUESTS = Counter(
    "cachefs_cache_hit_requests", "Block lookups answered by the cache", registry=REGISTRY)
CACHE_MISS_REQUESTS = Counter(
    "cachefs_cache_miss_requests", "Block lookups the cache could not answer", registry=REGISTRY)
CACHE_USED_BYTES = Gauge(
    "cachefs_cache_used_bytes", "Disk space the cached blocks take (each block's length "
    "rounded up to the file system's allocation unit), counted against the capacity",
    registry=REGISTRY)
CACHE_CAPACITY_BYTES = Gauge(
    "cachefs_cache_capacity_bytes", "Configured disk cache size (--cache-size; the index is "
    "beside it)", registry=REGISTRY)
CACHE_BLOCKS = Gauge(
    "cachefs_cache_blocks", "Blocks held in the disk cache", registry=REGISTRY)
CACHE_EVICTIONS = Counter(
    "cachefs_cache_evictions", "Blocks evicted from the disk cache", registry=REGISTRY)
CACHE_EVICTED_BYTES = Counter(
    "cachefs_cache_evicted_bytes", "Disk space freed by evictions (as cachefs_cache_used_bytes "
    "counts it)", registry=REGISTRY)
CACHE_ADMISSION_REJECTS = Counter(
    "cachefs_cache_admission_rejected", "Blocks not admitted because the cache was full "
    "(keep policy) or the disk was out of space", registry=REGISTRY)
CACHE_OBJECTS_TRUSTED = Counter(
    "cachefs_cache_objects_trusted",
    "Objects handed to the kernel (passthrough) without reading their file back: this daemon "
    "wrote every block of it from checked bytes and released none since",
    registry=REGISTRY)
CACHE_CORRUPT_BLOCKS = Counter(
    "cachefs_cache_corrupt_blocks", "Cached blocks that failed verification and were refetched",
    registry=REGISTRY)
CACHE_WRITE_ERRORS = Counter(
    "cachefs_cache_write_errors", "Blocks that could not be written to the cache (e.g. disk full)",
    registry=REGISTRY)
CACHE_INDEX_ERRORS = Counter(
    "cachefs_cache_index_errors", "Cache index (LMDB) reads that failed; each was served as "
    "a cache miss", registry=REGISTRY)
LMDB_READERS = Gauge(
    "cachefs_lmdb_readers", "LMDB reader slots in use (what mdb_stat -r lists)", registry=REGISTRY)
LMDB_READER_SLOTS = Gauge(
    "cachefs_lmdb_reader_slots", "LMDB reader slots configured", registry=REGISTRY)
THREAD_HOPS = Counter(
    "cachefs_thread_hops", "Calls handed from the request loop to a worker thread, by what "
    "they do", ["op"], registry=REGISTRY)

# --- file system -----------------------------------------------------------


class ReadBytes:
    """``cachefs_read_bytes_total``: bytes the Python handlers returned (:meth:`inc`, any
    thread) plus those of every added source (the native loop's reads,
    :mod:`cachefs.fuse.native`), summed at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0
        self._sources: list[Callable[[], int]] = []

    def inc(self, n: int) -> None:
        with self._lock:
            self._value += n

    def add_source(self, source: Callable[[], int]) -> None:
        with self._lock:
            self._sources.append(source)

    @property
    def value(self) -> int:
        with self._lock:
            sources = list(self._sources)
            value = self._value
        return value + sum(source() for source in sources)

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("cachefs_read_bytes",
                                     "Bytes returned to readers through the mount")
        family.add_metric([], self.value)
        yield family


READ_BYTES = ReadBytes()
REGISTRY.register(READ_BYTES)


class OwnedCount:
    """One series of an :class:`OwnedCounters` family: a count only its owner thread
    (the trio thread) adds to, in a plain attribute -- no lock. prometheus-client's
    ``inc`` takes a lock per call, and the trio thread counts every block it requests
    ahead (a cold small file each)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        """Add ``amount`` (the owner thread only: two threads adding at once may lose
        one's addition)."""
        self.value += amount


class OwnedCounters:
    """A counter family with one label, exported as prometheus-client's ``Counter`` is
    (``<name>_total`` by label), whose series are :class:`OwnedCount` objects: each
    added to by one thread only (the trio thread); read by the collector on any thread
    (one attribute read). ``labels(value)`` as for a ``Counter`` (any thread)."""

    def __init__(self, name: str, documentation: str, label: str) -> None:
        self.name, self.documentation, self.label = name, documentation, label
        self._series: dict[str, OwnedCount] = {}
        self._lock = threading.Lock()

    def labels(self, value: str) -> OwnedCount:
        series = self._series.get(value)
        if series is None:
            with self._lock:
                series = self._series.setdefault(value, OwnedCount())
        return series

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=[self.label])
        for value, series in list(self._series.items()):
            family.add_metric([value], series.value)
        yield family
FUSE_HANDED_OVER = Counter(
    "cachefs_fuse_handed_over", "FUSE requests a request worker could not answer itself, by "
    "how: 'deferred' to the trio thread (a wake-up and a task), or 'joined' to a fetch under "
    "way (answered when it lands)", ["how"], registry=REGISTRY)
FUSE_ERRORS = Counter(
    "cachefs_fuse_errors", "FUSE requests answered with an error", ["op", "errno"],
    registry=REGISTRY)
FUSE_INTERNAL_ERRORS = Counter(
    "cachefs_fuse_internal_errors", "Unexpected exceptions in FUSE handlers (answered EIO)",
    registry=REGISTRY)
SKIPPED_KEYS = Counter(
    "cachefs_skipped_keys", "Object keys not shown because they cannot be file names or are "
    "shadowed by a directory of the same name", ["reason"], registry=REGISTRY)
OPEN_HANDLES = Gauge(
    "cachefs_open_file_handles", "Open file handles", registry=REGISTRY)

# --- FUSE passthrough (the kernel reads fully cached objects itself) ------------
# With native reads (cachefs.fuse.native) instead of the kernel, the same metrics count
# the files registered with the native loop; cachefs_native_reads_enabled says which.
PASSTHROUGH_OPENS = Counter(
    "cachefs_passthrough_opens", "Opens answered with passthrough to the cache file (or "
    "bound to it for the native loop's reads)",
    registry=REGISTRY)
PASSTHROUGH_UPGRADED = Counter(
    "cachefs_passthrough_upgraded", "Handles opened before their object was cached whole "
    "that were bound to its file for the native loop's reads once it was (no passthrough: "
    "the kernel decides that at the open)",
    registry=REGISTRY)
PASSTHROUGH_DECLINED = Counter(
    "cachefs_passthrough_declined", "Opens served by the daemon instead, by reason",
    ["reason"], registry=REGISTRY)
PASSTHROUGH_PREPARED = Counter(
    "cachefs_passthrough_prepared", "Files predicted to be opened next, verified and "
    "registered ahead of their open (registered; written: by the S3 thread that wrote "
    "them) or not, by outcome", ["outcome"],
    registry=REGISTRY)
PASSTHROUGH_READ_BACKS = Counter(
    "cachefs_passthrough_read_backs", "Cached objects an open (or a bind for the native "
    "loop) could not register without reading their file back (cached by an earlier "
    "daemon, too large to read at the open), read back once in the background, by outcome: "
    "verified (its opens are registered from then on), failed (a block failed its check: "
    "dropped, fetched again when read), gone (evicted or changed before or during it), "
    "dropped (the queue was full)", ["outcome"], registry=REGISTRY)
PASSTHROUGH_BACKINGS = Gauge(
    "cachefs_passthrough_backing_files", "Cache files the kernel (or the native loop) "
    "currently reads directly",
    registry=REGISTRY)
PASSTHROUGH_VERIFIED_BYTES = Counter(
    "cachefs_passthrough_verified_bytes", "Bytes of cache files checked before they were "
    "registered for reads without the daemon (read back, or trusted as written by this "
    "daemon: cachefs_cache_objects_trusted_total)",
    registry=REGISTRY)
PASSTHROUGH_YIELDED = Counter(
    "cachefs_passthrough_yielded", "Idle registered cache files closed because the cache "
    "evicted their blocks (room for new blocks)",
    registry=REGISTRY)
PASSTHROUGH_CHANGED = Counter(
    "cachefs_passthrough_changed", "Registered cache files found changed since they were "
    "verified (written to by another process, or damaged) at an open: closed and verified "
    "again when idle, the open refused (EIO) while handles still read them",
    registry=REGISTRY)
PASSTHROUGH_UNKNOWN_RELEASES = Counter(
    "cachefs_passthrough_unknown_releases", "Releases of a handle's registered file that "
    "the bookkeeping did not know (a bug: logged once; what is registered is left as it "
    "was, and may stay registered until the daemon ends)",
    registry=REGISTRY)
PASSTHROUGH_ENABLED = Gauge(
    "cachefs_passthrough_enabled", "1 while opens may use FUSE passthrough", registry=REGISTRY)
NATIVE_READS_ENABLED = Gauge(
    "cachefs_native_reads_enabled", "1 while reads of verified cache files are answered by "
    "the native request loop (without FUSE passthrough)", registry=REGISTRY)


class NativeAnswers:
    """``cachefs_fuse_native_answers_total{op}``: the FUSE requests the native loop
    answered without Python (:mod:`cachefs.fuse.native`), read from its counts at scrape
    time (they are also in ``cachefs_fuse_requests_total``)."""

    def __init__(self) -> None:
        self.source: Callable[[], dict[str, int]] | None = None
        self.direct_reads: Callable[[], int] | None = None

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "cachefs_fuse_native_answers", "FUSE requests answered by the native loop "
            "without Python (reads of verified files, remembered lookups, ioctls)",
            labels=["op"])
        source = self.source
        for op, value in sorted((source() if source is not None else {}).items()):
            family.add_metric([op], value)
        yield family
        direct = self.direct_reads
        yield CounterMetricFamily(
            "cachefs_native_direct_reads", "Reads of those the native loop made from the "
            "cache disk with O_DIRECT (an object's last bytes, none in the page cache: "
            "cached once, for the FUSE file, not twice)", value=direct() if direct is not None else 0)


NATIVE_ANSWERS = NativeAnswers()
REGISTRY.register(NATIVE_ANSWERS)
NATIVE_OPEN_TEMPLATES = Gauge(
    "cachefs_native_open_templates", "Files whose opens the native loop answers without "
    "Python (registered files opened before)", registry=REGISTRY)

# --- S3 --------------------------------------------------------------------
S3_REQUESTS = Counter(
    "cachefs_s3_requests", "S3 requests sent (each attempt counts)", ["op"], registry=REGISTRY)
S3_ERRORS = Counter(
    "cachefs_s3_errors", "S3 requests that failed", ["op", "kind"], registry=REGISTRY)
S3_RETRIES = Counter(
    "cachefs_s3_retries", "S3 requests retried after a transient failure, by reason (throttled, "
    "server_error, timeout, connection, unreachable, short_body, integrity)", ["op", "reason"],
    registry=REGISTRY)
S3_DEADLINE_EXCEEDED = Counter(
    "cachefs_s3_deadline_exceeded", "S3 requests given up because they kept failing until the "
    "retry deadline (--retry-deadline): each one failed a read (EIO)", ["op"], registry=REGISTRY)
S3_HEDGES_SENT = Counter(
    "cachefs_s3_hedges_sent", "Second GETs sent because the first went silent for longer "
    "than the hedge delay", registry=REGISTRY)
S3_HEDGES_WON = Counter(
    "cachefs_s3_hedges_won", "Hedged GETs whose second request answered first",
    registry=REGISTRY)
S3_HEDGE_DELAY = Gauge(
    "cachefs_s3_hedge_delay_seconds", "Silence after which a GET is hedged (from the p99 of "
    "recent first-byte latencies, with a floor)", registry=REGISTRY)
S3_CONCURRENCY_LIMIT = Gauge(
    "cachefs_s3_concurrency_limit", "S3 requests allowed in flight now (--max-connections, "
    "lowered while S3 throttles)", registry=REGISTRY)
S3_INTEGRITY_ERRORS = Counter(
    "cachefs_s3_integrity_errors", "S3 answers whose bytes disagreed with the object's checksum "
    "or ETag (altered in transit): dropped and fetched again; check=crc64nvme, crc32c, crc32, "
    "sha256, sha1, etag_md5, or combined_<crc> for a multi-block object", ["check"],
    registry=REGISTRY)
S3_VERIFIED_BYTES = Counter(
    "cachefs_s3_verified_bytes", "Object bytes received from S3 by the check they passed before "
    "use (none: ranged blocks, checked as a whole object once complete where S3 keeps a CRC)",
    ["check"], registry=REGISTRY)
S3_CHECKSUM_DISAGREEMENTS = Counter(
    "cachefs_s3_checksum_disagreements", "Objects S3 served with the same bytes twice, both "
    "disagreeing with its stated checksum or ETag (served: S3 is the truth)", ["check"],
    registry=REGISTRY)
S3_ASSEMBLED_CHECKS = Counter(
    "cachefs_s3_assembled_checks", "Multi-block objects checked against S3's full-object CRC "
    "once all their blocks were cached (result=ok or mismatch: blocks dropped)", ["result"],
    registry=REGISTRY)
S3_REGION = Gauge(
    "cachefs_s3_region", "1 for the region S3 requests are signed for (the bucket's, found at "
    "mount, unless --region) and the endpoint they go to", ["region", "endpoint"],
    registry=REGISTRY)
S3_THROTTLES = Counter(
    "cachefs_s3_throttles", "S3 requests answered 503 SlowDown / 429", ["op"], registry=REGISTRY)
S3_BYTES = Counter(
    "cachefs_s3_bytes", "Object bytes received from S3", registry=REGISTRY)
S3_LATENCY = Histogram(
    "cachefs_s3_request_duration_seconds", "S3 request latency (one attempt)", ["op"],
    buckets=LATENCY_BUCKETS, registry=REGISTRY)

# --- fetch pipeline / prefetch ---------------------------------------------
INFLIGHT_BYTES = Gauge(
    "cachefs_inflight_bytes", "Bytes reserved by fetches in flight and buffered blocks",
    registry=REGISTRY)
INFLIGHT_BUDGET_BYTES = Gauge(
    "cachefs_inflight_budget_bytes", "Memory budget for fetches in flight and buffers",
    registry=REGISTRY)
INFLIGHT_FETCHES = Gauge(
    "cachefs_inflight_fetches", "Block fetches from S3 in flight", registry=REGISTRY)
SINGLE_FLIGHT_JOINS = Counter(
    "cachefs_single_flight_joins", "Reads that waited on a fetch already in flight instead of "
    "sending another GET", registry=REGISTRY)
# (added to on the trio thread only: the prefetcher and its ledger)
PREFETCH_ISSUED_BYTES = OwnedCounters(
    "cachefs_prefetch_issued_bytes", "Bytes requested ahead of readers, by policy "
    "(sequential, directory, hint, warm, sweep)", "policy")
REGISTRY.register(PREFETCH_ISSUED_BYTES)
PREFETCH_USED_BYTES = Counter(
    "cachefs_prefetch_used_bytes", "Prefetched bytes later read, by policy", ["policy"],
    registry=REGISTRY)
PREFETCH_WASTED_BYTES = Counter(
    "cachefs_prefetch_wasted_bytes", "Prefetched bytes evicted or dropped unread, by policy",
    ["policy"], registry=REGISTRY)
SWEEP_FILES = Counter(
    "cachefs_sweep_files", "Small files fetched by the sweep (a directory read in an order "
    "nothing predicts, fetched into free cache space)", registry=REGISTRY)
SWEEP_BYTES = Counter(
    "cachefs_sweep_bytes", "Bytes fetched by the sweep", registry=REGISTRY)
SWEEP_DIRECTORIES = Counter(
    "cachefs_sweep_directories", "Directories queued for a sweep, by cause (misses: readers "
    "missed its files out of order; sibling: several sub-directories of its parent were)",
    ["cause"], registry=REGISTRY)
SWEEP_STOPS = Counter(
    "cachefs_sweep_stops", "Sweeps ended or paused, by reason (done, no_space: the cache has "
    "no free space, unread_bound: swept bytes not read yet reached their bound, hint: a "
    "read-order hint is followed, error)", ["reason"], registry=REGISTRY)
SWEEP_UNREAD_BYTES = Gauge(
    "cachefs_sweep_unread_bytes", "Bytes fetched by the sweep that no reader has taken yet",
    registry=REGISTRY)
DISK_READAHEAD = Counter(
    "cachefs_disk_readahead", "Cache files the kernel was asked to read into the page cache "
    "ahead of predicted reads, by outcome (advised; missing: the file was gone; dropped: the "
    "queue was full)", ["outcome"], registry=REGISTRY)
TIER_HITS = Counter(
    "cachefs_tier_loads", "Block loads answered, by the tier that had the block "
    "(disk, shared; s3 = the origin)", ["tier"], registry=REGISTRY)
PIECE_READS = Counter(
    "cachefs_piece_reads", "Random reads of large objects answered with a GET of exactly "
    "their bytes instead of whole blocks (see cachefs.read.fetcher)", registry=REGISTRY)
PIECE_BYTES = Counter(
    "cachefs_piece_bytes", "Bytes of those reads", registry=REGISTRY)
TIER_READ_BYTES = Counter(
    "cachefs_tier_read_bytes", "Bytes of file reads through the daemon, by where they came "
    "from (memory, disk, shared; s3 = the origin)", ["tier"], registry=REGISTRY)

# --- shared cache tier (cachefs.read.shared) ----------------------------------
SHARED_OPS = ("get", "head", "put", "lease", "delete", "session")
SHARED_ENABLED = Gauge(
    "cachefs_shared_enabled", "1 when the mount has a shared cache tier (--shared-cache)",
    registry=REGISTRY)
SHARED_REQUESTS = Counter(
    "cachefs_shared_requests", "Requests sent to the shared cache tier (each attempt counts)",
    ["op"], registry=REGISTRY)
SHARED_LATENCY = Histogram(
    "cachefs_shared_request_duration_seconds", "Shared cache tier request latency (one "
    "attempt; abandoned requests are observed when they end)", ["op"], buckets=LATENCY_BUCKETS,
    registry=REGISTRY)
SHARED_LOOKUPS = Counter(
    "cachefs_shared_lookups", "Block lookups in the shared tier by result: hit, miss, corrupt "
    "or foreign (a miss that was also dropped), error, timeout, skipped (breaker open)",
    ["result"], registry=REGISTRY)
SHARED_GET_BYTES = Counter(
    "cachefs_shared_get_bytes", "Verified block bytes received from the shared tier",
    registry=REGISTRY)
SHARED_PUBLISHED_BYTES = Counter(
    "cachefs_shared_published_bytes", "Block bytes written to the shared tier", registry=REGISTRY)
SHARED_PUBLISHES = Counter(
    "cachefs_shared_publishes", "Blocks handed to the shared tier by outcome: stored, present "
    "(already there), dropped_full (queue full), dropped_unavailable (breaker open or "
    "publishing refused), failed, withdrawn (its bytes failed the origin's full-object "
    "checksum afterwards: dropped or deleted), withdraw_failed (the delete of a withdrawn "
    "block failed)", ["result"], registry=REGISTRY)
SHARED_QUEUE_BYTES = Gauge(
    "cachefs_shared_publish_queue_bytes", "Bytes of blocks waiting to be published",
    registry=REGISTRY)
SHARED_QUEUE_BLOCKS = Gauge(
    "cachefs_shared_publish_queue_blocks", "Blocks waiting to be published", registry=REGISTRY)
SHARED_QUEUE_CAPACITY = Gauge(
    "cachefs_shared_publish_queue_capacity_bytes", "Bound of the publish queue",
    registry=REGISTRY)
SHARED_BREAKER_OPEN = Gauge(
    "cachefs_shared_breaker_open", "1 while the shared tier's circuit breaker is open (reads "
    "go straight to the origin)", registry=REGISTRY)
SHARED_BREAKER_OPENS = Counter(
    "cachefs_shared_breaker_opens", "Times the shared tier's circuit breaker opened",
    registry=REGISTRY)
SHARED_PUBLISH_ENABLED = Gauge(
    "cachefs_shared_publish_enabled", "1 while blocks are published to the shared tier (0: "
    "writes refused, e.g. access denied or store full)", registry=REGISTRY)
SHARED_LEASES = Counter(
    "cachefs_shared_leases", "Fetch leases by outcome: won (this node fetches from the origin), "
    "lost_served (another node's fetch was waited for), lost_timeout (waited, then fetched "
    "from the origin), reclaimed (found taken by this node itself, before a restart or "
    "earlier: it fetches from the origin at once), raced (answered after its miss went "
    "ahead, found taken: two nodes fetched the block), error, skipped (none written: too "
    "many in flight)", ["result"],
    registry=REGISTRY)

SHARED_LOOKUP_RESULTS = ("hit", "miss", "corrupt", "foreign", "error", "timeout", "skipped")
SHARED_PUBLISH_RESULTS = ("stored", "present", "dropped_full", "dropped_unavailable", "failed",
                          "withdrawn", "withdraw_failed")
SHARED_LEASE_RESULTS = ("won", "lost_served", "lost_timeout", "reclaimed", "raced", "error",
                        "skipped")
TIERS = ("memory", "disk", "shared", "s3")


def create_shared_series() -> None:
    """Create the labelled series of the shared tier and of the tiers at zero, so that a
    dashboard shows 0 (not "No data") on mounts without a shared tier. Idempotent (part
    of create_known_series)."""
    for op in SHARED_OPS:
        SHARED_REQUESTS.labels(op)
        SHARED_LATENCY.labels(op)
    for result in SHARED_LOOKUP_RESULTS:
        SHARED_LOOKUPS.labels(result)
    for result in SHARED_PUBLISH_RESULTS:
        SHARED_PUBLISHES.labels(result)
    for result in SHARED_LEASE_RESULTS:
        SHARED_LEASES.labels(result)
    for tier in TIERS:
        TIER_READ_BYTES.labels(tier)
        if tier != "memory":
            TIER_HITS.labels(tier)


# --- warm ------------------------------------------------------------------
WARM_BYTES_DONE = Counter(
    "cachefs_warm_bytes", "Bytes made resident by warm requests", registry=REGISTRY)
WARM_BYTES_TOTAL = Gauge(
    "cachefs_warm_target_bytes", "Bytes requested by running warm jobs", registry=REGISTRY)
WARM_OBJECTS_DONE = Counter(
    "cachefs_warm_objects", "Objects made resident by warm requests", registry=REGISTRY)

# --- daemon ----------------------------------------------------------------
START_TIME = Gauge(
    "cachefs_start_time_seconds", "Unix time the daemon started", registry=REGISTRY)
METADATA_LISTINGS = Counter(
    "cachefs_metadata_listings", "Directory listings fetched from S3", registry=REGISTRY)
METADATA_STALE_SERVED = Counter(
    "cachefs_metadata_stale_served", "Answers from a directory listing older than the metadata "
    "TTL (or invalidated), given while it is refreshed in the background "
    "(stale-while-revalidate)", registry=REGISTRY)
METADATA_REFRESH_FAILURES = Counter(
    "cachefs_metadata_refresh_failures", "Background refreshes of a known listing that failed "
    "(the old listing goes on serving; retried after a pause)", registry=REGISTRY)

# --- crashes, housekeeping and the control socket ---------------------------------
#: Background tasks that report their failures (cachefs.background); label values.
BACKGROUND_TASKS = ("maintenance", "orphan_scan", "control", "cache_write", "read_order",
                    "sweep")
BACKGROUND_ERRORS = Counter(
    "cachefs_background_errors", "Unexpected failures of background tasks (logged, counted; "
    "the task goes on)", ["task"], registry=REGISTRY)
#: Why a control-socket connection or request was refused; label values.
CONTROL_REJECT_REASONS = ("peer", "busy", "too_large", "malformed", "timeout")
CONTROL_REJECTED = Counter(
    "cachefs_control_rejected", "Control-socket connections or requests refused: peer (not "
    "root or the mounting user), busy (too many connections), too_large, malformed, timeout "
    "(slow client)", ["reason"], registry=REGISTRY)
CONTROL_CONNECTIONS = Gauge(
    "cachefs_control_connections", "Control-socket connections being served", registry=REGISTRY)
DEAD_MOUNTS_CLEANED = Counter(
    "cachefs_dead_mounts_cleaned", "Dead cachefs mounts (their daemon was killed) detached from "
    "the mount point at start", registry=REGISTRY)


# --- counted on the request path without locks ---------------------------------
# A prometheus_client metric takes a lock per update (about a microsecond); the FUSE
# workers answer a request in a few, so what they count per request is kept here:
# per-thread arrays, or itertools counters (next() is atomic), summed when scraped.
class RequestShard:
    """One thread's FUSE request counts and latency histograms (only that thread adds)."""

    __slots__ = ("buckets", "counts", "sums")

    def __init__(self, n_ops: int) -> None:
        self.counts = [0] * n_ops
        self.sums = [0.0] * n_ops
        self.buckets = [[0] * (len(LATENCY_BUCKETS) + 1) for _ in range(n_ops)]

    def observe(self, op: int, seconds: float) -> None:
        self.counts[op] += 1
        self.sums[op] += seconds
        self.buckets[op][bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1


class FuseRequestStats:
    """``cachefs_fuse_requests_total{op}`` and ``cachefs_fuse_request_duration_seconds{op}``
    from every thread's :class:`RequestShard` (a collector: summed at scrape time)."""

    def __init__(self, ops: tuple[str, ...]) -> None:
        self.ops = ops
        self.index = {op: i for i, op in enumerate(ops)}
        self._shards: list[RequestShard] = []
        # Counts kept elsewhere (the native loop, cachefs.fuse.native): each returns
        # {op: (count, sum of seconds, per-bucket counts)} so far.
        self._sources: list[Callable[[], dict[str, tuple[int, float, list[int]]]]] = []
        self._lock = threading.Lock()

    def shard(self) -> RequestShard:
        """A new shard for one thread."""
        s = RequestShard(len(self.ops))
        with self._lock:
            self._shards.append(s)
        return s

    def add_source(self, source: Callable[[], dict[str, tuple[int, float, list[int]]]]) -> None:
        """Add counts kept outside the shards (see ``_sources``)."""
        with self._lock:
            self._sources.append(source)

    def total(self) -> int:
        """Requests handled so far, every operation (a sum of per-thread counts)."""
        with self._lock:
            shards = list(self._shards)
            sources = list(self._sources)
        return (sum(sum(s.counts) for s in shards)
                + sum(c for source in sources for c, _, _ in source().values()))

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self, *, latency: bool = True) -> Iterator[Metric]:
        """The request counter and (``latency``) the latency histogram, per operation."""
        with self._lock:
            shards = list(self._shards)
            sources = list(self._sources)
        extra = [source() for source in sources]
        requests = CounterMetricFamily("cachefs_fuse_requests", "FUSE requests handled",
                                       labels=["op"])
        histogram = HistogramMetricFamily("cachefs_fuse_request_duration_seconds",
                                          "FUSE request latency", labels=["op"])
        bounds = [*(str(b) for b in LATENCY_BUCKETS), "+Inf"]
        for i, op in enumerate(self.ops):
            count = sum(s.counts[i] for s in shards)
            per = [sum(s.buckets[i][j] for s in shards) for j in range(len(bounds))]
            seconds = sum(s.sums[i] for s in shards)
            for counts in extra:
                if op in counts:
                    n, sum_, buckets = counts[op]
                    count += n
                    seconds += sum_
                    per = [a + b for a, b in zip(per, buckets, strict=True)]
            requests.add_metric([op], count)
            cumulative = list(itertools.accumulate(per))
            histogram.add_metric([op], list(zip(bounds, cumulative, strict=True)), seconds)
        yield requests
        if latency:
            yield histogram


class FastCounter:
    """A label-less monotonic count for hot paths (any thread, no lock)."""

    def __init__(self) -> None:
        self._it = itertools.count()

    def inc(self) -> None:
        next(self._it)

    @property
    def value(self) -> int:
        # repr is "count(N)", N the value next() would return (``__reduce__`` would
        # say the same but is deprecated from Python 3.12).
        return int(repr(self._it)[6:-1])


class _FastCounters:
    """Exports :class:`FastCounter` objects grouped as one labelled counter family."""

    def __init__(self, name: str, documentation: str, label: str,
                 values: tuple[str, ...]) -> None:
        self.name, self.documentation, self.label = name, documentation, label
        self.counters = {v: FastCounter() for v in values}

    def describe(self) -> list[Metric]:
        return list(self.collect())

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=[self.label])
        for v, c in self.counters.items():
            family.add_metric([v], c.value)
        yield family


LMDB_TRANSACTIONS = _FastCounters("cachefs_lmdb_transactions",
                                  "LMDB transactions begun, by mode", "mode", ("read", "write"))
REGISTRY.register(LMDB_TRANSACTIONS)


# --- label sets known in advance ------------------------------------------
# A labelled series does not exist until its first use, so on a healthy node the
# error panels of the dashboard would show "No data" instead of zero, and rate()
# over a counter born at its first error misses that error. These fixed sets are
# created at daemon start (create_known_series); other values still appear on first
# use. Keep them small: every combination is a series on every node.
FUSE_OPS = ("lookup", "getattr", "statfs", "opendir", "readdir", "releasedir", "open", "read",
            "release", "access", "getxattr", "listxattr",
            # answered without a handler (cachefs.fuse.server.SPECIAL_OPS), not timed
            "ioctl", "forget", "interrupt", "other")
FUSE_STATS = FuseRequestStats(FUSE_OPS)
REGISTRY.register(FUSE_STATS)
#: The errno an operator must notice (the one every StoreError and internal error ends in).
FUSE_ALERT_ERRNO = "EIO"
S3_OPS = ("get", "head", "list")
#: TransientStoreError.reason values (cachefs.errors) that a retry is counted under.
S3_RETRY_REASONS = ("throttled", "server_error", "timeout", "connection", "unreachable",
                    "short_body", "integrity")
#: Checks a body can fail or pass (cachefs.s3.integrity.CHECKS and the ETag's MD5).
S3_CHECKS = ("crc64nvme", "crc32c", "crc32", "sha256", "sha1", "etag_md5")
#: The kind a failing or throttling S3 endpoint produces (cachefs.errors).
S3_ALERT_KIND = "TransientStoreError"
SKIP_REASONS = ("empty", "dot", "nul", "too_long", "shadowed", "marker_with_data")
PASSTHROUGH_DECLINE_REASONS = ("size", "not_cached", "open_direct", "o_direct", "refused", "unverified")
#: cachefs.passthrough.Passthrough.prepare and .write_checked ("written"; and "dropped":
#: the queue was full)
PASSTHROUGH_PREPARE_OUTCOMES = ("registered", "written", "known", "declined", "full",
                                "not_cached", "unverified", "refused", "dropped")
#: cachefs.passthrough.Passthrough.read_back (and "dropped": the queue was full)
PASSTHROUGH_READ_BACK_OUTCOMES = ("verified", "failed", "gone", "dropped")
#: cachefs.read.prefetcher.POLICIES
PREFETCH_POLICIES = ("sequential", "directory", "hint", "warm", "sweep")
#: cachefs.read.sweep
SWEEP_CAUSES = ("misses", "sibling")
SWEEP_STOP_REASONS = ("done", "no_space", "unread_bound", "hint", "error")
#: cachefs.cache.readahead
DISK_READAHEAD_OUTCOMES = ("advised", "missing", "dropped")


def create_known_series() -> None:
    """Create every labelled series of the fixed label sets above, at zero.

    Called once by the daemon at start. Idempotent; never changes a value.
    """
    for op in FUSE_OPS:  # (requests and latency: FUSE_STATS exports every op)
        FUSE_ERRORS.labels(op, FUSE_ALERT_ERRNO)
    for op in S3_OPS:
        S3_REQUESTS.labels(op)
        S3_LATENCY.labels(op)
        S3_THROTTLES.labels(op)
        S3_DEADLINE_EXCEEDED.labels(op)
        S3_ERRORS.labels(op, S3_ALERT_KIND)
        for reason in S3_RETRY_REASONS:
            S3_RETRIES.labels(op, reason)
    for check in S3_CHECKS:
        S3_INTEGRITY_ERRORS.labels(check)
        S3_VERIFIED_BYTES.labels(check)
    S3_VERIFIED_BYTES.labels("none")
    for result in ("ok", "mismatch"):
        S3_ASSEMBLED_CHECKS.labels(result)
    for reason in SKIP_REASONS:
        SKIPPED_KEYS.labels(reason)
    for reason in PASSTHROUGH_DECLINE_REASONS:
        PASSTHROUGH_DECLINED.labels(reason)
    for outcome in PASSTHROUGH_PREPARE_OUTCOMES:
        PASSTHROUGH_PREPARED.labels(outcome)
    for outcome in PASSTHROUGH_READ_BACK_OUTCOMES:
        PASSTHROUGH_READ_BACKS.labels(outcome)
    for policy in PREFETCH_POLICIES:
        PREFETCH_ISSUED_BYTES.labels(policy)
        PREFETCH_USED_BYTES.labels(policy)
        PREFETCH_WASTED_BYTES.labels(policy)
    for cause in SWEEP_CAUSES:
        SWEEP_DIRECTORIES.labels(cause)
    for outcome in DISK_READAHEAD_OUTCOMES:
        DISK_READAHEAD.labels(outcome)
    for reason in SWEEP_STOP_REASONS:
        SWEEP_STOPS.labels(reason)
    for task in BACKGROUND_TASKS:
        BACKGROUND_ERRORS.labels(task)
    for reason in CONTROL_REJECT_REASONS:
        CONTROL_REJECTED.labels(reason)
    create_shared_series()


def parse_metrics_addr(value: str) -> tuple[str, int]:
    """Parse ``HOST:PORT``, ``:PORT`` or ``PORT`` (host defaults to 127.0.0.1)."""
    host, sep, port_s = value.rpartition(":")
    if not sep:
        host, port_s = "", value
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_s)
    except ValueError:
        raise ConfigError(f"--metrics-addr {value!r}: expected HOST:PORT") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"--metrics-addr {value!r}: port out of range")
    return host, port


def by_label(counter: Counter) -> dict[str, float]:
    """A one-label counter's value per label value (e.g. background errors per task)."""
    out: dict[str, float] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels:
                out[next(iter(sample.labels.values()))] = sample.value
    return out


def activity() -> tuple[float, ...]:
    """A cheap fingerprint of what the daemon has done: FUSE requests, index transactions,
    S3 and shared-tier request attempts, background errors and refused control requests.
    It changes whenever the mount serves, fetches, lists, writes its cache or fails in
    the background; the daemon rewrites its status snapshot (a full :func:`totals`, some
    milliseconds) only when it has, so an idle mount does not spend CPU on it every
    second. Costs a fraction of a millisecond (any thread)."""
    lmdb = tuple(c.value for c in LMDB_TRANSACTIONS.counters.values())
    labelled = tuple(sum(by_label(c).values()) for c in _ACTIVITY_COUNTERS)
    return (FUSE_STATS.total(), *lmdb, *labelled)


def totals() -> dict[str, float]:
    """Current value of every cachefs counter and gauge, summed over labels (the status
    reports: the snapshot ``cachefs status`` reads and the control socket's ``status``).
    Histograms are left out: no report reads them, and generating their buckets was most
    of a snapshot's ~9 ms of CPU, taken every second a mount is busy."""
    out: dict[str, float] = {}
    for family in _summed_families():
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _summed_families() -> Iterator[Metric]:
    """The families of :func:`totals`: every cachefs metric but the histograms."""
    yield from CATCH_UP.collect()  # (catches up, yields nothing)
    for collector in (READ_BYTES, NATIVE_ANSWERS, LMDB_TRANSACTIONS, PREFETCH_ISSUED_BYTES):
        yield from collector.collect()
    yield from FUSE_STATS.collect(latency=False)
    for metric in _SUMMED:
        yield from metric.collect()


#: Labelled counters :func:`activity` sums (each attempt or failure counts once).
_ACTIVITY_COUNTERS = (S3_REQUESTS, S3_ERRORS, SHARED_REQUESTS, BACKGROUND_ERRORS,
                      CONTROL_REJECTED)


#: The metrics of this module :func:`totals` sums: every one but the histograms (the
#: module's last statement, so that every metric is defined by then).
_SUMMED = [v for v in list(globals().values()) if isinstance(v, (Counter, Gauge, Info))]

"""The composition root: check the inputs, wire the layers, mount, serve, tear down.

Order of start-up (each step fails with one clear CachefsError line):

1. mount point: exists, is a directory, is empty, holds no mount; a dead
   cachefs mount (its daemon was killed) is detached first (:mod:`cachefs.startup`);
2. cache directory: created 0700 (wider modes tightened), writable, locked for
   this daemon only, large enough for ``--cache-size``;
3. LMDB index opened (wiped if unreadable), metadata of another source dropped;
4. S3: the bucket's region looked up (unless ``--region``), then one probe
   request (bucket exists, credentials work, endpoint answers: a one-key
   listing, or HeadBucket for a manifest mount, which never lists); with
   ``--manifest``, the manifest loaded into the index (skipped when unchanged);
5. metrics endpoint bound (if asked);
6. FUSE mounted, kernel readahead raised, readiness announced (pipe to the
   ``cachefs mount`` parent, ``READY=1`` to systemd, runtime registry).

Tasks (all owned by the nursery in :func:`_serve`): the FUSE request server
(:mod:`cachefs.fuse.server`: worker threads, and its nursery for requests that wait),
the fetcher's flights, the listings (background refreshes, listing ahead),
the maintenance loop (last-use batches, LMDB sync), the orphan scan, the trim of a
cache over its capacity (once at start, one worker thread: :meth:`BlockCache.trim_to_capacity`,
under the cache's own lock order), the control socket, the unmount watcher and the signal watcher. SIGTERM/SIGINT
(and SIGQUIT, SIGXCPU: :data:`cachefs.startup.STOP_SIGNALS`) unmount cleanly, from the
moment the mount is made: one that arrives before the signal
watcher runs is held (:class:`_EarlyStop`), and the watcher stops the mount once it is
ready. No background task ends the daemon on an error: each unit of work runs in
:func:`cachefs.background.contained` (logged, counted, goes on); only cancellation
ends them.
When the request loop ends (unmounted), S3 requests in flight and retry
waits are stopped at once (:meth:`Origin.close`), pending cache writes are
drained (bounded wait), then the rest is cancelled and the index synced and
closed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import trio

from cachefs import descriptors, failpoints, gcpolicy, heap, metrics, metricsport
from cachefs.background import contained
from cachefs.cache import manifest
from cachefs.cache.blocks import BlockCache
from cachefs.cache.lmdbenv import LmdbEnv
from cachefs.cache.metadata import Metadata
from cachefs.cache.readahead import DiskReadahead
from cachefs.config import MountConfig, speculative_window, without_password
from cachefs.control import registry
from cachefs.control.server import ControlServer
from cachefs.control.warm import Warmer
from cachefs.errors import (
    CachefsError,
    ConfigError,
    CredentialsError,
    EndpointUnreachable,
    StoreError,
    TransientStoreError,
)
from cachefs.fs import FileSystem
from cachefs.fuse import abi
from cachefs.fuse.device import Device
from cachefs.fuse.native import AVAILABLE as native_available
from cachefs.fuse.native import NativeReads, lookup_slots_for
from cachefs.fuse.server import RequestServer
from cachefs.fuse_ops import Operations
from cachefs.passthrough import Passthrough
from cachefs.read.budget import MemoryBudget
from cachefs.read.fetcher import Fetcher, ObjectVersion
from cachefs.read.hints import ReadOrder, metadata_resolver
from cachefs.read.lookahead import DirectoryLookahead
from cachefs.read.prefetcher import DIRECTORY, Prefetcher, PrefetchLedger
from cachefs.read.shared import SharedLayout, SharedSettings, SharedTier
from cachefs.read.sweep import Sweeper
from cachefs.s3.boto import S3Store
from cachefs.s3.objects import open_tier_client
from cachefs.s3.origin import Origin
from cachefs.startup import (
    IGNORED_SIGNALS,
    STOP_SIGNALS,
    check_mountpoint,
    lock_cache_dir,
    lock_mountpoint,
    node_identity,
    prepare_cache_dir,
)

log = logging.getLogger(__name__)

MAINTENANCE_INTERVAL = 5.0  # last-use batches and LMDB sync
UNMOUNT_POLL = 1.0  # how often the mount table is checked for our mount
STATUS_INTERVAL = 1.0  # status snapshot in the runtime registry, while the mount is busy
STATUS_IDLE_INTERVAL = 10.0  # the same while nothing happens (see Daemon._maintenance)
_LMDB_WRITES = metrics.LMDB_TRANSACTIONS.counters["write"]
DRAIN_TIMEOUT = 30.0
#: S3 connections opened at mount, at most (half of --max-connections up to this): enough
#: for a cold start's first burst of GETs without a handshake storm at every mount.
PREWARM_CONNECTIONS = 64
#: After SIGTERM, files still open keep the (lazily unmounted) connection alive this
#: long before it is aborted.
STOP_GRACE = 5.0
#: Mount options always given (the kernel checks permissions against our attributes).
DEFAULT_OPTIONS = frozenset({"default_permissions"})


def fsname(source: str) -> str:
    """``source`` as the mount table names the file system (``fsname=``, which ``df`` and
    ``mount`` show): libfuse's mount options are ASCII, split at commas and take a
    backslash as an escape, so every other character is %-escaped, ``%`` too (what
    ``urllib.parse.unquote`` reverses). A prefix is any key prefix: a folder named in
    French or Japanese failed the mount with a traceback, one with a comma failed it."""
    return quote(source, safe="/:@ !$&'()*+;=")


def set_kernel_readahead(mountpoint: Path, read_ahead: int) -> None:
    """Raise the mount's kernel readahead so FUSE read requests are larger
    (the default of 128 KiB caps a single reader's throughput)."""
    # The device number comes from mountinfo: stat() on the mount point would send a
    # FUSE request before the request loop runs, and wait for ever.
    try:
        dev = registry.mount_device(mountpoint)
        if dev is None:
            log.info("could not find %s in mountinfo to set its readahead", mountpoint)
            return
        bdi = Path(f"/sys/class/bdi/{dev}/read_ahead_kb")
        bdi.write_text(str(read_ahead // 1024))
    except OSError as exc:
        log.info("could not set kernel readahead for %s: %s", mountpoint, exc)


def sd_notify(message: str) -> None:
    """Send a message to systemd if it is watching (Type=notify)."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(addr)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("sd_notify failed: %s", exc)


def _device_mounted(device: str) -> bool:
    """Whether a file system with this ``major:minor`` is mounted (this mount namespace)."""
    try:
        with open("/proc/self/mountinfo") as f:
            return any(line.split(maxsplit=3)[2] == device for line in f)
    except OSError:
        return True  # cannot tell: assume it is


def _source_identity(cfg: MountConfig) -> bytes:
    # A manifest mount and a listing mount of the same source do not share listings.
    manifest = f"|manifest={cfg.manifest}" if cfg.manifest else ""
    return f"{cfg.endpoint_url or ''}|{cfg.source.bucket}|{cfg.source.prefix}{manifest}".encode()


def _drop_foreign_metadata(env: LmdbEnv, cfg: MountConfig) -> None:
    ident = _source_identity(cfg)
    with env.read() as txn:
        stored = txn.get(b"source", db=env.db("meta"))
    if stored != ident:
        if stored is not None:
            log.info("cache directory was used for another source; dropping its listings")
        for name in ("listings", "names", "inodes"):
            env.drop(name)
        with env.write() as txn:
            txn.put(b"source", ident, db=env.db("meta"))


def make_store(cfg: MountConfig) -> S3Store:
    """The S3 store of ``cfg``, signing for the bucket's own region: S3 is asked at mount
    (HeadBucket) unless ``--region`` overrides it. A failed lookup keeps the configured
    region (the probe that follows reports what is wrong)."""
    try:
        store = S3Store(cfg.source.bucket, endpoint_url=cfg.endpoint_url, region=cfg.region,
                        max_connections=cfg.max_connections, anonymous=cfg.no_sign_request)
    except ValueError as exc:  # botocore: "Invalid endpoint: ..." (e.g. AWS_ENDPOINT_URL)
        raise ConfigError(f"invalid S3 endpoint: {exc}") from None
    return store if cfg.region is not None else store.in_bucket_region()


#: Tries of the start-up probe while S3 answers it with throttling or a 5xx (which S3
#: sends now and then, and more under load: not a reason to fail a mount), waiting a
#: quarter of a second, doubling, between them (about 8 s in all).
PROBE_ATTEMPTS = 6


def probe_store(store: S3Store, cfg: MountConfig, *, cached: bool = False) -> bool | None:
    """One request proving the source can be read; a clear StoreError when it cannot.
    Whether any key is under the source's prefix (None: not known, with a manifest or
    when S3 did not answer a remount's probe).
    Throttling and 5xx answers are tried again (:data:`PROBE_ATTEMPTS`) first. With
    ``cached`` (the cache directory holds listings of this source: a remount, after a
    crash say), S3 not answering (a timeout, a refused connection, 5xx) does not stop the
    mount: it serves what is cached, and what is not waits for S3 as any read does (a
    daemon killed by the OOM killer and restarted during a blip of S3 left the node
    without its mount). Wrong credentials, a missing bucket or a refusal still stop it."""
    delay = 0.25
    for attempt in range(1, PROBE_ATTEMPTS + 1):
        try:
            if cfg.manifest:
                store.probe_bucket()  # no LIST at all with a manifest
                return None
            return store.probe(cfg.source.prefix)
        except TransientStoreError as exc:
            if (cached or exc.reason not in ("throttled", "server_error")
                    or attempt == PROBE_ATTEMPTS):
                _probe_failed(exc, cfg, cached=cached)
                return None
            log.info("S3 answered the start-up check with %s; trying again", exc)
            time.sleep(delay * random.uniform(0.5, 1.0))  # (jittered: many nodes at once)
            delay *= 2
        except CredentialsError:
            raise
        except StoreError as exc:
            raise StoreError(f"cannot read {cfg.source}: {exc}") from None
    return None  # (not reached: the last attempt returns or raises)


def _probe_failed(exc: TransientStoreError, cfg: MountConfig, *, cached: bool) -> None:
    """The start-up probe's last transient failure: a remount goes on from its cache,
    a first mount fails in one line."""
    if cached:
        log.warning("S3 does not answer (%s); mounting from the cache: what is not cached "
                    "waits for S3 (retried until --retry-deadline)", exc)
        return
    if isinstance(exc, EndpointUnreachable):
        where = without_password(cfg.endpoint_url) if cfg.endpoint_url else "the AWS S3 endpoint"
        raise StoreError(f"cannot reach {where}: no answer (is the endpoint URL right and "
                         "the server running?)") from None
    raise StoreError(f"cannot read {cfg.source}: {exc}") from None


def index_reserve(cfg: MountConfig) -> int:
    """Bytes of disk kept allocated for the index to grow into (LmdbEnv.keep_reserve): a
    32nd of the cache size, between 8 MiB and 256 MiB (a listing of a million names is
    ~150 MiB; the reserve is topped up every maintenance pass)."""
    return max(8 << 20, min(256 << 20, cfg.cache_size // 32))


def _has_listings(env: LmdbEnv) -> bool:
    """Whether the index holds any directory listing (of this source: foreign ones are
    dropped first, :func:`_drop_foreign_metadata`)."""
    with env.read() as txn:
        return bool(txn.stat(env.db("listings"))["entries"])


def make_shared_tier(cfg: MountConfig, publish_queue_bytes: int) -> SharedTier | None:
    """The shared cache tier of ``--shared-cache``, or None. Makes no request: the tier
    checks itself in the background (it must never keep a node from mounting)."""
    url = cfg.shared_cache
    if url is None:
        return None
    # Anonymous only with --no-sign-request and no profile of its own; missing credentials
    # otherwise fail each request (the breaker then says so once).
    timeout = cfg.shared_cache_timeout
    client = open_tier_client(
        url.bucket, endpoint_url=cfg.shared_cache_endpoint_url,
        region=cfg.shared_cache_region or cfg.region, profile=cfg.shared_cache_profile,
        anonymous=cfg.no_sign_request and not cfg.shared_cache_profile, timeout=timeout,
        follow_region=cfg.shared_cache_region is None)
    settings = SharedSettings(timeout=timeout, publish_timeout=max(5.0, 5 * timeout),
                              queue_bytes=publish_queue_bytes)
    return SharedTier(client, SharedLayout(url.prefix, cfg.source.bucket, cfg.block_size),
                      label=str(url), settings=settings,
                      node=node_identity(cfg.cache_dir, cfg.node_name))


class _EarlyStop:
    """The stop signals (SIGTERM, SIGINT, SIGQUIT, SIGXCPU: :data:`STOP_SIGNALS`) held
    between the mount and the signal watcher: the first one that arrives is remembered
    (nothing else is done in the handler), and the watcher acts on it once it runs.
    Replaced by the watcher's own handlers, and the previous handlers put back when the
    daemon ends."""

    SIGNALS = STOP_SIGNALS

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)


class Daemon:
    """One mount: owns every component and their lifetimes."""

    def __init__(self, cfg: MountConfig) -> None:
        self.cfg = cfg
        self.started_at = time.time()
        self.env: LmdbEnv | None = None
        self.device: Device | None = None
        self.server: RequestServer | None = None
        self._dev = ""  # major:minor of the mount, for aborting its connection
        self.shared: SharedTier | None = None
        self.open_files_limit = 1024  # raised in run() (cachefs.descriptors)
        self.metrics_addr: str | None = None  # HOST:PORT served, once serving
        self._early_stop = _EarlyStop()
        self._serving = trio.Event()  # (set once the mount is ready: it can be stopped)
        self.control: ControlServer | None = None
        self.warnings: list[str] = []  # for the mount command to print (one line each)
        # The registry entry is written (snapshots, a worker thread) and withdrawn (the
        # mount gone from the mount table) under this lock: once detached, never again.
        self._registry_lock = threading.Lock()
        self._detached = False
        self._detached_at = 0.0  # (time.time() once detached)

    def run(self, on_ready: Callable[[], None]) -> None:
        """Mount and serve until unmounted or signalled. Raises CachefsError on start-up
        failure (nothing is left mounted)."""
        cfg = self.cfg
        with contextlib.ExitStack() as held:
            mounted = held.enter_context(lock_mountpoint(cfg.mountpoint))

            def ready() -> None:
                mounted()  # (the mount is live: another daemon now finds it so)
                on_ready()

            check_mountpoint(cfg.mountpoint)
            heap.limit_arenas()  # (before any thread of ours starts: cachefs.heap)
            prepare_cache_dir(cfg.cache_dir, cfg.cache_size, tighten=True)
            # Cache files registered for reads hold descriptors: run under the hard limit.
            self.open_files_limit = descriptors.raise_limit()
            log.info("open-file limit %d", self.open_files_limit)
            held.enter_context(lock_cache_dir(cfg.cache_dir))
            # Read whole first: a damaged index is wiped (one log line), not a failed mount.
            self.env = env = LmdbEnv(cfg.cache_dir / "meta.lmdb", check=True)
            try:
                self._run_locked(env, ready)
            finally:
                # No request worker may touch the index once it is closed.
                if self.server is None or self.server.stop(timeout=10.0):
                    env.close()
                else:
                    log.warning("request workers still busy at exit; the index is synced, "
                                "not closed")
                    env.sync()

    def _run_locked(self, env: LmdbEnv, on_ready: Callable[[], None]) -> None:
        cfg = self.cfg
        manifest_path = manifest.check_path(cfg.manifest) if cfg.manifest else None
        _drop_foreign_metadata(env, cfg)
        env.keep_reserve(index_reserve(cfg))
        s3 = make_store(cfg)
        if probe_store(s3, cfg, cached=_has_listings(env)) is False:
            # (a typo, S3's case, a file's URL for its folder's: the job on the mount
            # finds no files, so say it where the mount command is run)
            note = (f"{cfg.source} holds no keys: the mount is an empty folder until keys "
                    "are put under it (is the prefix right? S3 keys are case-sensitive)")
            log.warning("%s", note)
            self.warnings.append(note)
        log.info("S3 endpoint %s, region %s", without_password(s3.endpoint), s3.region)
        metrics.S3_REGION.labels(s3.region, s3.endpoint).set(1)
        origin = Origin(s3, max_connections=cfg.max_connections, deadline=cfg.retry_deadline)
        metrics.START_TIME.set(self.started_at)
        metrics.create_known_series()
        if cfg.metrics_addr:
            host, port = metricsport.serve_metrics(cfg.metrics_addr)
            # The address served (the port the kernel chose for port 0), as status names it.
            self.metrics_addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            log.info("metrics at http://%s/metrics", self.metrics_addr)

        disk_limiter = trio.CapacityLimiter(16)
        cache = BlockCache(env, cfg.cache_dir, capacity=cfg.cache_size, policy=cfg.cache_policy,
                           limiter=disk_limiter)
        # A quarter of the budget keeps verified blocks in memory (sub-block reads
        # of the same block are not re-read and re-verified); the rest bounds
        # fetches in flight and blocks waiting to be written.
        hot = cfg.memory_budget // 4
        # With a shared tier, an eighth of the budget holds blocks waiting to be published.
        publish_queue = cfg.memory_budget // 8 if cfg.shared_cache else 0
        budget = MemoryBudget(cfg.memory_budget - hot - publish_queue)
        shared = make_shared_tier(cfg, publish_queue)
        self.shared = shared
        ledger = PrefetchLedger()
        # Under lru, blocks fetched ahead and not read yet are not evicted first.
        cache.is_unread = ledger.is_unread
        # The shared tier's misses go to the origin (retries, hedging, integrity checks);
        # a block is published only as the fetcher writes it back, i.e. once the origin's
        # checks passed (the combined CRC of multi-block objects withdraws it, see
        # cachefs.read.assembled).
        fetcher = Fetcher(origin, cache, block_size=cfg.block_size, budget=budget,
                          hot_capacity=hot, notes=ledger,
                          lower_tiers=[shared] if shared is not None else [])
        # Listing threads wait on the origin's pages (and their retries) holding no S3
        # connection; this bounds how many wait at once.
        listing_threads = trio.CapacityLimiter(cfg.max_connections)
        metadata = Metadata(env, None if manifest_path else origin.blocking(),
                            ttl=cfg.metadata_ttl, limiter=listing_threads,
                            list_ahead=cfg.list_ahead, root=cfg.source.prefix)
        if manifest_path is not None:
            manifest.load(env, manifest_path, bucket=cfg.source.bucket,
                          root_prefix=cfg.source.prefix)
        passthrough = Passthrough(fetcher, cache, ledger, enabled=cfg.passthrough == "auto",
                                  max_idle=cfg.registered_files,
                                  max_native_idle=descriptors.native_files(
                                      self.open_files_limit, cfg.max_connections))
        # Idle registrations yield to eviction: the cache tells passthrough which to close.
        cache.on_evicted_while_pinned = passthrough.evicted
        cache.on_written = passthrough.written
        # Without the kernel's passthrough, the request workers' C loop answers the reads
        # of verified files (cachefs.fuse.native); built without it, Python answers all.
        # (it remembers the lookups of as many files as are kept registered)
        native = (NativeReads(lookup_slots_for(cfg.registered_files))
                  if cfg.native_reads == "auto" and native_available else None)
        if native is not None:
            native.publish()
            metadata.add_listener(native.forget_dir)
        fetcher.on_settled = passthrough.settled  # predicted files registered once landed
        # (a predicted small file is registered by the S3 thread that writes it)
        fetcher.write_checked = passthrough.write_checked
        if cfg.passthrough == "auto" and not passthrough.wanted:
            log.info("FUSE passthrough unavailable (it needs Linux 6.9 or newer): "
                     "cachefs serves reads itself")
        # Every speculative fetch goes through one prefetcher; the policies below (and
        # the sequential detector of each handle) decide what is worth fetching.
        # A directory walk's next cached files are read into the page cache ahead of
        # the request workers' reads (not with passthrough: the kernel reads them; nor
        # files registered with the native loop, which reads them direct: the
        # lookahead's ``settled``).
        readahead = DiskReadahead()

        def read_ahead(bid: bytes, length: int) -> None:
            path, offset = cache.location(bid)
            readahead.advise(path, offset, length)

        prefetcher = Prefetcher(fetcher, budget, ledger, readahead=read_ahead,
                                kernel_reads_cached=lambda: passthrough.enabled and not passthrough.native)
        max_readahead = max(cfg.block_size * 2, budget.limit // 8)
        window = speculative_window(cfg.max_connections)  # hinted and swept loads in flight
        # (hinted and swept files are registered ahead of their opens, as a walk's are)
        read_order = ReadOrder(prefetcher, metadata_resolver(metadata),
                               lookahead_bytes=max_readahead * 4, window=window,
                               prepare=metadata.list_ahead, on_predicted=passthrough.predicted)
        root = cfg.source.prefix

        def next_dir(prefix: str) -> str | None:
            return metadata.next_walked_dir(prefix, root)

        lookahead = DirectoryLookahead(prefetcher, metadata.iter_entries, next_dir=next_dir,
                                       on_predicted=passthrough.predicted,
                                       settled=passthrough.reads_itself,
                                       in_flight=lambda: prefetcher.loading(DIRECTORY),
                                       first_file=metadata.first_file_now,
                                       folder_ino=metadata.dir_ino_now)
        prefetcher.on_fetched(DIRECTORY, lookahead.on_load_end)

        def free_space() -> int:  # (what is in flight will be written to the cache next)
            # cache.used is disk space (blocks rounded up to the allocation unit); the bytes
            # in flight are not rounded: the sweep adds the rounding of its own loads.
            return cache.capacity - cache.used - budget.used

        # Small files read in no predictable order: swept into free cache space, at most
        # twice the readahead bound (plus twice what readers read) ahead of use. Not the
        # hint's 4x: a sweep is a guess, and a reader of a few random files must not pull
        # a quarter GiB across regions (benchmarks/RESULTS.md, "How far a sweep runs ahead").
        sweeper = Sweeper(prefetcher, ledger, metadata, free_space=free_space,
                          max_file=cfg.block_size, ahead_bytes=max_readahead * 2,
                          margin=max_readahead, hinted=read_order.hinted,
                          hint_active=lambda: read_order.active,
                          on_predicted=functools.partial(passthrough.predicted, spare=True),
                          window=window)
        fs = FileSystem(metadata, fetcher, root_prefix=cfg.source.prefix,
                        max_readahead=max_readahead, prefetcher=prefetcher,
                        read_order=read_order, lookahead=lookahead, backing=passthrough,
                        sweeper=sweeper)
        if native is not None:
            # A file registered ahead of its open (a cold walk's lookahead) gets an open
            # template at once: the loop answers its first open too, without Python.
            loop = native

            def template_ahead(ino: int, obj: ObjectVersion) -> None:
                fs.offer_template_ahead(ino, obj, loop.lookup_epoch)

            passthrough.on_prepared = template_ahead
        warmer = Warmer(metadata, prefetcher, root_prefix=cfg.source.prefix, shared=shared)
        self.control = control = ControlServer(
            registry.control_socket(cfg.mountpoint), read_order=read_order, warmer=warmer,
            root_prefix=cfg.source.prefix)

        def on_init(result: abi.Negotiated) -> None:
            # Passthrough needs the kernel's grant at INIT (and CAP_SYS_ADMIN, tried at
            # the first open of a cached file).
            if passthrough.wanted and not result.passthrough:
                log.info("FUSE passthrough unavailable (the kernel did not grant it): "
                         "cachefs serves reads itself")
            passthrough.attach_device(self.device if result.passthrough else None, native,
                                      loop=native)
            if passthrough.native:
                ops.native = native
                log.info("reads of verified cache files are answered by the native loop")

        ops = Operations(
            fs, uid=os.getuid() if cfg.uid is None else cfg.uid,
            gid=os.getgid() if cfg.gid is None else cfg.gid,
            file_mode=cfg.file_mode, dir_mode=cfg.dir_mode,
            attr_timeout=min(cfg.metadata_ttl, 86400.0),
            statfs_bytes=lambda: (cache.capacity, cache.used),
            on_init=on_init)
        ops.native_loop = native
        if native is not None:
            # (the names of hinted and swept files: their lookups are the loop's)
            read_order.lookups = sweeper.lookups = ops
        metrics.CATCH_UP.add(ops.drain_native)  # (metrics count the loop's opens at once)

        options = set(DEFAULT_OPTIONS)
        options |= {"ro", "noatime", f"fsname={fsname(str(cfg.source))}", "subtype=cachefs"}
        if cfg.allow_other:
            options.add("allow_other")
        # From here until the signal watcher takes them, SIGTERM and SIGINT are held:
        # their default actions would end the process with the mount made (a dead mount).
        early_stop = self._early_stop
        early_stop.install()
        try:
            self.device = device = Device.mount(cfg.mountpoint, options)
        except RuntimeError as exc:
            early_stop.restore()
            raise ConfigError(f"cannot mount {cfg.mountpoint}: {exc}") from None
        except BaseException:
            early_stop.restore()
            raise
        self._dev = registry.mount_device(cfg.mountpoint) or ""
        failpoints.hit("mount.made")  # (the main thread, before trio runs: tests hold it here)
        self.server = server = RequestServer(device.dup, ops, workers=cfg.fuse_workers,
                                             want_passthrough=passthrough.wanted,
                                             native=native)
        fs.post = server.post
        unmounted = False
        try:
            # (started in this order, each once the previous one is running)
            services: list[Callable[..., Awaitable[None]]] = [
                read_order.run, sweeper.run, control.serve, passthrough.run, readahead.run,
                ops.run_native_events]
            trio.run(self._serve, server, origin, fetcher, metadata, services, passthrough,
                     cache, env, shared, on_ready)
            unmounted = True
        finally:
            registry.unregister(cfg.mountpoint, os.getpid())
            with self._registry_lock:  # (no snapshot writes it again)
                self._detached = True
                registry.unregister_detached(os.getpid())
            sd_notify("STOPPING=1")
            device.close(
                unmount=not unmounted or str(cfg.mountpoint) in registry.cachefs_mounts())
            early_stop.restore()
            cache.flush_touches(cache.take_touches())

    async def _serve(self, server: RequestServer, origin: Origin, fetcher: Fetcher,
                     metadata: Metadata, services: list[Callable[..., Awaitable[None]]],
                     passthrough: Passthrough, cache: BlockCache,
                     env: LmdbEnv, shared: SharedTier | None,
                     on_ready: Callable[[], None]) -> None:
        cfg = self.cfg
        self._serving = trio.Event()  # (one per trio run)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._open_connections, origin)
            await nursery.start(fetcher.run)
            await nursery.start(metadata.run)
            # (listed while the mount comes up: the first reads' lookups find it there)
            metadata.list_at_mount(cfg.source.prefix)
            if shared is not None:
                await nursery.start(shared.run)
            nursery.start_soon(self._maintenance, cache, env)
            nursery.start_soon(self._trim_cache, cache)
            nursery.start_soon(self._remove_orphans, cache)
            nursery.start_soon(self._watch_signals, origin)
            for service in services:  # (each takes task_status: started once serving)
                await nursery.start(service)
            async with trio.open_nursery() as fuse_nursery:
                await fuse_nursery.start(server.run)
                # The kernel applies the file system's INIT reply to the mount's readahead,
                # so raise it only after INIT: a stat() is answered only after INIT.
                await trio.to_thread.run_sync(os.stat, cfg.mountpoint)
                await trio.to_thread.run_sync(set_kernel_readahead, cfg.mountpoint,
                                              cfg.read_ahead)
                with contained("maintenance", "publishing the status snapshot"):
                    # (the maintenance loop tries again every second; a thread: the
                    # snapshot takes the registry lock)
                    await trio.to_thread.run_sync(self._publish_status)
                gcpolicy.settle_after_startup()  # (once the long-lived state exists)
                on_ready()
                sd_notify("READY=1")
                # (registered files are read by the kernel (passthrough) or by the C loop)
                reads = ("off" if not passthrough.enabled else
                         "off, reads of cached files in C" if passthrough.native else "on")
                log.info("mounted %s at %s (cache %s, %s policy, passthrough %s, up to %d "
                         "files registered%s)", cfg.source, cfg.mountpoint, cfg.cache_dir,
                         cfg.cache_policy, reads,
                         passthrough.max_idle,
                         f", shared tier {shared.label}" if shared is not None else "")
                nursery.start_soon(self._watch_unmount, origin)
                self._serving.set()
            log.info("unmounted; finishing cache writes")
            origin.close()  # S3 requests and retry waits end now, even in an outage
            with trio.move_on_after(DRAIN_TIMEOUT):
                await fetcher.drain()
                if shared is not None:
                    await shared.drain()
            nursery.cancel_scope.cancel()

    async def _open_connections(self, origin: Origin) -> None:
        """Open half of the S3 connections (at most :data:`PREWARM_CONNECTIONS`) while the
        mount comes up: a cold start's first burst of GETs (a directory walk's window) then
        finds them open instead of each paying a connection's round trips across regions
        first."""
        n = await origin.open_connections(min(self.cfg.max_connections // 2, PREWARM_CONNECTIONS))
        log.info("opened %d connection(s) to S3 ahead of the first reads", n)

    async def _watch_unmount(self, origin: Origin) -> None:
        """Stop S3 requests as soon as the mount is gone from the mount table, and give
        the mount point's registry entry and control socket up.

        The request server ends only once every file is closed and every request in
        flight answered, and an unmount (plain, with the kernel's own readahead in
        flight, or lazy, with readers still blocked) says nothing to the daemon: reads
        waiting on S3 through an outage would hold the daemon until their retry
        deadline. They fail at once instead. A lazy unmount (``umount -l``) leaves the
        daemon running while files stay open, and the mount point free for a new mount:
        the entry and the socket are the new mount's to make (this daemon's snapshots
        overwrote its entry, and its end removed both).
        """
        device = self._dev  # (found once the mount was made)
        if not device:
            return
        while await trio.to_thread.run_sync(_device_mounted, device):
            await trio.sleep(UNMOUNT_POLL)
        log.info("%s was unmounted; stopping S3 requests in flight", self.cfg.mountpoint)
        origin.close()
        with contained("maintenance", "withdrawing the registry entry of a detached mount"):
            await trio.to_thread.run_sync(self._withdraw_entry)
        if self.control is not None:
            self.control.withdraw()

    def _withdraw_entry(self) -> None:
        """Remove this daemon's registry entry for good and write its detached entry (a
        worker thread: it waits for a snapshot being written)."""
        with self._registry_lock:
            if not self._detached:
                self._detach()
            self._register_detached()

    def _detach(self) -> None:
        """Give the mount point's entry up for good; from now on the snapshots go to the
        detached entry (``cachefs status`` lists the daemon as detached until it ends).
        Under the registry lock."""
        self._detached = True
        self._detached_at = time.time()
        registry.unregister(self.cfg.mountpoint, os.getpid())

    def _publish_status(self) -> None:
        """Write the status snapshot into the registry entry, unless the mount is gone from
        the mount table: then withdraw the entry instead (the unmount watcher sees it only
        within UNMOUNT_POLL, and a new mount at the mount point may have made the entry its
        own by then) and write the detached entry, as every later snapshot does. A worker
        thread (a read of the mount table, a file written)."""
        with self._registry_lock:
            if not self._detached and self._dev and not _device_mounted(self._dev):
                self._detach()
            if self._detached:
                self._register_detached()
            else:
                self._register()

    def _register_detached(self) -> None:
        # (a daemon ending after its unmount shows here for its last seconds, too)
        registry.register_detached({
            **self._entry(), "detached_at": self._detached_at,
            "process_start": registry.process_start(os.getpid())})

    def _register(self) -> None:
        registry.register(self.cfg.mountpoint, self._entry())

    def _entry(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "pid": os.getpid(), "mountpoint": str(cfg.mountpoint),
            "source": str(cfg.source), "cache_dir": str(cfg.cache_dir),
            "metrics_addr": self.metrics_addr, "started_at": self.started_at,
            "cache_size": cfg.cache_size, "cache_policy": cfg.cache_policy,
            "updated_at": time.time(), "stats": metrics.totals(),
            "tiers": {"read_bytes": metrics.by_label(metrics.TIER_READ_BYTES),
                      "loads": metrics.by_label(metrics.TIER_HITS),
                      "shared_lookups": metrics.by_label(metrics.SHARED_LOOKUPS),
                      "shared_publishes": metrics.by_label(metrics.SHARED_PUBLISHES),
                      "shared_leases": metrics.by_label(metrics.SHARED_LEASES)},
            "shared": self.shared.describe() if self.shared is not None else None,
            "background_errors": metrics.by_label(metrics.BACKGROUND_ERRORS),
            "control_rejected": metrics.by_label(metrics.CONTROL_REJECTED),
            "sweep_stops": metrics.by_label(metrics.SWEEP_STOPS),
        }

    async def _watch_signals(self, origin: Origin) -> None:
        # The stop signals unmount; SIGHUP, SIGUSR1, SIGUSR2 and the timer signals are
        # taken and ignored (logged): their default action ends the process, which left a
        # dead mount (a log rotation's "kill -USR1" is common; the log is appended to, so
        # logrotate's copytruncate rotates it). See cachefs.startup.IGNORED_SIGNALS.
        ignored = IGNORED_SIGNALS
        with trio.open_signal_receiver(*STOP_SIGNALS, *ignored) as sigs:
            held = self._early_stop.received  # (arrived while the mount came up)
            if held is None:
                async for signum in sigs:
                    if signum not in ignored:
                        break
                    log.info("received %s; ignored (SIGTERM unmounts)",
                             signal.Signals(signum).name)
                else:
                    return
            stop = held or signal.Signals(signum)
            log.info("received %s%s; unmounting", stop.name,
                     "" if self._serving.is_set() else " while starting")
            # The request server is stopped once it serves (a mount that is still coming
            # up becomes ready first: what stops it is the path every other stop takes).
            await self._serving.wait()
            # Reads waiting on S3 (an outage) fail now instead of at their retry
            # deadline, so their files are closed and the connection can end.
            origin.close()
            await self._stop_serving()

    async def _stop_serving(self) -> None:
        """Unmount (lazily: files still open keep the connection for STOP_GRACE seconds),
        then abort the connection, which ends the request server."""
        device, server = self.device, self.server
        if device is None or server is None:
            return
        await trio.to_thread.run_sync(lambda: device.close(unmount=True))
        with trio.move_on_after(STOP_GRACE):
            await server.stopped()
            return
        if not Device.abort(self._dev):
            log.warning("files are still open on the unmounted %s; stopping anyway",
                        self.cfg.mountpoint)
        server.cancel()

    async def _maintenance(self, cache: BlockCache, env: LmdbEnv) -> None:
        """Status snapshot every second while the mount is busy, every
        STATUS_IDLE_INTERVAL while it is idle; last-use batches every few seconds, and
        an LMDB sync when something was written since the last one; free heap memory
        given back (:mod:`cachefs.heap`) once the mount goes quiet after use, and every
        TRIM_INTERVAL while it stays busy. A failure (disk full, runtime dir gone, a bug)
        skips that step only.

        An idle mount does next to nothing: a snapshot collects every metric (several
        milliseconds of CPU, and of the GIL), so it is only taken when
        :func:`metrics.activity` changed since the last one, or the last one is
        STATUS_IDLE_INTERVAL old (``cachefs status`` shows its age)."""
        last_sync = last_published = last_trim = trio.current_time()
        published: tuple[float, ...] | None = None
        trimmed: tuple[float, ...] | None = None
        synced_writes = -1
        while True:
            await trio.sleep(STATUS_INTERVAL)
            activity = metrics.activity()  # (before the snapshot: what follows is news)
            published_before = published
            if (activity != published
                    or trio.current_time() - last_published >= STATUS_IDLE_INTERVAL):
                published, last_published = activity, trio.current_time()
                with contained("maintenance", "publishing the status snapshot"):
                    await trio.to_thread.run_sync(self._publish_status)
            if trio.current_time() - last_sync >= MAINTENANCE_INTERVAL:
                last_sync = trio.current_time()
                with contained("maintenance", "keeping disk for the index to grow into"):
                    await trio.to_thread.run_sync(env.keep_reserve, index_reserve(self.cfg))
                with contained("maintenance", "recording last use and syncing the index"):
                    touched = cache.take_touches()
                    await trio.to_thread.run_sync(cache.flush_touches, touched)
                    writes = _LMDB_WRITES.value
                    if writes != synced_writes:
                        await trio.to_thread.run_sync(env.sync)
                        synced_writes = writes
            quiet = activity == published_before  # (nothing happened this second)
            if activity != trimmed and (  # (an idle mount freed nothing since)
                    quiet or trio.current_time() - last_trim >= heap.TRIM_INTERVAL):
                last_trim, trimmed = trio.current_time(), activity
                with contained("maintenance", "giving free heap memory back"):
                    await trio.to_thread.run_sync(heap.release_free_memory)

    async def _trim_cache(self, cache: BlockCache) -> None:
        """A cache holding more than its capacity (filled under a larger --cache-size, or
        recounted in disk allocation) is trimmed down to it, least recently used first,
        while the mount serves (a large trim must not hold the mount back)."""
        if cache.used <= cache.capacity:
            return
        log.info("the cache holds %d bytes, over its capacity of %d: evicting the least "
                 "recently used blocks down to it", cache.used, cache.capacity)
        with contained("maintenance", "evicting the cache down to its capacity"):
            freed = await trio.to_thread.run_sync(cache.trim_to_capacity)
            log.info("evicted %d bytes; the cache holds %d", freed, cache.used)

    async def _remove_orphans(self, cache: BlockCache) -> None:
        with contained("orphan_scan", "removing cache files the index does not name"):
            await trio.to_thread.run_sync(cache.remove_orphans, self.started_at)


__all__ = ["CachefsError", "Daemon"]

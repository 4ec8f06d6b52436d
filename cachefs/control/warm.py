"""Pre-warming: make whole directories or listed objects resident in the disk cache.

Runs inside the daemon (asked over the control socket by ``cachefs warm``),
so blocks are fetched once whatever else reads them, through the same memory
budget and connection limits; warm loads run at prefetch priority, so
training reads keep theirs. Already cached blocks are skipped: a warm that
was interrupted resumes where it stopped. ``check`` only counts what is
cached and fetches nothing.

Cluster warm (``shard=(i, n)``, ``cachefs warm --shard I/N``, needs a shared
tier): only the blocks the shared tier assigns to node ``i`` of ``n``
(:meth:`cachefs.read.shared.SharedTier.shard_of`, a hash of the block's
identity, the same on every node) are loaded, from the shared tier if another
node put them there already, else from the origin; each is then made sure to
be in the shared tier (published, waiting for it). After all ``n`` nodes ran
their share, every block crossed regions once and every node can read
everything from the shared tier. A block of the share that could not be put
there fails its object, with why (the tier does not answer, refuses or throttles
writes); run the warm again.

Tasks: one producer walks the requested paths (listing directories through
the metadata cache) into a bounded channel; ``parallel`` workers warm one
object at a time. All belong to the nursery of :func:`warm`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence

import trio

from cachefs import metrics
from cachefs.cache.index import enc
from cachefs.cache.metadata import Metadata
from cachefs.errors import CachefsError
from cachefs.read.fetcher import Fetcher, ObjectVersion
from cachefs.read.prefetcher import Prefetcher
from cachefs.read.shared import SharedTier

log = logging.getLogger(__name__)

WALK_CHUNK = 256  # directory entries read per index snapshot
# Failures kept for the final report (the rest are counted): a million missing objects must
# not grow the daemon.
MAX_FAILURES_KEPT = 1000


@dataclasses.dataclass
class WarmProgress:
    objects_total: int = 0
    objects_done: int = 0
    bytes_total: int = 0
    bytes_done: int = 0  # resident now (cached before, or fetched by this job)
    bytes_fetched: int = 0  # fetched from below the disk (shared tier or S3) by this job
    bytes_published: int = 0  # with a shard: bytes of the share confirmed in the shared tier
    listing_done: bool = False
    shard: tuple[int, int] | None = None
    failed: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    failed_count: int = 0

    def fail(self, path: str, message: str) -> None:
        self.failed_count += 1
        if len(self.failed) < MAX_FAILURES_KEPT:
            self.failed.append((path, message))

    def as_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["failed"] = [list(f) for f in self.failed[:100]]
        d["failed_count"] = self.failed_count
        return d


async def _walk(metadata: Metadata, root: str, rel_paths: Sequence[str],
                send: trio.MemorySendChannel[tuple[str, ObjectVersion | None]],
                progress: WarmProgress,
                weigh: Callable[[ObjectVersion], int] = lambda obj: obj.size) -> None:
    """Send (path, object) for every file under the requested paths; (path, None) for a
    path that does not exist. ``weigh`` gives the bytes of an object this job covers."""
    async with send:
        for rel in rel_paths:
            rel = rel.strip("/")
            key = root + rel
            entry = await metadata.find_file(key) if rel else None
            if entry is not None:
                obj = ObjectVersion(key, entry.etag, entry.size)
                progress.objects_total += 1
                progress.bytes_total += weigh(obj)
                await send.send((rel, obj))
                continue
            prefix = key + "/" if rel else root
            await metadata.ensure(prefix)
            if rel and metadata.count(prefix) == 0:
                parent = key[:key.rfind("/") + 1]
                found = await metadata.lookup(parent, enc(key[len(parent):]))
                if found is None or not found.is_dir:
                    await send.send((rel, None))
                continue  # (a directory with nothing in it: nothing to warm)
            stack = [prefix]
            while stack:
                d = stack.pop()
                await metadata.ensure(d)
                metadata.list_ahead(d)  # the walk's next directories are listed meanwhile
                subdirs = []
                after: bytes | None = None
                while True:
                    # A chunk per index snapshot: a million files stream through with flat
                    # memory, and no read transaction stays open across the sends.
                    chunk = list(itertools.islice(metadata.iter_entries(d, after), WALK_CHUNK))
                    if not chunk:
                        break
                    after = chunk[-1].name
                    for entry in chunk:
                        name = entry.name.decode("utf-8", "surrogateescape")
                        if entry.is_dir:
                            subdirs.append(d + name + "/")
                            continue
                        obj = ObjectVersion(d + name, entry.etag, entry.size)
                        progress.objects_total += 1
                        progress.bytes_total += weigh(obj)
                        await send.send(((d + name)[len(root):], obj))
                stack.extend(reversed(subdirs))
    progress.listing_done = True


class Warmer:
    """Warm jobs of one mount: objects listed by ``metadata``, loaded by ``fetcher``."""

    def __init__(self, metadata: Metadata, prefetcher: Prefetcher, *, root_prefix: str,
                 shared: SharedTier | None = None) -> None:
        self.metadata = metadata
        self.prefetcher = prefetcher
        self.root_prefix = root_prefix
        self.shared = shared

    async def warm(self, rel_paths: Sequence[str], *, parallel: int = 16, check: bool = False,
                   on_progress: Callable[[WarmProgress], Awaitable[None]] | None = None,
                   interval: float = 0.5, shard: tuple[int, int] | None = None
                   ) -> WarmProgress:
        """Warm (or with ``check``, inspect) every file under ``rel_paths`` (relative to
        the mount root; "" is everything); with ``shard=(i, n)`` only node i's share of
        the blocks, into the shared tier too. Returns the final progress. Raises
        CachefsError when a shard is asked of a mount without a shared tier."""
        if shard is not None:
            i, n = shard
            if not 0 <= i < n:
                raise CachefsError(f"shard {i}/{n}: expected 0 <= I < N")
            if self.shared is None:
                raise CachefsError("this mount has no shared cache tier (--shared-cache): "
                                   "warming a shard would leave the other shards uncached")
        return await _warm(self.metadata, self.prefetcher, self.root_prefix, rel_paths,
                           parallel=parallel, check=check, on_progress=on_progress,
                           interval=interval, shared=self.shared, shard=shard)


async def _warm(metadata: Metadata, prefetcher: Prefetcher, root: str,
                rel_paths: Sequence[str], *,
                parallel: int, check: bool,
                on_progress: Callable[[WarmProgress], Awaitable[None]] | None,
                interval: float, shared: SharedTier | None = None,
                shard: tuple[int, int] | None = None) -> WarmProgress:
    progress = WarmProgress(shard=shard)
    fetcher: Fetcher = prefetcher.fetcher
    send, receive = trio.open_memory_channel[tuple[str, ObjectVersion | None]](0)

    def mine(obj: ObjectVersion) -> list[int]:
        """The block indexes of ``obj`` this job covers."""
        blocks = range(fetcher.block_count(obj))
        if shard is None or shared is None:
            return list(blocks)
        return [i for i in blocks if shared.shard_of(fetcher.ref(obj, i), shard[1]) == shard[0]]

    def weigh(obj: ObjectVersion) -> int:
        if shard is None:
            return obj.size
        return sum(fetcher.block_len(obj, i) for i in mine(obj))

    async def publish(obj: ObjectVersion, index: int) -> bool:
        assert shared is not None
        ref = fetcher.ref(obj, index)
        return await shared.ensure_published(ref, lambda: fetcher.cache.get(ref.bid))

    async def worker(receive: trio.MemoryReceiveChannel[tuple[str, ObjectVersion | None]]
                     ) -> None:
        async with receive:
            async for rel, obj in receive:
                if obj is None:
                    progress.fail(rel, "no such file or directory")
                    continue
                try:
                    unpublished = not_kept = 0
                    for index in mine(obj):
                        n = fetcher.block_len(obj, index)
                        if check:
                            if fetcher.is_cached(obj, index):
                                progress.bytes_done += n
                            continue
                        if await prefetcher.warm_block(obj, index):
                            progress.bytes_fetched += n
                        if shard is not None:
                            if await publish(obj, index):
                                progress.bytes_published += n
                            else:
                                unpublished += 1
                        elif not fetcher.is_cached(obj, index):
                            # Loaded, written back, and not on disk: the cache did not
                            # admit it (full, under the keep policy) or could not write it.
                            not_kept += 1
                            continue
                        progress.bytes_done += n
                        metrics.WARM_BYTES_DONE.inc(n)
                    if unpublished:
                        assert shared is not None
                        why = shared.why_unpublished()
                        raise CachefsError(f"{unpublished} block(s) of this node's share could "
                                           "not be put into the shared cache tier"
                                           + (f": {why}" if why else ""))
                    if not_kept:
                        raise CachefsError(f"not kept: the cache is full ({not_kept} block(s) "
                                           "not admitted; --cache-size, or its disk)")
                    progress.objects_done += 1
                    metrics.WARM_OBJECTS_DONE.inc()
                except CachefsError as exc:
                    progress.fail(rel, str(exc))
                    log.warning("warm: %s failed: %s", rel, exc)

    accounted = 0  # bytes of this job added to the warm-target gauge

    def account() -> None:
        nonlocal accounted
        if not check:
            metrics.WARM_BYTES_TOTAL.inc(progress.bytes_total - accounted)
            accounted = progress.bytes_total

    async def reporter() -> None:
        while True:
            await trio.sleep(interval)
            account()
            if on_progress is not None:
                await on_progress(progress)

    try:
        async with trio.open_nursery() as nursery:
            async with trio.open_nursery() as work:
                work.start_soon(_walk, metadata, root, rel_paths, send, progress, weigh)
                for _ in range(max(1, parallel)):
                    work.start_soon(worker, receive.clone())
                await receive.aclose()
                nursery.start_soon(reporter)
            nursery.cancel_scope.cancel()
    finally:
        metrics.WARM_BYTES_TOTAL.dec(accounted)
    if check:  # objects are "done" when every block is cached
        progress.objects_done = progress.objects_total - progress.failed_count
    return progress

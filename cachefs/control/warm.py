"""Pre-warming: make whole directories or listed objects resident in the disk cache.

Runs inside the daemon (asked over the control socket by ``cachefs warm``),
so blocks are fetched once whatever else reads them, through the same memory
budget and connection limits; warm loads run at prefetch priority, so
training reads keep theirs. Already cached blocks are skipped: a warm that
was interrupted resumes where it stopped. ``check`` only counts what is
cached and fetches nothing.

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
from cachefs.cache.metadata import Metadata
from cachefs.errors import CachefsError
from cachefs.read.fetcher import Fetcher, ObjectVersion
from cachefs.read.prefetcher import Prefetcher

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
    bytes_fetched: int = 0  # fetched from S3 by this job
    listing_done: bool = False
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
                progress: WarmProgress) -> None:
    """Send (path, object) for every file under the requested paths; (path, None) for a
    path that does not exist."""
    async with send:
        for rel in rel_paths:
            rel = rel.strip("/")
            key = root + rel
            entry = await metadata.find_file(key) if rel else None
            if entry is not None:
                progress.objects_total += 1
                progress.bytes_total += entry.size
                await send.send((rel, ObjectVersion(key, entry.etag, entry.size)))
                continue
            prefix = key + "/" if rel else root
            await metadata.ensure(prefix)
            if rel and metadata.count(prefix) == 0:
                await send.send((rel, None))
                continue
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
                        progress.bytes_total += obj.size
                        await send.send(((d + name)[len(root):], obj))
                stack.extend(reversed(subdirs))
    progress.listing_done = True


class Warmer:
    """Warm jobs of one mount: objects listed by ``metadata``, loaded by ``fetcher``."""

    def __init__(self, metadata: Metadata, prefetcher: Prefetcher, *, root_prefix: str) -> None:
        self.metadata = metadata
        self.prefetcher = prefetcher
        self.root_prefix = root_prefix

    async def warm(self, rel_paths: Sequence[str], *, parallel: int = 16, check: bool = False,
                   on_progress: Callable[[WarmProgress], Awaitable[None]] | None = None,
                   interval: float = 0.5) -> WarmProgress:
        """Warm (or with ``check``, inspect) every file under ``rel_paths`` (relative to
        the mount root; "" is everything). Returns the final progress."""
        return await _warm(self.metadata, self.prefetcher, self.root_prefix, rel_paths,
                           parallel=parallel, check=check, on_progress=on_progress,
                           interval=interval)


async def _warm(metadata: Metadata, prefetcher: Prefetcher, root: str,
                rel_paths: Sequence[str], *,
                parallel: int, check: bool,
                on_progress: Callable[[WarmProgress], Awaitable[None]] | None,
                interval: float) -> WarmProgress:
    progress = WarmProgress()
    fetcher: Fetcher = prefetcher.fetcher
    send, receive = trio.open_memory_channel[tuple[str, ObjectVersion | None]](0)

    async def worker(receive: trio.MemoryReceiveChannel[tuple[str, ObjectVersion | None]]
                     ) -> None:
        async with receive:
            async for rel, obj in receive:
                if obj is None:
                    progress.fail(rel, "no such file or directory")
                    continue
                try:
                    for index in range(fetcher.block_count(obj)):
                        n = fetcher.block_len(obj, index)
                        if check:
                            if fetcher.is_cached(obj, index):
                                progress.bytes_done += n
                            continue
                        if await prefetcher.warm_block(obj, index):
                            progress.bytes_fetched += n
                        progress.bytes_done += n
                        metrics.WARM_BYTES_DONE.inc(n)
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
                work.start_soon(_walk, metadata, root, rel_paths, send, progress)
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

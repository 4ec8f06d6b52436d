"""``cachefs manifest export s3://BUCKET/PREFIX > FILE``: write a manifest by listing.

The bucket is listed with ``Delimiter=/`` directory by directory, ``--parallel``
directories at once (threads; each listing goes through the retrying store,
like the daemon's), and every object is written as soon as its page arrives:
CSV ``key,size,etag,mtime`` with a header row (``--format jsonl`` for JSON
lines), which ``cachefs mount --manifest FILE`` reads back. Memory stays flat:
only the directories still to list are held. Rows come in no particular order.
"""

from __future__ import annotations

import csv
import json
import sys
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, TextIO

from cachefs.config import parse_s3_url
from cachefs.errors import ConfigError, StoreError
from cachefs.s3.store import ObjectInfo, ObjectStore, list_dir


class _Writer:
    def __init__(self, out: TextIO, fmt: str) -> None:
        self.out = out
        self.fmt = fmt
        self.lock = threading.Lock()
        self.count = 0
        self._csv = csv.writer(out, lineterminator="\n")
        if fmt == "csv":
            self._csv.writerow(["key", "size", "etag", "mtime"])

    def write(self, objects: list[ObjectInfo]) -> None:
        with self.lock:
            for o in objects:
                mtime: float | int = int(o.mtime) if o.mtime == int(o.mtime) else o.mtime
                if self.fmt == "csv":
                    self._csv.writerow([o.key, o.size, o.etag, mtime])
                else:
                    self.out.write(json.dumps({"key": o.key, "size": o.size, "etag": o.etag,
                                               "mtime": mtime}) + "\n")
            self.count += len(objects)


def export(store: ObjectStore, prefix: str, out: TextIO, *, parallel: int = 16,
           fmt: str = "csv") -> tuple[int, int]:
    """List everything under ``prefix`` into ``out``; returns (objects, directories)."""
    writer = _Writer(out, fmt)
    todo: deque[str] = deque([prefix])
    dirs = 0

    def one(p: str) -> list[str]:
        sub: list[str] = []
        for page in list_dir(store, p):
            writer.write(page.objects)
            sub += page.prefixes
        return sub

    with ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="export") as pool:
        running: set[Future[list[str]]] = set()
        while todo or running:
            # At most `parallel` listings in flight; the rest wait as prefixes in `todo`.
            while todo and len(running) < parallel:
                running.add(pool.submit(one, todo.popleft()))
                dirs += 1
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                todo.extend(f.result())
    out.flush()
    return writer.count, dirs


def export_main(args: Any) -> int:
    from cachefs.s3.boto import S3Store
    from cachefs.s3.retry import RetryingStore

    url = parse_s3_url(args.source)
    if args.parallel < 1:
        raise ConfigError("--parallel must be at least 1")
    if args.format not in ("csv", "jsonl"):
        raise ConfigError("--format must be csv or jsonl")
    s3 = S3Store(url.bucket, endpoint_url=args.endpoint_url, region=args.region,
                 anonymous=args.no_sign_request, max_connections=max(4, args.parallel))
    store = RetryingStore(s3 if args.region is not None else s3.in_bucket_region())
    t0 = time.monotonic()
    try:
        objects, dirs = export(store, url.prefix, sys.stdout, parallel=args.parallel,
                               fmt=args.format)
    except BrokenPipeError:
        return 1
    except StoreError as exc:
        raise StoreError(f"cannot list {url}: {exc}") from None
    print(f"cachefs manifest export: {objects} objects in {dirs} directories of {url} "
          f"in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return 0

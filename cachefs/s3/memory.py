"""An in-memory object store for unit tests and examples (shipped code, not a test hack)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable

from cachefs.errors import NoSuchKey, ObjectChanged
from cachefs.s3.store import ListPage, ObjectInfo


class MemoryStore:
    """An in-memory :class:`ObjectStore` for unit tests. Thread-safe.

    ``fault`` may be set to a callable ``(op, key) -> None`` that raises to inject
    failures. ``calls`` counts requests per operation.
    """

    def __init__(self, bucket: str = "bucket", page_size: int = 1000) -> None:
        self.bucket = bucket
        self.page_size = page_size
        self._objects: dict[str, tuple[bytes, ObjectInfo]] = {}
        self._lock = threading.Lock()
        self.calls: dict[str, int] = {"list": 0, "head": 0, "get": 0}
        self.fault: Callable[[str, str], None] | None = None

    def put(self, key: str, data: bytes, mtime: float | None = None) -> ObjectInfo:
        info = ObjectInfo(key, len(data), hashlib.md5(data).hexdigest(),
                          time.time() if mtime is None else mtime)
        with self._lock:
            self._objects[key] = (data, info)
        return info

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(key, None)

    def _count(self, op: str, key: str) -> None:
        with self._lock:
            self.calls[op] += 1
        if self.fault is not None:
            self.fault(op, key)

    def list_page(self, prefix: str, token: str | None,
                  start_after: str | None = None) -> ListPage:
        self._count("list", prefix)
        with self._lock:
            keys = sorted(k for k in self._objects if k.startswith(prefix)
                          and (start_after is None or k > start_after))
            infos = {k: self._objects[k][1] for k in keys}
        entries: list[tuple[str, ObjectInfo | None]] = []
        seen_prefixes: set[str] = set()
        for k in keys:
            rest = k[len(prefix):]
            slash = rest.find("/")
            if slash >= 0:
                p = prefix + rest[:slash + 1]
                if p not in seen_prefixes:
                    seen_prefixes.add(p)
                    entries.append((p, None))
            else:
                entries.append((k, infos[k]))
        if token:  # the last entry of the previous page, as S3's tokens resume
            entries = [e for e in entries if e[0] > token]
        chunk = entries[:self.page_size]
        more = len(entries) > self.page_size
        return ListPage([info for _, info in chunk if info is not None],
                        [p for p, info in chunk if info is None],
                        chunk[-1][0] if more else None)

    def head(self, key: str) -> ObjectInfo:
        self._count("head", key)
        with self._lock:
            if key not in self._objects:
                raise NoSuchKey(f"s3://{self.bucket}/{key} does not exist")
            return self._objects[key][1]

    def get_range(self, key: str, etag: str, start: int, end: int) -> bytes:
        self._count("get", key)
        with self._lock:
            if key not in self._objects:
                raise NoSuchKey(f"s3://{self.bucket}/{key} does not exist")
            data, info = self._objects[key]
        if etag and info.etag != etag:
            raise ObjectChanged(f"s3://{self.bucket}/{key} changed since it was opened")
        return data[start:end]

"""An in-memory object store for unit tests and examples (shipped code, not a test hack)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable

from cachefs.errors import NoSuchKey, ObjectChanged
from cachefs.s3.integrity import Checksum, digest
from cachefs.s3.store import Body, Exchange, ListPage, ObjectInfo


class MemoryStore:
    """An in-memory :class:`ObjectStore` for unit tests. Thread-safe.

    ``fault`` may be set to a callable ``(op, key) -> None`` that raises to inject
    failures; ``on_get`` to a callable ``(key, exchange) -> None`` that runs inside a GET
    with its :class:`Exchange` (to stall until aborted, say); ``mangle`` to a callable
    ``(key, data) -> bytes`` that alters what a GET answers (bytes altered in transit).
    ``calls`` counts requests per operation.
    """

    def __init__(self, bucket: str = "bucket", page_size: int = 1000) -> None:
        self.bucket = bucket
        self.page_size = page_size
        self._objects: dict[str, tuple[bytes, ObjectInfo, Checksum | None]] = {}
        self._lock = threading.Lock()
        self.calls: dict[str, int] = {"list": 0, "head": 0, "get": 0}
        self.fault: Callable[[str, str], None] | None = None
        self.on_get: Callable[[str, Exchange], None] | None = None
        self.mangle: Callable[[str, bytes], bytes] | None = None

    def put(self, key: str, data: bytes, mtime: float | None = None,
            checksum: str | None = None) -> ObjectInfo:
        """Store ``data``; ``checksum`` names a full-object checksum S3 would keep
        (``crc64nvme``, ``crc32``...)."""
        info = ObjectInfo(key, len(data), hashlib.md5(data).hexdigest(),
                          time.time() if mtime is None else mtime)
        stated = Checksum(checksum, digest(checksum, data)) if checksum else None
        with self._lock:
            self._objects[key] = (data, info, stated)
        return info

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(key, None)

    def _count(self, op: str, key: str) -> None:
        with self._lock:
            self.calls[op] += 1
        if self.fault is not None:
            self.fault(op, key)

    def _version(self, key: str, etag: str) -> tuple[bytes, ObjectInfo, Checksum | None]:
        with self._lock:
            if key not in self._objects:
                raise NoSuchKey(f"s3://{self.bucket}/{key} does not exist")
            found = self._objects[key]
        if etag and found[1].etag != etag:
            raise ObjectChanged(f"s3://{self.bucket}/{key} changed since it was opened")
        return found

    def list_page(self, prefix: str, token: str | None,
                  start_after: str | None = None, exchange: Exchange | None = None, *,
                  flat: bool = False) -> ListPage:
        self._count("list", prefix)
        with self._lock:
            keys = sorted(k for k in self._objects if k.startswith(prefix)
                          and (start_after is None or k > start_after))
            infos = {k: self._objects[k][1] for k in keys}
        entries: list[tuple[str, ObjectInfo | None]] = []
        seen_prefixes: set[str] = set()
        for k in keys:
            rest = k[len(prefix):]
            slash = -1 if flat else rest.find("/")
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
        return self._version(key, "")[1]

    def get_range(self, key: str, etag: str, start: int, end: int) -> bytes:
        return self.get(key, etag, start, end).data

    def get(self, key: str, etag: str, start: int, end: int, *, whole: bool = False,
            exchange: Exchange | None = None, md5: bool = False) -> Body:
        self._count("get", key)
        if exchange is not None:
            exchange.sending()
            if self.on_get is not None:
                self.on_get(key, exchange)
            exchange.received()
        data, _, stated = self._version(key, etag)
        body = data[start:end]
        if self.mangle is not None:
            body = self.mangle(key, body)
        if whole:
            return Body(body, stated, etag_md5=True)
        return Body(body)

    def full_checksum(self, key: str, etag: str,
                      exchange: Exchange | None = None) -> Checksum | None:
        self._count("head", key)
        return self._version(key, etag)[2]

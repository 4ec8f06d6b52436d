"""Retries of transient store failures for blocking tools (``cachefs manifest export``).

The daemon does not use this: its requests go through :mod:`cachefs.s3.origin`
(retries until a deadline, waits outside the connection limit, hedging).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from cachefs import metrics
from cachefs.errors import TransientStoreError
from cachefs.s3.integrity import Checksum
from cachefs.s3.store import Body, Exchange, ListPage, ObjectInfo, ObjectStore

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: sleep U(0, min(cap, base * 2**n))."""

    attempts: int = 8
    base: float = 0.2
    cap: float = 10.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.cap, self.base * (2 ** attempt)))


class RetryingStore:
    """Retries transient failures of an inner store. Sleeps in the calling worker thread."""

    def __init__(self, inner: ObjectStore, policy: RetryPolicy | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.inner = inner
        self.bucket = inner.bucket
        self.policy = policy or RetryPolicy()
        self._sleep = sleep

    def _retry(self, op: str, fn: Callable[[], Any]) -> Any:
        for attempt in range(self.policy.attempts):
            try:
                return fn()
            except TransientStoreError as exc:
                if attempt + 1 >= self.policy.attempts:
                    raise
                delay = self.policy.delay(attempt)
                metrics.S3_RETRIES.labels(op, exc.reason).inc()
                log.warning("S3 %s failed (%s); retry %d/%d in %.2fs", op, exc, attempt + 1,
                            self.policy.attempts - 1, delay)
                self._sleep(delay)
        raise AssertionError("unreachable")

    def list_page(self, prefix: str, token: str | None,
                  start_after: str | None = None, exchange: Exchange | None = None, *,
                  flat: bool = False) -> ListPage:
        return self._retry(  # type: ignore[no-any-return]
            "list", lambda: self.inner.list_page(prefix, token, start_after, flat=flat))

    def head(self, key: str) -> ObjectInfo:
        return self._retry("head", lambda: self.inner.head(key))  # type: ignore[no-any-return]

    def get_range(self, key: str, etag: str, start: int, end: int) -> bytes:
        return self._retry(  # type: ignore[no-any-return]
            "get", lambda: self.inner.get_range(key, etag, start, end))

    def get(self, key: str, etag: str, start: int, end: int, *, whole: bool = False,
            exchange: Exchange | None = None, md5: bool = False) -> Body:
        return self._retry(  # type: ignore[no-any-return]
            "get", lambda: self.inner.get(key, etag, start, end, whole=whole,
                                                md5=md5))

    def full_checksum(self, key: str, etag: str,
                      exchange: Exchange | None = None) -> Checksum | None:
        return self._retry(  # type: ignore[no-any-return]
            "head", lambda: self.inner.full_checksum(key, etag))

"""The object store interface cachefs reads S3 through.

:class:`ObjectStore` is a *blocking* protocol: implementations are called from
worker threads (never from the trio thread; see :mod:`cachefs.read.fetcher`
and :mod:`cachefs.cache.metadata`). Every method raises only
:mod:`cachefs.errors` types.

Implementations (each in its own module of this package):

* :class:`cachefs.s3.boto.S3Store` -- listings and probes on boto3, ranged
  GETs on the lean client of :mod:`cachefs.s3.ranges`.
* :class:`cachefs.s3.retry.RetryingStore` -- wraps any store and retries
  ``TransientStoreError`` with exponential backoff and full jitter.
* :class:`cachefs.s3.memory.MemoryStore` -- a dict; shipped code for unit
  tests and examples, with counters and a hook for injected faults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import NamedTuple, Protocol


class ObjectInfo(NamedTuple):
    """One object version: identity is (key, etag). A named tuple: a listing makes
    a million of these, and a tuple is built in a third of a frozen dataclass's time."""

    key: str
    size: int
    etag: str
    mtime: float  # seconds since the epoch (LastModified)


@dataclasses.dataclass(slots=True)
class ListPage:
    """One page of a delimiter listing: objects directly under the prefix and sub-prefixes."""

    objects: list[ObjectInfo]
    prefixes: list[str]
    next_token: str | None = None


def list_dir(store: ObjectStore, prefix: str) -> Iterator[ListPage]:
    """Every page of a delimiter listing of ``prefix``, in order."""
    token: str | None = None
    while True:
        page = store.list_page(prefix, token)
        yield page
        if not page.next_token:
            return
        token = page.next_token


class ObjectStore(Protocol):
    """Read access to one bucket. All methods block; call them from worker threads."""

    bucket: str

    def list_page(self, prefix: str, token: str | None,
                  start_after: str | None = None) -> ListPage:
        """One page of ListObjectsV2 with Delimiter='/' under ``prefix``.

        ``token`` is None for the first page, then the previous page's ``next_token``.
        ``start_after`` (first page only): entries (keys, and common prefixes that
        keys after it roll up into) after that key, as S3's StartAfter; a large
        directory is listed as several key ranges at once this way.
        Raises NoSuchBucket, AccessDenied, CredentialsError, TransientStoreError.
        """
        ...

    def head(self, key: str) -> ObjectInfo:
        """HEAD one object. Raises NoSuchKey and the errors of list_dir."""
        ...

    def get_range(self, key: str, etag: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of version ``etag`` of ``key`` (If-Match).

        Raises ObjectChanged when the object is no longer that version, NoSuchKey
        when it is gone, and the errors of list_dir. Returns exactly end-start bytes.
        """
        ...

"""The object store interface cachefs reads S3 through.

:class:`ObjectStore` is a *blocking* protocol: implementations are called from
worker threads (never from the trio thread; see :mod:`cachefs.read.fetcher`
and :mod:`cachefs.cache.metadata`). Every method raises only
:mod:`cachefs.errors` types.

Implementations (each in its own module of this package):

* :class:`cachefs.s3.boto.S3Store` -- listings and probes on boto3, GETs and
  HEADs on the lean client of :mod:`cachefs.s3.ranges`.
* :class:`cachefs.s3.memory.MemoryStore` -- a dict; shipped code for unit
  tests and examples, with counters and hooks for injected faults.

Retries, deadlines, hedging and concurrency are not the stores' business: the
async layer of :mod:`cachefs.s3.origin` drives them, one attempt per call, and
stops a call in flight through its :class:`Exchange`.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple, Protocol

from cachefs.errors import TransientStoreError
from cachefs.s3.integrity import Checksum


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


@dataclasses.dataclass(slots=True)
class Body:
    """The answer to a GET: the bytes, and what S3 said about the whole object (set on
    whole-object reads only)."""

    data: bytes
    checksum: Checksum | None = None  # the full-object checksum S3 stated
    etag_md5: bool = False  # the ETag may be checked as the MD5 of the content
    md5: bytes | None = None  # the MD5 of ``data``, if computed on the way (``get(md5=True)``)


class Exchange:
    """One request on the wire, shared by the worker thread that sends it and the trio
    task waiting for it.

    The worker thread records progress (``sent_at``, ``first_byte_at``,
    ``progress_at``: ``time.monotonic()`` values, plain attribute stores that are
    atomic under the GIL) so the waiting task can tell a stalled request from a slow
    but progressing one. Any thread may :meth:`abort` it: the request's socket is shut
    down, so a worker blocked in recv() returns at once and the request fails; a
    request not yet sent fails when it tries to attach its socket. ``idle_timeout`` is
    the longest silence (no byte received) the request tolerates.
    """

    __slots__ = ("_aborted", "_lock", "_sock", "first_byte_at", "idle_timeout",
                 "progress_at", "sent_at")

    def __init__(self, idle_timeout: float = 30.0) -> None:
        self.idle_timeout = idle_timeout
        self.sent_at: float | None = None
        self.first_byte_at: float | None = None
        self.progress_at = time.monotonic()
        self._sock: socket.socket | None = None
        self._aborted = False
        self._lock = threading.Lock()

    def sending(self) -> None:
        """The request is about to be sent (worker thread)."""
        self.sent_at = self.progress_at = time.monotonic()

    def received(self) -> None:
        """Bytes of the answer arrived (worker thread)."""
        now = time.monotonic()
        if self.first_byte_at is None:
            self.first_byte_at = now
        self.progress_at = now

    def reached(self, first_at: float, last_at: float) -> None:
        """Bytes of the answer arrived, the first at ``first_at``, the last at ``last_at``
        (``time.monotonic()`` values; worker thread, reported after the fact by
        :func:`cachefs.s3.http1.exchange_plain`)."""
        if self.first_byte_at is None:
            self.first_byte_at = first_at
        self.progress_at = last_at

    @property
    def first_byte_latency(self) -> float | None:
        if self.sent_at is None or self.first_byte_at is None:
            return None
        return self.first_byte_at - self.sent_at

    @property
    def aborted(self) -> bool:
        return self._aborted

    def attach(self, sock: socket.socket | None) -> None:
        """The socket this request uses (worker thread); raises if already aborted."""
        with self._lock:
            if self._aborted:
                raise TransientStoreError("request abandoned", reason="stopping")
            self._sock = sock

    def detach(self) -> None:
        with self._lock:
            self._sock = None

    def abort(self) -> None:
        """Stop the request from any thread: its socket is shut down (not closed: the
        worker owns it and closes it on the way out)."""
        with self._lock:
            self._aborted = True
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                # socket.socket's own shutdown, also for TLS sockets: SSLSocket.shutdown
                # would tear down the TLS state a worker may be using at this moment.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass  # already closed or never connected


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
                  start_after: str | None = None, exchange: Exchange | None = None, *,
                  flat: bool = False) -> ListPage:
        """One page of ListObjectsV2 with Delimiter='/' under ``prefix``; with ``flat``,
        without a delimiter (every key under ``prefix``, at any depth; no common prefixes).

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

    def get(self, key: str, etag: str, start: int, end: int, *, whole: bool = False,
            exchange: Exchange | None = None, md5: bool = False) -> Body:
        """Like :meth:`get_range`, with the answer's integrity facts.

        ``whole``: ``[start, end)`` is the whole object: ask for it without a Range
        (so S3 treats it as a whole-object read and states its full-object checksum,
        which is requested) and fill in :class:`Body`'s checksum and etag_md5.
        ``exchange`` reports progress and lets another thread abort the request.
        ``md5`` (whole only): the caller will check the bytes against an MD5 ETag if S3
        states no full-object checksum; a store may compute it on the way
        (:attr:`Body.md5`; None when it did not).
        Checking the bytes is the caller's business (:mod:`cachefs.s3.integrity`).
        """
        ...

    def full_checksum(self, key: str, etag: str,
                      exchange: Exchange | None = None) -> Checksum | None:
        """The full-object checksum S3 keeps for version ``etag`` of ``key`` (HEAD with
        checksum mode), or None. Raises the errors of :meth:`get_range`."""
        ...

"""The FUSE request loop: worker threads read requests from the device and answer them.

Each of ``workers`` threads reads one request at a time from its own
descriptor of the connection (a blocking read into a buffer it reuses),
decodes it, calls the operation's handler and writes the reply: two system
calls per request and no task switch. Handlers come from
:class:`cachefs.fuse_ops.Operations`:

* the *inline* handler of an operation runs on the worker thread itself. It
  may read LMDB and local files (a worker may wait on the disk: that is what
  it is for), and must not touch what belongs to the trio thread (listings
  being made, fetches in flight, prefetch state);
* when it cannot answer without waiting on the trio side (a directory not
  listed yet, a block to fetch from S3) it raises :class:`Deferred`, and the
  request goes to the operation's *async* handler, run as a task of this
  server's nursery on the trio thread, which writes the reply when it has it.
  The worker goes on with the next request meanwhile. Operations without an
  inline handler (directories) always take that path;
* a :class:`Deferred` may carry a ``join``: the worker first asks it to attach
  the request to work already under way (a READ of a block being fetched joins
  that fetch); the reply is then written on the trio thread when that work
  ends, by a plain call (:meth:`RequestServer._joined`): no hand-over to the
  trio thread and no task for the request itself.

With the native loop (:mod:`cachefs.fuse.native`, given as ``native``) each worker's
loop is C: it answers READs of handles bound to verified cache files, IOCTLs, LOOKUPs
Python remembered there, and OPENs and RELEASEs of inodes Python gave an open template
itself, without the interpreter, and hands every other request to the same Python
function (:meth:`RequestServer._request_handler`) the Python loop calls, which first
catches up with the opens and releases the loop answered (:meth:`Handlers.drain_native`).

Per request the server counts ``cachefs_fuse_requests_total{op}`` and
``cachefs_fuse_request_duration_seconds{op}``; a handler's exception becomes
the errno of :func:`cachefs.fuse_ops.errno_for` (EIO plus a logged traceback
for an unexpected one: a bug answers one request with EIO, never ends the
mount).

Lifetime: :meth:`RequestServer.run` answers INIT, starts the workers and
returns when all of them have stopped: the connection ended (unmounted: reads
fail with ENODEV, or ECONNABORTED when it ends while a read takes a request) or
DESTROY arrived. Deferred requests still running then are
cancelled (nobody is left to answer). Workers are daemon threads; a worker in
a handler holds :attr:`RequestServer.active` above zero (the daemon waits for
it before closing the index).

Concurrency: workers share nothing but the handlers' objects (each handler
documents what it touches); the trio side is reached only through
:meth:`RequestServer.post` (thread-safe, in order, batched per wake-up of the
trio thread), the deferred path and joins (whose answers are written on the
trio thread, and dropped once :meth:`RequestServer.run` has ended: its
descriptors may be closed by then).
"""

from __future__ import annotations

import collections
import errno
import functools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from cachefs import metrics
from cachefs.fuse import abi
from cachefs.fuse.native import NativeReads

log = logging.getLogger(__name__)

#: Request workers by default. Most requests of a warm pass are answered in the native
#: loop, without the GIL (lookups, opens, releases, reads of verified cache files), so
#: more workers overlap more waits for the disk: without passthrough each file's READ is
#: one pread of its cache file (~300 us with the page cache dropped), and 2 workers left
#: 4 readers waiting for 2 of them. 4 against 2 (benchmarks/RESULTS.md, fourteenth round):
#: warm shuffled 4,503-4,953 against 4,218-4,857 files/s without passthrough, no change with
#: it nor cold, ~10% more daemon CPU per warm file. (When Python answered those requests,
#: an idle worker woken while another held the GIL made 4 cost more than it gained.)
DEFAULT_WORKERS = 4

#: Requests answered without a handler, by the name their count carries; any other is
#: counted as "other" (ENOSYS, or EROFS for a modifying one).
SPECIAL_OPS = {abi.FORGET: "forget", abi.BATCH_FORGET: "forget", abi.IOCTL: "ioctl",
               abi.INTERRUPT: "interrupt"}


#: A reply: bytes, or a sequence of buffers written as one message (no joining copy).
Reply = bytes | Sequence[bytes | memoryview] | None


_DEFERRED = metrics.FUSE_HANDED_OVER.labels("deferred")
_JOINED = metrics.FUSE_HANDED_OVER.labels("joined")


class Deferred(Exception):
    """Raised by an inline handler: the request needs the trio thread (its async handler).

    ``join``, when given, is tried first, on the worker: ``join(done)`` either arranges
    for ``done(reply, None)`` or ``done(None, error)`` to be called once, on the trio
    thread, and returns True (the request is answered then, without a task or a hand-over
    of its own: a READ of a block being fetched waits for that fetch), or returns False
    (nothing arranged: the async handler answers as usual)."""

    def __init__(self, join: Callable[[Callable[[Reply, BaseException | None], None]], bool]
                 | None = None) -> None:
        super().__init__()
        self.join = join


class Request:
    """One request: its header fields and its arguments (a private copy once deferred)."""

    __slots__ = ("body", "fd", "nodeid", "opcode", "pid", "t0", "uid", "unique")

    def __init__(self, fd: int, opcode: int, unique: int, nodeid: int, uid: int, pid: int,
                 body: bytes | memoryview, t0: float) -> None:
        self.fd = fd
        self.opcode = opcode
        self.unique = unique
        self.nodeid = nodeid
        self.uid = uid
        self.pid = pid
        self.body = body
        self.t0 = t0


InlineHandler = Callable[[Request], Reply]
AsyncHandler = Callable[[Request], Awaitable[Reply]]


class Handlers:
    """What the server needs of the operations (see :class:`cachefs.fuse_ops.Operations`)."""

    def table(self) -> dict[int, tuple[str, InlineHandler | None, AsyncHandler | None]]:
        """opcode -> (metric name, inline handler, async handler)."""
        raise NotImplementedError

    def error_code(self, op: str, exc: BaseException) -> int:
        """The errno answering ``exc`` (logs what needs logging)."""
        raise NotImplementedError

    def drain_native(self) -> None:
        """Catch up with what the native loop answered itself (opens and releases), before
        a request is answered in Python (any thread)."""

    def negotiated(self, result: abi.Negotiated) -> None:
        """Told what INIT settled, before any other request is read."""


class RequestServer:
    """Serves one FUSE connection with worker threads (see the module docstring)."""

    def __init__(self, open_fd: Callable[[], int], handlers: Handlers, *,
                 workers: int = DEFAULT_WORKERS, want_passthrough: bool = False,
                 native: NativeReads | None = None) -> None:
        self._open_fd = open_fd  # a new descriptor of the connection, owned by the caller
        self._handlers = handlers
        self._table = handlers.table()
        self._op_index = {op: metrics.FUSE_STATS.index[name]
                          for op, (name, _, _) in self._table.items()}
        # Requests answered without a handler are counted too (an IOCTL per open() of a
        # Python reader is a round trip like any other); their duration is not timed.
        self._special_index = {op: metrics.FUSE_STATS.index[name]
                               for op, name in SPECIAL_OPS.items()}
        self._other_index = metrics.FUSE_STATS.index["other"]
        self._trio_stats = metrics.FUSE_STATS.shard()  # replies written on the trio thread
        self.workers = max(1, workers)
        self.want_passthrough = want_passthrough
        self._native = native  # the C loop (None: every request is answered in Python)
        self.negotiated: abi.Negotiated | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._posted: collections.deque[tuple[Callable[..., object], tuple[Any, ...]]] = (
            collections.deque())
        self._post_scheduled = False
        self._post_lock = threading.Lock()
        self._lock = threading.Lock()
        self._running = 0
        self._busy: list[bool] = []  # per worker: inside a handler now
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._stopped: trio.Event | None = None

    # -- the trio side -------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Answer INIT, serve until the connection ends; ``started`` once INIT is done."""
        self._token = trio.lowlevel.current_trio_token()
        self._stopped = trio.Event()
        fds = [self._open_fd() for _ in range(self.workers)]
        try:
            self.negotiated = await trio.to_thread.run_sync(self._init, fds[0])
            self._handlers.negotiated(self.negotiated)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._running = len(fds)
                self._busy = [False] * len(fds)
                for i, fd in enumerate(fds):
                    t = threading.Thread(target=self._worker, args=(i, fd), daemon=True,
                                         name=f"cachefs-fuse-{i}")
                    self._threads.append(t)
                    t.start()
                task_status.started()
                await self._stopped.wait()
                nursery.cancel_scope.cancel()  # deferred requests: nobody left to answer
        finally:
            self._nursery = None
            alive = [t for t in self._threads if t.is_alive()]
            if not alive:
                for fd in fds:
                    os.close(fd)
            # else: a worker still blocked in read() keeps its descriptor (process exit
            # closes it); closing it now could hand its number to another file.

    async def stopped(self) -> None:
        """Return once every worker has stopped (the connection ended)."""
        assert self._stopped is not None
        await self._stopped.wait()

    def cancel(self) -> None:
        """End :meth:`run` now, workers or not (trio thread; after the connection was
        given up: a worker still blocked in its read is left to the process's exit)."""
        self._set_stopped()

    @property
    def active(self) -> int:
        """Workers inside a handler now."""
        return sum(self._busy)

    def stop(self, timeout: float) -> bool:
        """From now on answer every request EIO without a handler, and wait until no
        worker is inside one (any thread); returns whether none is. (A worker checks the
        flag after marking itself busy, so one that missed it is still waited for.)"""
        deadline = time.monotonic() + timeout
        self._stopping = True
        while any(self._busy):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def post(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` on the trio thread soon, in the order posted (any thread).
        Dropped silently once the server has stopped."""
        with self._post_lock:
            self._posted.append((fn, args))
            if self._post_scheduled:
                return
            self._post_scheduled = True
        token = self._token
        if token is None:
            return
        try:
            token.run_sync_soon(self._drain_posted)
        except trio.RunFinishedError:
            pass

    def _drain_posted(self) -> None:
        while True:
            with self._post_lock:
                if not self._posted:
                    self._post_scheduled = False
                    return
                batch = list(self._posted)
                self._posted.clear()
            for fn, args in batch:
                try:
                    fn(*args)
                except Exception:
                    log.exception("a request's follow-up work failed")

    def _defer(self, req: Request, handler: AsyncHandler) -> None:
        _DEFERRED.inc()
        if isinstance(req.body, memoryview):
            req.body = bytes(req.body)  # the worker's buffer is reused for the next request
        token = self._token
        assert token is not None
        try:
            token.run_sync_soon(self._start_deferred, req, handler)
        except trio.RunFinishedError:
            _write(req.fd, req.unique, -errno.EIO, None)

    def _start_deferred(self, req: Request, handler: AsyncHandler) -> None:
        if self._nursery is None:
            _write(req.fd, req.unique, -errno.EIO, None)
            return
        self._nursery.start_soon(self._serve_deferred, req, handler)

    def _join(self, req: Request, join: Callable[[Callable[[Reply, BaseException | None], None]],
                                                 bool], stats: metrics.RequestShard) -> bool:
        """Try ``join`` for ``req`` (worker thread); True when the request is taken care of."""
        try:
            if join(functools.partial(self._joined, req)):
                _JOINED.inc()
                return True
            return False
        except Exception as exc:  # a bug: this request fails, never the worker
            self._reply_error(req, self._handlers.error_code(self._table[req.opcode][0], exc),
                              stats)
            return True

    def _joined(self, req: Request, reply: Reply, error: BaseException | None) -> None:
        """The answer to a request its handler joined to work under way (trio thread; see
        :class:`Deferred`). Dropped once the server has stopped: the descriptors may be
        closed, and their numbers given to other files."""
        if self._nursery is None:
            return
        if error is not None:
            name = self._table[req.opcode][0]
            self._reply_error(req, self._handlers.error_code(name, error), self._trio_stats)
        else:
            self._reply(req, reply, self._trio_stats)

    async def _serve_deferred(self, req: Request, handler: AsyncHandler) -> None:
        name = self._table[req.opcode][0]
        try:
            reply = await handler(req)
        except Exception as exc:
            self._reply_error(req, self._handlers.error_code(name, exc), self._trio_stats)
        else:
            self._reply(req, reply, self._trio_stats)

    # -- the workers ---------------------------------------------------------------------
    def _init(self, fd: int) -> abi.Negotiated:
        """Read and answer INIT (the first request of every connection; worker thread)."""
        buf = bytearray(abi.BUFFER_SIZE)
        while True:
            n = _read(fd, buf)
            if n is None:
                raise abi.ProtocolError("the connection ended before INIT")
            _, opcode, unique, _, _, _, _, _, _ = abi.IN_HEADER.unpack_from(buf)
            if opcode != abi.INIT:
                _write(fd, unique, -errno.EIO, None)
                continue
            try:
                body, result = abi.negotiate(memoryview(buf)[abi.IN_HEADER.size:n],
                                             want_passthrough=self.want_passthrough)
            except abi.ProtocolError:
                _write(fd, unique, -errno.EPROTO, None)
                raise
            _write(fd, unique, 0, body)
            return result

    def _worker(self, index: int, fd: int) -> None:
        buf = bytearray(abi.BUFFER_SIZE)
        handle = self._request_handler(index, fd, buf)
        try:
            if self._native is not None:
                # The C loop answers what it can (see cachefs.fuse.native) and calls
                # handle for the rest.
                self._native.serve(fd, buf, handle, abi.MAX_READ)
                return
            bufs = [buf]
            readv = os.readv
            while True:
                try:
                    n = readv(fd, bufs)
                except OSError as exc:
                    if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                        continue  # ENOENT: the request was interrupted before we read it
                    if exc.errno in _ENDED:
                        return  # unmounted (or aborted)
                    raise
                if n <= 0 or handle(n):
                    return
        except Exception:
            log.exception("FUSE request worker failed; it stops")
        finally:
            self._worker_done()

    def _request_handler(self, index: int, fd: int, buf: bytearray) -> Callable[[int], bool]:
        """The function a worker calls for each request it read into ``buf`` (its length
        ``n``): it answers it, or hands it over; returns True when the worker must stop."""
        # The hot path of the mount: every name is a local, and a request costs one
        # header unpack, the handler and one writev.
        view = memoryview(buf)
        unpack = abi.IN_HEADER.unpack_from
        hsize = abi.IN_HEADER.size
        table = self._table
        op_index = self._op_index
        busy = self._busy
        stats = metrics.FUSE_STATS.shard()
        observe = stats.observe
        clock = time.perf_counter
        pack_out = abi.OUT_HEADER.pack
        out_size = abi.OUT_HEADER.size
        writev = os.writev
        # With the native loop, the handles it opened and released are caught up with
        # before any request here: a request of such a handle must find it.
        drain = self._handlers.drain_native if self._native is not None else None

        def handle(n: int) -> bool:
            if drain is not None:
                drain()
            t0 = clock()
            length, opcode, unique, nodeid, uid, _, pid, _, _ = unpack(buf)
            entry = table.get(opcode)
            if entry is None:
                return self._special(fd, opcode, unique, view[hsize:length], stats)
            name, inline, deferred = entry
            req = Request(fd, opcode, unique, nodeid, uid, pid, view[hsize:length], t0)
            if inline is None:
                assert deferred is not None
                self._defer(req, deferred)
                return False
            busy[index] = True
            try:
                if self._stopping:
                    _write(fd, unique, -errno.EIO, None)
                    return False
                reply = inline(req)
            except Deferred as wait:
                assert deferred is not None
                if wait.join is None or not self._join(req, wait.join, stats):
                    self._defer(req, deferred)
                return False
            except Exception as exc:
                self._reply_error(req, self._handlers.error_code(name, exc), stats)
                return False
            finally:
                busy[index] = False
            observe(op_index[opcode], clock() - t0)
            if reply is None:
                parts: list[bytes | memoryview] = [pack_out(out_size, 0, unique)]
            elif type(reply) is bytes:
                parts = [pack_out(out_size + len(reply), 0, unique), reply]
            else:
                _write(fd, unique, 0, reply)
                return False
            try:
                writev(fd, parts)
            except OSError as exc:
                _write_failed(fd, unique, exc, parts)
            return False

        return handle

    def _special(self, fd: int, opcode: int, unique: int, body: memoryview,
                 stats: metrics.RequestShard) -> bool:
        """Requests without a handler; returns True when the worker must stop."""
        stats.observe(self._special_index.get(opcode, self._other_index), 0.0)
        if opcode in (abi.FORGET, abi.BATCH_FORGET):
            return False  # nothing is kept per inode; no reply
        if opcode == abi.IOCTL:
            # Sent for every open() by Python's isatty() check (TCGETS), and the kernel
            # does not remember a refusal: answer at once, as a local file would.
            _write(fd, unique, -errno.ENOTTY, None)
            return False
        if opcode == abi.INTERRUPT:
            # Interrupts are not supported: ENOSYS to the INTERRUPT itself (its unique has
            # FUSE_INT_REQ_BIT set) tells the kernel to stop sending them, and the
            # interrupted request goes on to its own answer. (Answering the interrupted
            # request's unique instead would fail that request with ENOSYS.)
            _write(fd, unique, -errno.ENOSYS, None)
            return False
        if opcode == abi.DESTROY:
            _write(fd, unique, 0, None)
            return True
        code = errno.EROFS if opcode in abi.MODIFYING else errno.ENOSYS
        _write(fd, unique, -code, None)
        return False

    def _worker_done(self) -> None:
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last and self._token is not None:
            try:
                self._token.run_sync_soon(self._set_stopped)
            except trio.RunFinishedError:
                pass

    def _set_stopped(self) -> None:
        if self._stopped is not None:
            self._stopped.set()

    # -- replies ---------------------------------------------------------------------------
    def _reply(self, req: Request, reply: Reply, stats: metrics.RequestShard) -> None:
        stats.observe(self._op_index[req.opcode], time.perf_counter() - req.t0)
        _write(req.fd, req.unique, 0, reply)

    def _reply_error(self, req: Request, code: int, stats: metrics.RequestShard) -> None:
        name = self._table[req.opcode][0]
        stats.observe(self._op_index[req.opcode], time.perf_counter() - req.t0)
        metrics.FUSE_ERRORS.labels(name, errno.errorcode.get(code, str(code))).inc()
        _write(req.fd, req.unique, -code, None)


#: Errors of a read of the FUSE device that mean the connection has ended: unmounted or
#: aborted (ENODEV), or ended -- the last file of a detached mount closed, or an abort --
#: while the read was taking a request (ECONNABORTED).
_ENDED = (errno.ENODEV, errno.ECONNABORTED)


def _read(fd: int, buf: bytearray) -> int | None:
    """One request into ``buf``; None when the connection has ended."""
    while True:
        try:
            n = os.readv(fd, [buf])
        except OSError as exc:
            if exc.errno in (errno.EINTR, errno.EAGAIN, errno.ENOENT):
                continue  # ENOENT: the request was interrupted before we read it
            if exc.errno in _ENDED:
                return None  # unmounted (or aborted)
            raise
        return n if n > 0 else None


def _write(fd: int, unique: int, error: int, reply: Reply) -> None:
    if reply is None:
        parts: list[bytes | memoryview] = []
    elif isinstance(reply, bytes | bytearray | memoryview):
        parts = [reply]
    else:
        parts = list(reply)
    size = abi.OUT_HEADER.size + sum(len(p) for p in parts)
    message = [abi.OUT_HEADER.pack(size, error, unique), *parts]
    try:
        os.writev(fd, message)
    except OSError as exc:
        _write_failed(fd, unique, exc, message)


def _write_failed(fd: int, unique: int, exc: OSError, message: Sequence[bytes | memoryview]
                  ) -> None:
    """A reply (``message``: header and parts) could not be written."""
    # ENOENT: the request was interrupted (its caller is gone); ENODEV: unmounted.
    if exc.errno not in (errno.ENOENT, errno.ENODEV):
        size = sum(len(p) for p in message)
        log.error("cannot answer a FUSE request (%d bytes in %d parts): %s; answering EIO",
                  size, len(message) - 1, exc.strerror)
        if len(message) > 1:  # the caller must not wait for ever
            _write(fd, unique, -errno.EIO, None)

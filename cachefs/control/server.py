"""The daemon's control socket: warm, read-order hints and status for local clients.

Who may talk to it: the socket (``registry.control_socket(mountpoint)``) is
owned by the mounting user and mode 0600 whatever ``--allow-other`` says (it
is created in a private directory and renamed into place, so no other user
can connect in between); every accepted connection is also checked with
SO_PEERCRED: root and the daemon's own uid are served, anyone else gets an
error reply and a closed connection (``cachefs_control_rejected_total
{reason="peer"}``). With ``--allow-other``, other users read the files the
mount's modes allow them, but cannot make the daemon fetch, warm or reveal
anything.

Protocol: JSON objects, one per line (at most :data:`MAX_LINE` bytes each);
the server answers with JSON lines and closes the connection after the final
answer. Requests:

* ``{"op": "status"}`` -> ``{"event": "status", ...}``
* ``{"op": "hint", "paths": [relative paths in read order]}``
  -> ``{"event": "ok", "accepted": N}``
* ``{"op": "warm", "paths": [...], "parallel": N, "check": false}``
  -> ``{"event": "progress", ...}`` every half second, then ``{"event": "done", ...}``;
  an optional ``"shard": [I, N]`` warms only node I's share into the shared tier
* anything else -> ``{"event": "error", "message": "..."}`` and the connection closes.

Long path lists (a hint of a million files) are sent in chunks: requests with
``"append": true`` add their ``paths`` to the connection's pending list and
are answered ``{"event": "ok", "pending": N}`` (the client sends the next
chunk after that answer); the first request of the same op without
``append`` commits: it runs with the pending paths followed by its own.

Bounds (a hostile or broken client gets an error reply or a closed connection,
never a dead daemon and never unbounded memory):

* a request line is at most :data:`MAX_LINE` bytes and must arrive within
  :data:`LINE_TIMEOUT` seconds (slow clients are cut off);
* at most :data:`MAX_CONNECTIONS` connections are served at once; another
  waits up to :data:`CONNECT_WAIT` seconds for a slot (at most
  :data:`MAX_WAITING` of them wait), else it is refused with an error reply;
* the paths pending in chunked requests of all connections together are
  bounded by :data:`MAX_PENDING_BYTES` (accounted bytes: the UTF-8 length
  plus :data:`PATH_OVERHEAD` per path, roughly what Python keeps per string);
* a reply that cannot be sent within :data:`SEND_TIMEOUT` ends the connection.

Errors: a malformed request is answered with an error and counted
(``malformed``, ``too_large``, ``timeout``); an unexpected exception in a
handler is reported as a background error (:mod:`cachefs.background`) and
answered "internal error"; a client that has gone is simply forgotten. Only
cancellation ends :meth:`ControlServer.serve`.

Concurrency: everything runs on the trio thread; each connection is a task in
the server's own nursery.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from cachefs import metrics
from cachefs.background import contained, report
from cachefs.control.client import WARM_PARALLEL_MAX
from cachefs.control.warm import Warmer, WarmProgress
from cachefs.errors import CachefsError
from cachefs.read.hints import ReadOrder

log = logging.getLogger(__name__)

MAX_LINE = 1 << 20
LINE_TIMEOUT = 10.0
SEND_TIMEOUT = 30.0
MAX_CONNECTIONS = 16
MAX_WAITING = 64
CONNECT_WAIT = 2.0
MAX_PENDING_BYTES = 512 << 20
PATH_OVERHEAD = 64
REJECT_LOG_INTERVAL = 60.0

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class RequestError(Exception):
    """A request the server refuses; ``reason`` is the label counted in
    ``cachefs_control_rejected_total``."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


class _ClientGone(Exception):
    """The client closed its end, or did not read its replies in time."""


class ControlServer:
    """Serves the control socket at ``path``; hints go to ``read_order``, warm requests to
    ``warmer``. Paths in requests are relative to ``root_prefix`` (the mount's prefix).
    ``allowed_uids`` defaults to root and the daemon's uid."""

    def __init__(self, path: Path, *, read_order: ReadOrder, warmer: Warmer, root_prefix: str,
                 allowed_uids: frozenset[int] | None = None) -> None:
        self.path = path
        self.read_order = read_order
        self.warmer = warmer
        self.root_prefix = root_prefix
        self.allowed_uids = (frozenset({0, os.geteuid()}) if allowed_uids is None
                             else allowed_uids)
        self._slots = trio.Semaphore(MAX_CONNECTIONS)
        self._waiting = 0
        self.pending_bytes = 0  # accounted bytes of chunked paths, all connections
        self._last_reject_log = 0.0
        self._rejects_unlogged = 0
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket's file

    # -- the listener ----------------------------------------------------------------
    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        try:
            sock = self._bind()
        except OSError as exc:  # the mount serves reads without it
            report("control", exc, f"creating the control socket {self.path} (no warm, hints "
                   "or status requests for this mount)")
            task_status.started()
            return
        listener = trio.SocketListener(sock)
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    try:
                        stream = await listener.accept()
                    except OSError as exc:  # EMFILE and the like: wait, do not spin
                        log.warning("control socket: accept failed: %s", exc)
                        await trio.sleep(0.5)
                        continue
                    if self._waiting >= MAX_WAITING and self._slots.value == 0:
                        self._reject("busy", "too many connections waiting")
                        nursery.start_soon(self._refuse, stream, "too many connections")
                        continue
                    nursery.start_soon(self._connection, stream)
        finally:
            # Before the close: aclose() is a checkpoint, which raises again at once in
            # the cancelled scope a shutdown ends this in, and the socket file would stay.
            self.withdraw()
            await listener.aclose()

    def withdraw(self) -> None:
        """Remove the socket's file if it is still the one this server bound (a new mount
        at the same mount point, made after this one's was detached, binds its own there):
        connections made stay served, no new one can reach this server. The trio thread (a
        stat and an unlink in the runtime directory, as the listener's own end does)."""
        if self._bound is None:
            return
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._bound:
                self.path.unlink()
        except OSError:
            pass
        self._bound = None

    def _bind(self) -> trio.socket.SocketType:
        """Bind in a private directory, restrict the socket to its owner, then rename it
        into place: it is never reachable with wider modes."""
        parent = self.path.parent
        parent.mkdir(parents=True, exist_ok=True)
        private = Path(tempfile.mkdtemp(prefix=".bind-", dir=parent))  # mode 0700
        staged = private / "s"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(staged))  # a local bind never blocks
            os.chmod(staged, 0o600)
            st = os.stat(staged)
            os.replace(staged, self.path)
            self._bound = (st.st_dev, st.st_ino)  # (a rename keeps the inode)
            sock.listen(MAX_WAITING)
        except BaseException:
            sock.close()
            raise
        finally:
            try:
                staged.unlink()
            except FileNotFoundError:
                pass
            private.rmdir()
        return trio.socket.from_stdlib_socket(sock)

    async def _refuse(self, stream: trio.SocketStream, message: str) -> None:
        with contained("control", "refusing a connection"):
            async with stream:
                await _try_send(stream, {"event": "error", "message": message})

    def _reject(self, reason: str, detail: str) -> None:
        """Count a refusal; log it (at most once a minute, with the count since)."""
        metrics.CONTROL_REJECTED.labels(reason).inc()
        now = time.monotonic()
        if now - self._last_reject_log < REJECT_LOG_INTERVAL and self._last_reject_log:
            self._rejects_unlogged += 1
            return
        more = (f" ({self._rejects_unlogged} more refusals since the last report)"
                if self._rejects_unlogged else "")
        self._last_reject_log, self._rejects_unlogged = now, 0
        log.warning("control socket: refused a request (%s): %s%s", reason, detail, more)

    # -- one connection ------------------------------------------------------------------
    async def _connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            with contained("control", "serving a control-socket connection"):
                uid, pid = _peer(stream)
                if uid not in self.allowed_uids:
                    self._reject("peer", f"uid {uid} (pid {pid}) is neither root nor the "
                                 "mounting user")
                    await _try_send(stream, {"event": "error", "message": "permission denied: "
                                             "only root and the mounting user may use this "
                                             "socket"})
                    return
                got_slot = False
                self._waiting += 1
                try:
                    with trio.move_on_after(CONNECT_WAIT):
                        await self._slots.acquire()
                        got_slot = True
                finally:
                    self._waiting -= 1
                if not got_slot:
                    self._reject("busy", f"{MAX_CONNECTIONS} connections are being served")
                    await _try_send(stream, {"event": "error", "message": "busy: too many "
                                             "control connections, try again"})
                    return
                metrics.CONTROL_CONNECTIONS.inc()
                try:
                    await self._serve_requests(stream)
                finally:
                    metrics.CONTROL_CONNECTIONS.dec()
                    self._slots.release()

    async def _serve_requests(self, stream: trio.SocketStream) -> None:
        reader = _LineReader(stream)
        pending: dict[str, list[str]] = {}
        pending_bytes = 0
        try:
            while True:
                try:
                    request = await reader.request()
                    if request is None:
                        return  # the client closed the connection between requests
                    op, paths, append = _validate(request)
                    if append:
                        cost = sum(len(p.encode("utf-8", "surrogateescape")) + PATH_OVERHEAD
                                   for p in paths)
                        if self.pending_bytes + cost > MAX_PENDING_BYTES:
                            raise RequestError(f"too many paths pending (more than "
                                               f"{MAX_PENDING_BYTES >> 20} MiB of paths in "
                                               "chunked requests)", "too_large")
                        self.pending_bytes += cost
                        pending_bytes += cost
                        pending.setdefault(op, []).extend(paths)
                        await _send(stream, {"event": "ok", "pending": len(pending[op])})
                        continue
                    if pending.get(op):
                        paths = pending.pop(op) + paths
                    await self._dispatch(op, request, paths, stream)
                    return
                except RequestError as exc:
                    self._reject(exc.reason, str(exc))
                    await _try_send(stream, {"event": "error", "message": str(exc)})
                    return
                except _ClientGone:
                    raise
                except Exception as exc:  # a bug: reported, answered, the server goes on
                    report("control", exc, "serving a control request")
                    await _try_send(stream, {"event": "error", "message":
                                             f"internal error ({type(exc).__name__}); see the "
                                             "cachefs log"})
                    return
        except _ClientGone:
            return
        finally:
            self.pending_bytes -= pending_bytes

    async def _dispatch(self, op: str, request: dict[str, Any], paths: list[str],
                        stream: trio.SocketStream) -> None:
        if op == "status":
            await _send(stream, {"event": "status", "stats": metrics.totals(),
                                 "hint_pending": self.read_order.pending})
        elif op == "hint":
            root = self.root_prefix
            accepted = self.read_order.set_order([root + p.strip("/") for p in paths])
            await _send(stream, {"event": "ok", "accepted": accepted})
        elif op == "warm":
            parallel = request.get("parallel", 16)
            if isinstance(parallel, bool) or not isinstance(parallel, int):
                raise RequestError("'parallel' must be an integer")
            if not 1 <= parallel <= WARM_PARALLEL_MAX:
                raise RequestError(f"'parallel' must be between 1 and {WARM_PARALLEL_MAX}")
            check = request.get("check", False)
            if not isinstance(check, bool):
                raise RequestError("'check' must be true or false")

            client_gone = False

            shard = request.get("shard")
            if shard is not None and (
                    not isinstance(shard, list) or len(shard) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in shard)
                    or not 0 <= shard[0] < shard[1]):
                raise RequestError("'shard' must be [I, N] with 0 <= I < N")

            with trio.CancelScope() as job:
                async def progress(state: WarmProgress) -> None:
                    nonlocal client_gone
                    try:
                        await _send(stream, {"event": "progress", **state.as_dict()})
                    except _ClientGone:  # Ctrl-C on 'cachefs warm': the job ends with it
                        client_gone = True
                        job.cancel()

                # Passed only when asked: the protocol change stays one optional field.
                cluster: dict[str, Any] = {} if shard is None else {
                    "shard": (shard[0], shard[1])}
                try:
                    result = await self.warmer.warm(paths or [""], parallel=parallel,
                                                    check=check, on_progress=progress, **cluster)
                except CachefsError as exc:  # a shard asked of a mount without a tier
                    raise RequestError(str(exc)) from None
            if client_gone:
                raise _ClientGone()
            await _send(stream, {"event": "done", **result.as_dict()})


OPS = ("status", "hint", "warm")


def _validate(request: Any) -> tuple[str, list[str], bool]:
    """(op, paths, append) of a well-formed request; RequestError otherwise."""
    if not isinstance(request, dict):
        raise RequestError("a request must be a JSON object")
    op = request.get("op")
    if op not in OPS:
        shown = op if isinstance(op, str) and len(op) <= 40 else type(op).__name__
        raise RequestError(f"unknown op {shown!r} (expected one of {', '.join(OPS)})")
    paths = request.get("paths", [])
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise RequestError(f"{op}: 'paths' must be a list of strings")
    append = request.get("append", False)
    if not isinstance(append, bool):
        raise RequestError("'append' must be true or false")
    if append and op == "status":
        raise RequestError("status takes no paths")
    return op, paths, append


class _LineReader:
    """JSON request lines from a stream, each at most MAX_LINE bytes and received within
    LINE_TIMEOUT; bytes after a line are kept for the next request."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._buf = bytearray()
        self._scanned = 0

    async def request(self) -> Any:
        """The next request (parsed JSON), or None at a clean end of the stream."""
        with trio.move_on_after(LINE_TIMEOUT) as scope:
            line = await self._line()
        if scope.cancelled_caught:
            raise RequestError(f"no complete request line within {LINE_TIMEOUT:.0f}s",
                               "timeout")
        if line is None:
            return None
        try:
            return json.loads(line)
        except (ValueError, RecursionError) as exc:  # RecursionError: [[[[...]]]]
            raise RequestError(f"request is not JSON: {str(exc)[:200]}") from None

    async def _line(self) -> bytes | None:
        while True:
            end = self._buf.find(b"\n", self._scanned)
            if end >= 0:
                line = bytes(self._buf[:end])
                del self._buf[:end + 1]
                self._scanned = 0
                if len(line) > MAX_LINE:
                    raise RequestError(f"request line longer than {MAX_LINE >> 20} MiB "
                                       "(send long path lists in chunks with \"append\")",
                                       "too_large")
                return line
            self._scanned = len(self._buf)
            if len(self._buf) > MAX_LINE:
                raise RequestError(f"request line longer than {MAX_LINE >> 20} MiB (send long "
                                   "path lists in chunks with \"append\")", "too_large")
            try:
                chunk = await self._stream.receive_some(64 << 10)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise _ClientGone() from None
            if not chunk:
                if self._buf.strip():
                    raise RequestError("the connection ended in the middle of a request")
                return None
            self._buf += chunk


def _peer(stream: trio.SocketStream) -> tuple[int, int]:
    """(uid, pid) of the process at the other end (SO_PEERCRED: fixed at connect time)."""
    raw = stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, _gid = _PEERCRED.unpack(raw)
    return uid, pid


async def _try_send(stream: trio.SocketStream, message: dict[str, Any]) -> None:
    """Send a final answer if the client still listens (waits at most a second)."""
    with trio.move_on_after(1.0):
        try:
            await stream.send_all(json.dumps(message).encode() + b"\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


async def _send(stream: trio.SocketStream, message: dict[str, Any]) -> None:
    """Send one JSON line; _ClientGone when the client has gone or does not read."""
    try:
        with trio.fail_after(SEND_TIMEOUT):
            await stream.send_all(json.dumps(message).encode() + b"\n")
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        raise _ClientGone() from None
    except trio.TooSlowError:
        metrics.CONTROL_REJECTED.labels("timeout").inc()
        raise _ClientGone() from None

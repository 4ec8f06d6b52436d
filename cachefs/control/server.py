"""The daemon's control socket: warm, read-order hints and status for local clients.

Protocol: a client connects to the AF_UNIX stream socket
(``registry.control_socket(mountpoint)``), sends one JSON object on one line,
and reads JSON lines until the server closes the connection. Requests:

* ``{"op": "status"}`` -> ``{"event": "status", ...}``
* ``{"op": "hint", "paths": [relative paths in read order]}``
  -> ``{"event": "ok", "accepted": N, "unknown": M}``
* ``{"op": "warm", "paths": [...], "parallel": N, "check": false}``
  -> ``{"event": "progress", ...}`` every half second, then ``{"event": "done", ...}``;
  an optional ``"shard": [I, N]`` warms only node I's share into the shared tier
* anything else -> ``{"event": "error", "message": "..."}``

Paths are relative to the mount root. Each connection is served by its own
task in the server's nursery; a request line may be at most
``MAX_REQUEST`` bytes (a hint for millions of files fits).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import trio

from cachefs import metrics
from cachefs.control.warm import Warmer, WarmProgress
from cachefs.errors import CachefsError
from cachefs.read.hints import ReadOrder

log = logging.getLogger(__name__)

MAX_REQUEST = 512 << 20


class ControlServer:
    """Serves the control socket at ``path``; hints go to ``read_order``, warm requests to
    ``warmer``. Paths in requests are relative to ``root_prefix`` (the mount's prefix)."""

    def __init__(self, path: Path, *, read_order: ReadOrder, warmer: Warmer, root_prefix: str,
                 allow_other: bool) -> None:
        self.path = path
        self.read_order = read_order
        self.warmer = warmer
        self.root_prefix = root_prefix
        self.allow_other = allow_other

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await sock.bind(str(self.path))
        os.chmod(self.path, 0o666 if self.allow_other else 0o600)
        sock.listen(16)
        listener = trio.SocketListener(sock)
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                await trio.serve_listeners(self._handle, [listener], handler_nursery=nursery)
        finally:
            try:
                self.path.unlink()
            except OSError:
                pass

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                request = await _read_request(stream)
                await self._dispatch(request, stream)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away (e.g. Ctrl-C on cachefs warm)
            except ValueError as exc:
                await _send(stream, {"event": "error", "message": str(exc)})
            except Exception as exc:  # never let a client take the daemon down
                log.exception("control request failed")
                try:
                    await _send(stream, {"event": "error", "message": f"internal error: {exc}"})
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

    async def _dispatch(self, request: dict[str, Any], stream: trio.SocketStream) -> None:
        op = request.get("op")
        if op == "status":
            await _send(stream, {"event": "status", "stats": metrics.totals(),
                                 "hint_pending": self.read_order.pending})
        elif op == "hint":
            paths = request.get("paths")
            if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
                raise ValueError("hint needs 'paths': a list of strings")
            root = self.root_prefix
            keys = [root + p.strip("/") for p in paths]
            accepted = self.read_order.set_order(keys)
            await _send(stream, {"event": "ok", "accepted": accepted})
        elif op == "warm":
            paths = request.get("paths") or [""]
            if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
                raise ValueError("warm needs 'paths': a list of strings")
            parallel = int(request.get("parallel", 16))
            if not 1 <= parallel <= 1024:
                raise ValueError("parallel must be between 1 and 1024")

            async def report(progress: WarmProgress) -> None:
                await _send(stream, {"event": "progress", **progress.as_dict()})

            shard = request.get("shard")
            if shard is not None:
                if (not isinstance(shard, list) or len(shard) != 2
                        or not all(isinstance(x, int) and not isinstance(x, bool) for x in shard)
                        or not 0 <= shard[0] < shard[1]):
                    raise ValueError("shard must be [I, N] with 0 <= I < N")
            try:
                result = await self.warmer.warm(
                    paths, parallel=parallel, check=bool(request.get("check")),
                    on_progress=report, shard=None if shard is None else (shard[0], shard[1]))
            except CachefsError as exc:
                raise ValueError(str(exc)) from None
            await _send(stream, {"event": "done", **result.as_dict()})
        else:
            raise ValueError(f"unknown op {op!r}")


async def _read_request(stream: trio.SocketStream) -> dict[str, Any]:
    buf = bytearray()
    while b"\n" not in buf:
        chunk = await stream.receive_some(1 << 20)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_REQUEST:
            raise ValueError("request too large")
    try:
        request = json.loads(bytes(buf).split(b"\n", 1)[0])
    except json.JSONDecodeError as exc:
        raise ValueError(f"request is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise ValueError("request must be a JSON object")
    return request


async def _send(stream: trio.SocketStream, message: dict[str, Any]) -> None:
    await stream.send_all(json.dumps(message).encode() + b"\n")

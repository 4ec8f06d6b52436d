"""Client side of the control socket (used by ``cachefs warm`` and ``cachefs.torch``).

Blocking and dependency-free so it can run inside DataLoader processes. Long
path lists are sent in chunks of at most :data:`CHUNK_BYTES` per request line
(``"append": true`` requests, each answered before the next is sent; see
:mod:`cachefs.control.server` for the protocol), so a hint of a million files
never needs a line longer than the server accepts, and paths may come from a
generator without being held in a list.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from cachefs.control import registry
from cachefs.errors import CachefsError

#: The most files a warm request loads at once (``--parallel``; the daemon refuses more).
WARM_PARALLEL_MAX = 1024

#: Bytes of JSON-encoded paths per request line (the server accepts lines up to 1 MiB).
CHUNK_BYTES = 256 << 10


class NotACachefsPath(CachefsError):
    pass


@functools.lru_cache(maxsize=4096)
def _real_dir(directory: str) -> str:
    """A directory's path with symbolic links resolved (a hint of a million files in a few
    thousand folders resolves each folder once)."""
    return os.path.realpath(directory)


def _inside(path: Path, mountpoint: Path) -> bool:
    return path == mountpoint or mountpoint in path.parents


def _real(path: Path, mountpoint: Path | None = None) -> Path:
    """``path`` (absolute) with symbolic links resolved: its folder's, then its own unless
    that folder is inside ``mountpoint`` (a cachefs mount has no links)."""
    folder = Path(_real_dir(str(path.parent)))
    if mountpoint is not None and _inside(folder, mountpoint):
        return folder / path.name
    return Path(os.path.realpath(path))


def find_mount(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """The (mountpoint, control socket) of the live cachefs mount holding ``path``, also
    through symbolic links (``/data`` -> the mount)."""
    written = Path(os.path.abspath(path))
    mounts = [Path(mp) for mp in registry.cachefs_mounts()]
    best: Path | None = None
    for target in (written, None):
        if target is None:  # as written it is in no mount: the links it goes through?
            target = _real(written)
        for m in mounts:
            if _inside(target, m) and (best is None or len(str(m)) > len(str(best))):
                best = m
        if best is not None:
            break
    if best is None:
        raise NotACachefsPath(f"{written} is not inside a cachefs mount")
    sock = registry.control_socket(best)
    if not sock.exists():
        raise NotACachefsPath(f"the cachefs daemon of {best} has no control socket (is it "
                              "running on this node?)")
    return best, sock


def chunks(paths: Iterable[str], limit: int = CHUNK_BYTES) -> Iterator[list[str]]:
    """``paths`` in lists whose JSON encoding stays under ``limit`` bytes (at least one
    list, possibly empty)."""
    chunk: list[str] = []
    size = 0
    for p in paths:
        n = len(json.dumps(p)) + 2
        if n > limit:
            raise CachefsError(f"path too long for the control socket: {p[:80]!r}...")
        if chunk and size + n > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += n
    yield chunk


def request(sock_path: Path, message: dict[str, Any], timeout: float | None = 60.0
            ) -> Iterator[dict[str, Any]]:
    """Send one request (its ``paths``, if any, in chunks); yield every JSON line of the
    answer. Raises CachefsError with the daemon's message when it refuses."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            _connect(sock, sock_path)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM):
                raise CachefsError(f"cannot reach the cachefs daemon at {sock_path}: only root "
                                   "and the user who mounted it may use its control socket"
                                   ) from None
            raise CachefsError(f"cannot reach the cachefs daemon at {sock_path}: "
                               f"{exc.strerror}") from None
        with sock.makefile("rb") as replies:
            try:
                final = message
                if "paths" in message:
                    parts = chunks(message["paths"])
                    part = next(parts)
                    for following in parts:
                        _send(sock, {"op": message["op"], "paths": part, "append": True})
                        _reply(replies)
                        part = following
                    final = dict(message, paths=part)
                _send(sock, final)
                while True:
                    reply = _reply(replies, final=True)
                    if reply is None:
                        return
                    yield reply
            except TimeoutError:
                raise CachefsError(f"the cachefs daemon at {sock_path} did not answer within "
                                   f"{timeout:.0f}s (stopped or hung? see its log)") from None
            except (BrokenPipeError, ConnectionResetError):
                reason = _reply_after_close(replies)
                raise CachefsError("the cachefs daemon closed the connection"
                                   + (f": {reason}" if reason else "")) from None


def _connect(sock: socket.socket, path: Path) -> None:
    """Connect; a full listen backlog (EAGAIN: the daemon is busy accepting) is retried
    for a few seconds."""
    for attempt in range(40):
        try:
            sock.connect(str(path))
            return
        except BlockingIOError:
            if attempt == 39:
                raise
            time.sleep(0.05 * (1 + attempt // 10))


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _reply(replies: BinaryIO, final: bool = False) -> dict[str, Any] | None:
    line = replies.readline()
    if not line:
        if final:
            return None
        raise CachefsError("the cachefs daemon closed the connection without an answer")
    try:
        reply = json.loads(line)
    except ValueError:
        raise CachefsError("the cachefs daemon sent an answer that is not JSON") from None
    if not isinstance(reply, dict):
        raise CachefsError("the cachefs daemon sent an answer that is not a JSON object")
    if reply.get("event") == "error":
        raise CachefsError(f"cachefs daemon: {reply.get('message')}")
    return reply


def _reply_after_close(replies: BinaryIO) -> str:
    """The error the daemon sent before closing, if it can still be read."""
    try:
        line = replies.readline()
        return str(json.loads(line).get("message", "")) if line else ""
    except (OSError, ValueError, AttributeError):
        return ""


def mount_path(path: str | os.PathLike[str], mountpoint: Path) -> Path:
    """``path`` (absolute) as it lies in ``mountpoint``: as written, else with the symbolic
    links it goes through resolved (which may leave it outside)."""
    ap = Path(os.path.abspath(path))
    return ap if _inside(ap, mountpoint) else _real(ap, mountpoint)


def relative_path(mountpoint: Path, path: str) -> str:
    ap = mount_path(path, mountpoint)
    if ap == mountpoint:
        return ""
    if mountpoint not in ap.parents:
        raise NotACachefsPath(f"{path} is not inside the cachefs mount {mountpoint}")
    return str(ap.relative_to(mountpoint))


def relative_paths(mountpoint: Path, paths: Iterable[str]) -> list[str]:
    return [relative_path(mountpoint, p) for p in paths]


def send_hint(paths: Iterable[str]) -> int:
    """Tell the daemon serving ``paths`` the order they will be read in (sent in chunks;
    ``paths`` may be a generator). Returns the count accepted. All paths must be under one
    mount."""
    it = iter(paths)
    first = next(it, None)
    if first is None:
        return 0
    mountpoint, sock = find_mount(first)

    def rel() -> Iterator[str]:
        yield relative_path(mountpoint, first)
        for p in it:
            yield relative_path(mountpoint, p)

    for reply in request(sock, {"op": "hint", "paths": rel()}):
        return int(reply.get("accepted", 0))
    return 0

"""Client side of the control socket (used by ``cachefs warm`` and ``cachefs.torch``).

Blocking and dependency-free so it can run inside DataLoader processes.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cachefs.control import registry
from cachefs.errors import CachefsError


class NotACachefsPath(CachefsError):
    pass


def find_mount(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """The (mountpoint, control socket) of the live cachefs mount holding ``path``."""
    target = Path(os.path.abspath(path))
    best: Path | None = None
    for mp in registry.cachefs_mounts():
        m = Path(mp)
        if (target == m or m in target.parents) and (best is None or len(str(m)) > len(str(best))):
            best = m
    if best is None:
        raise NotACachefsPath(f"{target} is not inside a cachefs mount")
    sock = registry.control_socket(best)
    if not sock.exists():
        raise NotACachefsPath(f"the cachefs daemon of {best} has no control socket (is it "
                              "running on this node?)")
    return best, sock


def request(sock_path: Path, message: dict[str, Any], timeout: float | None = 60.0
            ) -> Iterator[dict[str, Any]]:
    """Send one request; yield every JSON line of the answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(sock_path))
        except OSError as exc:
            raise CachefsError(f"cannot reach the cachefs daemon at {sock_path}: "
                               f"{exc.strerror}") from None
        sock.sendall(json.dumps(message).encode() + b"\n")
        with sock.makefile("rb") as f:
            for line in f:
                reply = json.loads(line)
                if reply.get("event") == "error":
                    raise CachefsError(f"cachefs daemon: {reply.get('message')}")
                yield reply


def relative_paths(mountpoint: Path, paths: list[str]) -> list[str]:
    out = []
    for p in paths:
        ap = Path(os.path.abspath(p))
        if ap != mountpoint and mountpoint not in ap.parents:
            raise NotACachefsPath(f"{p} is not inside the cachefs mount {mountpoint}")
        out.append(str(ap.relative_to(mountpoint)) if ap != mountpoint else "")
    return out


def send_hint(paths: list[str]) -> int:
    """Tell the daemon serving ``paths`` the order they will be read in. Returns the count
    accepted. All paths must be under one mount."""
    if not paths:
        return 0
    mountpoint, sock = find_mount(paths[0])
    rel = relative_paths(mountpoint, paths)
    for reply in request(sock, {"op": "hint", "paths": rel}):
        return int(reply.get("accepted", 0))
    return 0

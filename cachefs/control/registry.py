"""The node-local registry of running cachefs mounts.

Each daemon writes ``RUNTIME_DIR/<id>.json`` (pid, mount point, source, cache
dir, metrics address, start time) once its mount is live and removes it at
exit. ``cachefs unmount`` and ``cachefs status`` read it; entries whose
process is gone are ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

#: mountinfo types of a cachefs mount (pyfuse3 mounts with subtype=cachefs).
FS_TYPES = ("fuse.cachefs", "cachefs")


def runtime_dir() -> Path:
    if os.geteuid() == 0:
        return Path(os.environ.get("CACHEFS_RUNTIME_DIR", "/run/cachefs"))
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/cachefs-{os.geteuid()}"
    return Path(os.environ.get("CACHEFS_RUNTIME_DIR", os.path.join(base, "cachefs")))


def _entry_path(mountpoint: Path) -> Path:
    digest = hashlib.sha1(str(mountpoint).encode()).hexdigest()[:16]
    return runtime_dir() / f"{digest}.json"


def control_socket(mountpoint: Path) -> Path:
    """The daemon's control socket (warm, hints, status); short enough for AF_UNIX."""
    return _entry_path(mountpoint).with_suffix(".sock")


def register(mountpoint: Path, info: dict[str, Any]) -> None:
    path = _entry_path(mountpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)


def unregister(mountpoint: Path) -> None:
    try:
        _entry_path(mountpoint).unlink()
    except FileNotFoundError:
        pass


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped by its parent,
    does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


def entry(mountpoint: Path) -> dict[str, Any] | None:
    """The registry entry of ``mountpoint`` as written, even if its daemon is gone
    (a daemon killed with SIGKILL leaves its entry behind)."""
    try:
        info = json.loads(_entry_path(mountpoint).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def lookup(mountpoint: Path) -> dict[str, Any] | None:
    """The entry of ``mountpoint`` if its daemon is running."""
    info = entry(mountpoint)
    if info is None:
        return None
    return info if pid_alive(int(info.get("pid", 0))) else None


def all_mounts() -> list[dict[str, Any]]:
    result = []
    try:
        files = sorted(runtime_dir().glob("*.json"))
    except OSError:
        return []
    for f in files:
        try:
            info = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if pid_alive(int(info.get("pid", 0))):
            result.append(info)
    return result


def cachefs_mounts() -> dict[str, str]:
    """Mount points of cachefs file systems from /proc/self/mountinfo -> fs type."""
    mounts: dict[str, str] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                fstype = right.split()[0] if right else ""
                if fstype in FS_TYPES:
                    mounts[_unescape(fields[4])] = fstype
    except OSError:
        pass
    return mounts


def mount_device(mountpoint: Path) -> str | None:
    """``major:minor`` of the file system mounted at ``mountpoint`` (from mountinfo)."""
    found = _top_mount(mountpoint)
    return None if found is None else found[0]


def mount_type(mountpoint: Path) -> str | None:
    """File system type of the top-most mount at exactly ``mountpoint`` (``fuse.cachefs``,
    ``tmpfs``...), or None when nothing is mounted there. Reads only mountinfo: a stat of a
    mount point whose FUSE daemon died may fail (ENOTCONN) or succeed from cached attributes,
    so it cannot tell."""
    found = _top_mount(mountpoint)
    return None if found is None else found[1]


def _top_mount(mountpoint: Path) -> tuple[str, str] | None:
    found = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) > 4 and _unescape(fields[4]) == str(mountpoint):
                    # the last match is the top-most mount
                    found = (fields[2], right.split()[0] if right else "")
    except OSError:
        return None
    return found


def _unescape(path: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and path[i + 1:i + 4].isdigit() and len(path[i + 1:i + 4]) == 3:
            out.append(chr(int(path[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)

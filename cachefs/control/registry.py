"""The node-local registry of running cachefs mounts.

Each daemon writes ``RUNTIME_DIR/<id>.json`` (pid, mount point, source, cache
dir, metrics address, start time) once its mount is live and removes it at
exit. ``cachefs unmount`` and ``cachefs status`` read it; entries whose
process is gone are ignored.

A daemon whose mount was detached (``umount -l`` while files are open: it runs on
until they are closed) gives its mount point's entry up -- a new mount there makes it
its own -- and keeps ``RUNTIME_DIR/<pid>.detached`` instead (the same fields, its
former mount point, ``detached_at``, the process's start time), rewritten with each of
its snapshots and removed at its exit: ``cachefs status`` lists it, so an operator can
see which process holds the cache directory and its files. Each file is written by its
daemon only (a worker thread, under the daemon's registry lock) and replaced whole, so
a reader sees the old or the new entry, never a torn one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: mountinfo types of a cachefs mount (pyfuse3 mounts with subtype=cachefs).
FS_TYPES = ("fuse.cachefs", "cachefs")


def runtime_dir() -> Path:
    if os.geteuid() == 0:
        return Path(os.environ.get("CACHEFS_RUNTIME_DIR", "/run/cachefs"))
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/cachefs-{os.geteuid()}"
    return Path(os.environ.get("CACHEFS_RUNTIME_DIR", os.path.join(base, "cachefs")))


class UnsafeRuntimeDir(Exception):
    """Another local user could replace what cachefs keeps in the runtime directory;
    ``str()`` is the one-line reason (the mount turns it into a ConfigError)."""


def _unsafe(path: Path, st: os.stat_result, *, leaf: bool, leaf_modes: bool) -> str | None:
    euid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        return None if st.st_uid in (0, euid) else (
            f"{path} is a symbolic link of uid {st.st_uid}, another user")
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != euid and (leaf or st.st_uid != 0):
        return f"{path} belongs to uid {st.st_uid}, another user"
    if st.st_mode & 0o022 and (leaf_modes if leaf else not st.st_mode & stat.S_ISVTX):
        return f"{path} can be written by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def unsafe_reason(path: Path, *, leaf_modes: bool = True) -> str | None:
    """Why another local user could replace the directory ``path`` or what it holds, or
    None. ``path`` must belong to this user, its ancestors to root or this user (both as
    written and with links resolved), and no ancestor that others may write to may lack
    the sticky bit (/tmp: others cannot rename or remove our entries there); with
    ``leaf_modes``, others may not write to ``path`` itself either. OSError if it is not
    there."""
    path = path.absolute()
    for lexical in (path, Path(os.path.realpath(path))):
        for d in (*reversed(lexical.parents), lexical):
            problem = _unsafe(d, os.lstat(d), leaf=d == lexical, leaf_modes=leaf_modes)
            if problem:
                return problem
    return None


def make_dirs(path: Path, mode: int, *, parent_mode: int = 0o755) -> None:
    """``path`` and its missing parents, none open to other users' writes whatever the
    umask (``Path.mkdir(parents=True)`` makes the parents 0777 under umask 0)."""
    for d in (*reversed(path.parents), path):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, mode if d == path else parent_mode)


def ensure_runtime_dir() -> Path:
    """The runtime directory, created if missing, once it is known that no other local user
    can replace what cachefs keeps there (the registry, mount locks, control sockets): a
    user without XDG_RUNTIME_DIR has it under /tmp, where anyone can make the name first
    and plant links that the daemon's writes would follow. Raises UnsafeRuntimeDir if
    one could, OSError if the directory cannot be made."""
    path = runtime_dir().absolute()
    fallback = os.geteuid() != 0 and not os.environ.get("CACHEFS_RUNTIME_DIR") and \
        not os.environ.get("XDG_RUNTIME_DIR")
    with contextlib.suppress(OSError):  # (refused below if it matters)
        make_dirs(path, 0o700 if fallback else 0o755, parent_mode=0o700 if fallback else 0o755)
    problem = unsafe_reason(path)  # (OSError: it could not be made)
    if problem:
        raise UnsafeRuntimeDir(
            f"refusing runtime directory {path}: {problem}, who could replace the mount's "
            "lock, registry entry and control socket (set XDG_RUNTIME_DIR or "
            "CACHEFS_RUNTIME_DIR to a directory of your own)")
    return path


def _entry_path(mountpoint: Path) -> Path:
    digest = hashlib.sha1(str(mountpoint).encode()).hexdigest()[:16]
    return runtime_dir() / f"{digest}.json"


def control_socket(mountpoint: Path) -> Path:
    """The daemon's control socket (warm, hints, status); short enough for AF_UNIX."""
    return _entry_path(mountpoint).with_suffix(".sock")


def register(mountpoint: Path, info: dict[str, Any]) -> None:
    ensure_runtime_dir()
    path = _entry_path(mountpoint)
    tmp = path.with_suffix(".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # (left by a daemon killed mid-write; never written through)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(info))
    os.replace(tmp, path)


def unregister(mountpoint: Path, pid: int | None = None) -> None:
    """Remove the entry of ``mountpoint``; with ``pid``, only while it is that daemon's:
    a daemon whose mount was detached (``umount -l``) runs on until its files are closed,
    and a new mount at the same mount point has made the entry its own meanwhile. (Between
    the read and the removal a new daemon's first entry could still go: it writes one again
    with its next snapshot, within ``STATUS_IDLE_INTERVAL``.)"""
    path = _entry_path(mountpoint)
    if pid is not None:
        info = entry(mountpoint)
        if info is None or info.get("pid") != pid:
            return
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _detached_path(pid: int) -> Path:
    return runtime_dir() / f"{pid}.detached"


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat field 22), or
    None if it is not there: with the pid, what names one process (a pid is reused)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def register_detached(info: dict[str, Any]) -> None:
    """Write (or rewrite) the detached daemon's entry ``info`` (its ``pid`` names it)."""
    ensure_runtime_dir()
    path = _detached_path(int(info["pid"]))
    tmp = path.with_suffix(".detached-tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(info))
    os.replace(tmp, path)


def unregister_detached(pid: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        _detached_path(pid).unlink()


def detached_daemons() -> list[dict[str, Any]]:
    """The entries of daemons that run on after their mount was detached (lazy unmount),
    oldest first. An entry whose process is gone (killed while detached) or whose pid now
    names another process (its start time differs) is removed."""
    found = []
    for f, info, pid in _entries("*.detached"):
        if not pid_alive(pid) or process_start(pid) != info.get("process_start"):
            with contextlib.suppress(OSError):
                f.unlink()  # (its daemon was killed: nothing else removes it)
            continue
        found.append(info)
    found.sort(key=lambda i: float(i.get("detached_at", 0)))
    return found


def _entries(pattern: str) -> Iterator[tuple[Path, dict[str, Any], int]]:
    """The registry's files matching ``pattern``, in name order, with what each holds
    and its daemon's pid; files that are not an entry (junk, gone meanwhile) skipped."""
    try:
        files = sorted(runtime_dir().glob(pattern))
    except OSError:
        return
    for f in files:
        try:
            info = json.loads(f.read_text())
            pid = int(info.get("pid", 0))
        except (OSError, ValueError, TypeError, AttributeError):  # (junk: not an entry)
            continue
        yield f, info, pid


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


def is_daemon(pid: int) -> bool:
    """Whether process ``pid`` runs and is a cachefs daemon (``... cachefs mount ...``): a
    registry entry's pid may name another process by now (reused, or seen from another
    pid namespace: a container's pid 1)."""
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return True  # (not ours to read: trust the registry)
    return b"mount" in argv and any(a.endswith(b"cachefs") or a == b"cachefs.__main__"
                                    for a in argv)


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
    """The entries whose daemon's pid is alive (it may name another process by now, or a
    process of another pid namespace: ``cachefs status`` looks closer)."""
    return [info for _, info, pid in _entries("*.json") if pid_alive(pid)]


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


def as_mounted(path: str | os.PathLike[str]) -> Path:
    """``path`` (made absolute) as the mount table names a cachefs mount: as written, else
    through the symbolic links it is (``/data`` -> the mount point), else as written. The
    mount's own root is never looked at (a hung daemon would hang the look)."""
    written = Path(os.path.abspath(path))
    mounts = cachefs_mounts()
    p = written
    for _ in range(40):  # (the kernel's own bound on links in a row)
        if str(p) in mounts:
            return p
        p = Path(os.path.realpath(p.parent)) / p.name  # (links in the folders)
        if str(p) in mounts:
            return p
        try:
            target = os.readlink(p)
        except OSError:  # not a link
            break
        p = Path(os.path.abspath(os.path.join(p.parent, target)))
    return written


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


def mounts_under(mountpoint: Path) -> list[str]:
    """Mount points strictly below ``mountpoint`` (from mountinfo, any file system type):
    each makes an unmount of ``mountpoint`` busy."""
    inside = str(mountpoint).rstrip("/") + "/"
    found: list[str] = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4:
                    path = _unescape(fields[4])
                    if path.startswith(inside) and path not in found:
                        found.append(path)
    except OSError:
        pass
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

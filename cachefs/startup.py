"""Start-up checks of the two local paths: the mount point and the cache directory.

Mount point (:func:`check_mountpoint`): it must exist, be an empty directory
and hold no mount, with one exception: a *dead cachefs mount*, left behind
when a daemon was killed (SIGKILL, OOM killer). Readers of such a mount get
ENOTCONN, and without this check every restart would fail with "already a
mount point" (a restart loop under systemd's ``Restart=``). It is recognised
from mountinfo (type ``fuse.cachefs`` at exactly this path), never from a stat
alone (a stat of the mount point may succeed from attributes the kernel
cached), and confirmed by both

* the daemon being gone: the runtime registry's pid for this mount point is
  dead or there is no entry, and
* the mount not answering: ``statvfs`` (never answered from a cache) fails
  with ENOTCONN, or gets no answer within :data:`PROBE_TIMEOUT` while the
  registered daemon is gone.

It is then detached (lazy unmount: readers still inside get errors, new
lookups see the directory below), with one log line, and the mount proceeds;
the cache directory is reused. A live cachefs mount, one that does not answer
while its daemon runs, and any other file system are refused with one line.

Cache directory (:func:`prepare_cache_dir`, :func:`lock_cache_dir`): created
0700 and kept so (it holds cached object bytes and key names, which the
mount's own permissions may hide from other local users); an existing
directory with wider modes, and the files cachefs keeps at its top (index,
lock, log), are tightened with one log line (a directory that holds other things keeps
its mode, and they theirs: :func:`tighten_cache_dir`). Files cachefs creates in it are
created 0600 whatever the umask (``os.open`` modes can only be narrowed by the
umask).

Signals (:data:`STOP_SIGNALS`, :data:`IGNORED_SIGNALS`): what the daemon does with each
signal whose default action would end it, from its start (the CLI ignores the ignored ones
before anything else; the daemon holds the stop signals from just before its mount).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import signal
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from cachefs import metrics
from cachefs.config import format_size
from cachefs.control import registry
from cachefs.errors import CacheError, ConfigError

log = logging.getLogger(__name__)

#: Signals that stop the daemon cleanly, as SIGTERM does (unmount, index synced): SIGINT
#: (a terminal's Ctrl-C), SIGQUIT (Ctrl-\\, some process managers' stop signal) and
#: SIGXCPU (the kernel's, at the soft CPU-time limit, LimitCPU=; SIGKILL follows at the
#: hard one). By their default action they end the process -- SIGQUIT and SIGXCPU with a
#: core dump -- which leaves a dead mount ("Transport endpoint is not connected").
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGXCPU)
#: Signals logged and ignored: their default action ends the process (a dead mount), and
#: none of them is a request to stop: SIGHUP (a closed terminal), SIGUSR1 and SIGUSR2 (a
#: log rotation's "kill -USR1"; the log is appended to, so copytruncate rotates it), and
#: the timer signals SIGALRM, SIGVTALRM and SIGPROF, which cachefs never arms (a stray
#: alarm, a profiler's timer aimed at the wrong process). Left at their default: the
#: signals of a fault (SIGSEGV, SIGBUS, SIGABRT...), SIGKILL, and those nothing sends a
#: daemon (SIGPWR, SIGIO, SIGSTKFLT; SIGPIPE and SIGXFSZ Python ignores already).
IGNORED_SIGNALS = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM,
                   signal.SIGVTALRM, signal.SIGPROF)

#: Seconds a daemon waits for another one holding its mount point (see lock_mountpoint).
MOUNTPOINT_LOCK_WAIT = 30.0

PROBE_TIMEOUT = 3.0  # seconds a mount at the mount point has to answer statvfs
DIR_MODE = 0o700
FILE_MODE = 0o600


# -- mount point ------------------------------------------------------------------------
def check_mountpoint(path: Path, *, clean_dead: bool = True) -> bool:
    """Check the mount point (see the module docstring). Returns True when a dead cachefs
    mount was detached. With ``clean_dead=False`` (the ``cachefs mount`` parent, which
    leaves the cleaning and its log line to the daemon) a dead mount is accepted as is
    and True is returned without touching it."""
    cleaned = False
    for _ in range(8):  # mounts can be stacked; each round removes the top-most dead one
        fstype = registry.mount_type(_canonical(path))
        if fstype is None:
            break
        if fstype not in registry.FS_TYPES:
            raise ConfigError(f"mount point {path} is already a mount point ({fstype})")
        pid = _registered_pid(path)
        state = _mount_state(path, pid)
        if state == "live":
            owner = f" (daemon pid {pid})" if pid and registry.is_daemon(pid) else ""
            raise ConfigError(f"mount point {path} is already a live cachefs mount{owner}: "
                              f"unmount it first ('cachefs unmount {path}')")
        if state == "hung":
            raise ConfigError(f"mount point {path} holds a cachefs mount that does not answer "
                              f"and whose daemon (pid {pid}) still runs: stop it, or run "
                              f"'cachefs unmount --lazy {path}'")
        if not clean_dead:
            return True
        _detach(path)
        metrics.DEAD_MOUNTS_CLEANED.inc()
        gone = f"daemon pid {pid} is gone" if pid else "no daemon is registered for it"
        log.warning("mount point %s held a dead cachefs mount (%s); detached it (lazy "
                    "unmount) and mounting again", path, gone)
        cleaned = True
    else:
        raise ConfigError(f"mount point {path}: too many stacked mounts")
    _check_empty_dir(path)
    return cleaned


def _canonical(path: Path) -> Path:
    """``path`` with its parent's symlinks resolved, as mountinfo names it. The mount point
    itself is not touched (a dead FUSE mount may answer ENOTCONN)."""
    return Path(os.path.realpath(path.parent)) / path.name


def _registered_pid(path: Path) -> int:
    info = registry.entry(path)
    try:
        return int(info.get("pid", 0)) if info else 0
    except (TypeError, ValueError):
        return 0


def mount_is_dead(path: Path, pid: int) -> bool:
    """Whether the cachefs mount at ``path``, registered to ``pid``, is dead: it answers
    ENOTCONN, or nothing while no cachefs daemon runs as ``pid`` (the pid of a killed
    daemon may be another process's by now)."""
    return _mount_state(path, pid) == "dead"


def _mount_state(path: Path, pid: int) -> str:
    """"live", "dead" or "hung" for a cachefs mount at ``path`` registered to ``pid``."""
    daemon_gone = not pid or not registry.is_daemon(pid)
    answer = _probe(path, PROBE_TIMEOUT)
    if answer == "ok":
        return "live"
    if answer == errno.ENOTCONN or answer == errno.ECONNABORTED:
        return "dead"
    if answer == "timeout":
        return "dead" if daemon_gone else "hung"
    # EACCES and the like: someone's daemon answered (another user's mount without
    # allow_other answers root with EACCES).
    return "live"


def _probe(path: Path, timeout: float) -> str | int:
    """statvfs ``path`` in a helper thread: "ok", "timeout" or the errno. A request to a
    FUSE mount whose connection still exists but nobody serves would block for ever, so
    the thread is a daemon thread and is abandoned after ``timeout``."""
    result: dict[str, str | int] = {}

    def run() -> None:
        try:
            os.statvfs(path)
            result["answer"] = "ok"
        except OSError as exc:
            result["answer"] = exc.errno or errno.EIO

    thread = threading.Thread(target=run, name="cachefs-mount-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return result.get("answer", "timeout")


def _detach(path: Path) -> None:
    """Lazy unmount (MNT_DETACH) of the mount at ``path``."""
    for cmd in (["fusermount3", "-u", "-z", str(path)], ["umount", "-l", str(path)]):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if proc.returncode == 0:
            return
    raise ConfigError(f"mount point {path} holds a dead cachefs mount that cannot be detached: "
                      f"run 'fusermount3 -u -z {path}' (or 'umount -l {path}' as root)")


def _check_empty_dir(path: Path) -> None:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"mount point {path} does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise ConfigError(f"mount point {path} is a dead mount (transport endpoint is not "
                              f"connected): run 'cachefs unmount --lazy {path}' first") from None
        raise ConfigError(f"mount point {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"mount point {path} is not a directory")
    if os.path.ismount(path):
        raise ConfigError(f"mount point {path} is already a mount point")
    try:
        with os.scandir(path) as entries:
            if any(entries):
                raise ConfigError(f"mount point {path} is not empty")
    except PermissionError:
        raise ConfigError(f"mount point {path}: permission denied") from None


# -- cache directory ----------------------------------------------------------------------
def prepare_cache_dir(path: Path, cache_size: int, *, tighten: bool = True) -> None:
    """Create the cache directory (0700) and check it is writable and big enough. With
    ``tighten`` (the daemon), wider modes of an existing directory and of the files at its
    top are narrowed, with one log line."""
    try:
        registry.make_dirs(path, DIR_MODE)
    except OSError as exc:
        raise CacheError(f"cannot create cache directory {path}: {exc.strerror}") from None
    if not path.is_dir():
        raise CacheError(f"cache directory {path} is not a directory")
    # Another user's directory (or one under a directory others may write to) could hold
    # links the daemon's writes would follow, and its owner could read the cache.
    try:
        problem = registry.unsafe_reason(path, leaf_modes=False)  # (its modes are narrowed)
    except OSError as exc:
        raise CacheError(f"cache directory {path}: {exc.strerror}") from None
    if problem:
        raise CacheError(f"refusing cache directory {path}: {problem}, who could read the "
                         "cache and plant links that cachefs would write through (use a "
                         "directory of your own)")
    if tighten:
        tighten_cache_dir(path)
    probe = path / f".write-test-{os.getpid()}"
    try:  # a byte, not only a name: a full disk must fail here, in one line
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            probe.unlink()
    except OSError as exc:
        raise CacheError(f"cache directory {path} is not writable: {exc.strerror}") from None
    st = os.statvfs(path)
    total = st.f_blocks * st.f_frsize
    if cache_size > total:
        raise ConfigError(f"--cache-size {format_size(cache_size)} is larger than the file system "
                          f"holding {path} ({format_size(total)})")


#: The entries cachefs keeps at the top of its cache directory (and its own start-up
#: probe's, ``.write-test-PID``, and a node identity being written, ``.node-id-PID``).
#: ``lost+found`` (a disk of its own) is no one's data.
CACHE_ENTRIES = frozenset({"objects", "meta.lmdb", "lock", "cachefs.log", "node-id"})
_NOBODYS = ("lost+found", ".write-test-", ".node-id-")


def tighten_cache_dir(path: Path) -> int:
    """Narrow the entries cachefs keeps at the top of the cache directory
    (:data:`CACHE_ENTRIES`) to 0700 (directories) / 0600 (files), and the directory itself
    to 0700 when it holds nothing else. Returns how many modes were narrowed (one log line
    if any). Deeper files need no change: nobody else can reach them through a 0700
    directory. A directory that holds other things (a home, a project, ``/var/cache``
    given as ``--cache-dir``) keeps its mode and theirs (one log line): scripts lost their
    execute bits, and folders and the directory were closed to the users who read them;
    the cache is private all the same, in its own 0700/0600 entries."""
    changed = 0
    wider: list[str] = []

    def narrow(p: Path, want: int) -> None:
        nonlocal changed
        try:
            st = p.lstat()
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            return
        mode = stat.S_IMODE(st.st_mode)
        if mode == want or (stat.S_ISREG(st.st_mode) and not mode & 0o077):
            return
        os.chmod(p, want)
        changed += 1
        if mode & 0o077:
            wider.append(f"{p.name} {mode:04o}")

    try:
        children = sorted(path.iterdir())
        others = [c.name for c in children if c.name not in CACHE_ENTRIES
                  and not c.name.startswith(_NOBODYS)]
        if others:
            if stat.S_IMODE(path.stat().st_mode) & 0o077:
                log.warning("cache directory %s holds other files (%s): left its mode and "
                            "theirs as they are; cachefs's own entries in it are private",
                            path, ", ".join(others[:4]) +
                            (f" and {len(others) - 4} more" if len(others) > 4 else ""))
        else:
            narrow(path, DIR_MODE)
        for child in children:
            if child.name in CACHE_ENTRIES:
                narrow(child, DIR_MODE if child.is_dir() and not child.is_symlink()
                       else FILE_MODE)
        lmdb_dir = path / "meta.lmdb"
        if lmdb_dir.is_dir():
            for child in lmdb_dir.iterdir():
                narrow(child, FILE_MODE)
    except OSError as exc:
        raise CacheError(f"cannot restrict the permissions of cache directory {path}: "
                         f"{exc.strerror}") from None
    if wider:
        log.warning("cache directory %s was open to other local users (%s); restricted it to "
                    "its owner (0700, files 0600)", path, ", ".join(wider[:4]) +
                    (f" and {len(wider) - 4} more" if len(wider) > 4 else ""))
    return changed


def open_private(path: Path, flags: int) -> int:
    """``os.open`` of a file cachefs keeps private (created 0600)."""
    return os.open(path, flags | os.O_CLOEXEC, FILE_MODE)


@contextlib.contextmanager
def lock_mountpoint(path: Path) -> Iterator[Callable[[], None]]:
    """Hold an exclusive lock on the mount point from before :func:`check_mountpoint` until
    the mount is live (the daemon calls the function this yields) or failed (the block
    ends): two mounts of one mount point started at once both found it empty and both
    mounted, one over the other. A daemon that finds the lock taken waits for it (at most
    :data:`MOUNTPOINT_LOCK_WAIT` seconds), then finds the winner's mount live (refused as
    such) or none. The lock is a file in the runtime directory beside the mount's registry
    entry, removed by its holder at release (a taker that locked a removed file, not the
    one at the path, tries again); the kernel releases it however the daemon ends. Where
    that directory cannot be written, the mount goes on without it (one log line)."""
    lock = registry.control_socket(path).with_suffix(".lock")
    held: list[int] = []

    def release() -> None:
        if held:
            fd = held.pop()
            with contextlib.suppress(OSError):
                lock.unlink()  # (while locked: a waiter then finds its file gone)
            os.close(fd)

    deadline = time.monotonic() + MOUNTPOINT_LOCK_WAIT
    try:
        while not held:
            try:
                try:
                    registry.ensure_runtime_dir()
                except registry.UnsafeRuntimeDir as exc:  # (another user could step in)
                    raise ConfigError(str(exc)) from None
                fd = open_private(lock, os.O_RDWR | os.O_CREAT)
            except OSError as exc:
                log.warning("cannot lock mount point %s (%s: %s); going on without the lock",
                            path, lock, exc.strerror)
                break
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                if time.monotonic() >= deadline:
                    raise ConfigError(f"mount point {path} is being mounted by another "
                                      f"cachefs daemon (pid {owner})") from None
                time.sleep(0.05)
                continue
            try:
                current = os.stat(lock).st_ino
            except OSError:
                current = None
            if current != os.fstat(fd).st_ino:  # released and removed meanwhile: again
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            held.append(fd)
        yield release
    finally:
        release()


NODE_ID = "node-id"  # the file in the cache directory that keeps the node's token


def node_identity(path: Path, name: str | None = None) -> str:
    """This node's identity in the shared tier (what its fetch leases hold): its name
    (``name``, ``--node-name``: in Kubernetes the node's, where the host's name is the
    pod's and a replaced pod gets a new one; else the host's) and a random token made
    once and kept in the cache directory ``path`` (file ``node-id``), so that a daemon
    restarted on its cache directory -- after a crash, a SIGKILL, an upgrade, in a new
    pod on the same node -- is the node it was and takes its own leases over at once.
    Two daemons on one host have two cache directories, so two tokens; a cache directory
    copied to another host is another node there by its name. Call with the cache
    directory locked (:func:`lock_cache_dir`). A token that cannot be read or kept is
    made anew (one log line): the cost is one ``lease_wait`` per block this node had
    leased before, as with no identity at all."""
    file = path / NODE_ID
    try:
        token = file.read_text().strip()
    except FileNotFoundError:
        token = ""
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("cannot read the node identity %s (%s); making a new one", file, exc)
        token = ""
    if len(token) != 32 or any(c not in "0123456789abcdef" for c in token):
        token = os.urandom(16).hex()
        temp = path / f".{NODE_ID}-{os.getpid()}"
        try:
            fd = open_private(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                os.write(fd, f"{token}\n".encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, file)
        except OSError as exc:
            log.warning("cannot keep the node identity in %s (%s): a restart will not "
                        "recognise this run's fetch leases", file, exc)
            with contextlib.suppress(OSError):
                temp.unlink()
    return f"{name or socket.gethostname()}:{token}"


def _detached_note(pid: str) -> str:
    """What the daemon ``pid`` holding a cache directory is doing, if its mount was
    detached: it runs on (lazy unmount) until the files open on it are closed."""
    for info in registry.detached_daemons():
        if str(info.get("pid")) == pid:
            handles = int(info.get("stats", {}).get("cachefs_open_file_handles", 0))
            return (f", detached from {info.get('mountpoint')} by a lazy unmount: it runs "
                    f"on until its {handles} open file handle(s) are closed ('cachefs "
                    "status' shows it)")
    return ""


@contextlib.contextmanager
def lock_cache_dir(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the cache directory for the daemon's lifetime (released by
    the kernel when the process dies, however it dies)."""
    fd = open_private(path / "lock", os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise CacheError(f"cache directory {path} is in use by another cachefs daemon "
                             f"(pid {owner}){_detached_note(owner)}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)

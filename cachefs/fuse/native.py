"""Requests answered in C: the request workers' native loop, the files it reads, and the
lookups, opens and releases it answers.

Without FUSE passthrough (a kernel older than 6.9, a daemon without CAP_SYS_ADMIN, or
``--passthrough off``) every read of a cached file costs a request answered in Python.
:class:`NativeReads` takes the kernel's place in :mod:`cachefs.passthrough`: it is the
:class:`~cachefs.passthrough.BackingDevice` the passthrough logic registers verified,
pinned cache files with (the same whole-object check, the same pin, the same bounds),
and a handle opened on such a file is *bound* to it (:meth:`NativeReads.bind`). The
request workers then run :func:`serve`, the loop of ``_native.c``: a READ of a bound
handle is one ``pread`` of the file and one ``writev`` of the answer, without the
interpreter; so is the IOCTL every Python ``open()`` sends. A READ reaching the object's
end (a small file's only one) none of whose bytes is in the page cache is read with
O_DIRECT: the kernel caches them once, for the FUSE file the answer fills, instead of
twice (``_native.c`` ``read_file``). Everything else goes to the
Python handler with the interpreter lock taken, as before.

The guarantee is the passthrough one: bytes served from a bound file were checked with
the whole object when it was registered, and the file stays pinned (never punched) while
registered, so a bound handle never reads bytes that failed or escaped the check. A read
the file cannot answer in full goes to Python, which reads and checks the blocks itself.

The loop also answers LOOKUPs whose answers Python remembered in it
(:meth:`NativeReads.remember_lookup`; both with and without passthrough): a name looked
up again while its directory listing is fresh -- after the kernel dropped its entry, as
it does under memory pressure or a ``drop_caches`` -- costs no Python. An answer is
given only while fresh (Python says how long: the rest of the listing's freshness) and
in the epoch of its directory it was read in: :meth:`NativeReads.forget_dir`, called
whenever a directory's listing is made current or marked stale
(:meth:`cachefs.cache.metadata.Metadata.add_listener`), ends that directory's epoch.
Answers are held in a fixed number of slots (``lookup_slots``, in sets of four by a hash
of the name: a newer answer replaces its own name's, else an empty, expired or stale one of
its set, else the one expiring first), about 200 bytes each. Only answers from a complete listing
looked up by a request worker are remembered (a lookup that waited for a listing is not).

And it answers the OPENs of files opened before, and their RELEASEs (both with and
without passthrough). A file opened in Python whose handle was passed through (or
bound) is given an *open template* (:meth:`NativeReads.add_template`, by
:meth:`cachefs.passthrough.Passthrough.add_template`): the loop answers the inode's next
read-only opens the same way, with handle numbers of its own (from
:data:`FIRST_LOOP_FH`), and each open and release is an *event* (:meth:`drain`) for
Python's bookkeeping -- the hint cursor, the directory walk, the handle table -- done in
the order the loop queued them: before any request Python answers (so a request of such
a handle finds it), on the trio thread in batches otherwise (:meth:`wait_events`), and
before metrics are collected. The loop counts its open handles per template and refuses
to drop a template while one is open (:meth:`drop_template`), so the registration such a
handle reads from (its pin, the kernel's backing) outlives it.

The extension is optional (a ``pip install`` without a compiler builds without it):
:data:`AVAILABLE` says whether it is here; without it the workers run the Python loop
and every read is answered in Python.

Concurrency: :meth:`bind` and :meth:`unbind` run on the request workers (open and
release), :meth:`backing_open`, :meth:`backing_close`, :meth:`add_template` and
:meth:`drop_template` wherever :class:`~cachefs.passthrough.Passthrough` registers
(workers, its verifying threads; under its lock); ``_lock`` guards ``_next_id``. The
registered files themselves are the C table's (one descriptor each, shared by the handles
and templates reading them, see ``_native.c`` ``register_file``).
:meth:`drain` runs on any thread, one at a time (``_drain_lock``: a worker waits for a
drain under way, the trio thread skips). The C table has its own mutex (see
``_native.c``), a leaf: nothing else is taken under it.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable
from typing import Any

import trio

from cachefs import metrics
from cachefs.fuse import abi

try:
    from cachefs.fuse import _native
except ImportError:  # built without the extension (no compiler at install time)
    _native = None  # type: ignore[assignment]

AVAILABLE = _native is not None

#: Remembered lookup answers at least: 65,536 slots, at most about 13 MiB.
LOOKUP_SLOTS = 1 << 16


def lookup_slots_for(files: int) -> int:
    """Slots to remember the lookups of ``files`` files in: a power of two at least twice
    their number (sets of four then keep ~96% of them, see ``_native.c``), and at least
    :data:`LOOKUP_SLOTS`."""
    slots = LOOKUP_SLOTS
    while slots < 2 * files:
        slots *= 2
    return slots

#: The loop's events (``take_events``): (kind, pid, handle, inode).
EVENT = struct.Struct("<IIQQ")
OPENED = 1
RELEASED = 2
#: Handles the loop opens are numbered from here up (Python's from 1).
FIRST_LOOP_FH = 1 << 62


def _dir_key(prefix: str) -> int:
    """The key the C table's directory epochs use for ``prefix`` (stable in this process)."""
    return hash(prefix) & 0xFFFF_FFFF_FFFF_FFFF


class NativeReads:
    """The files registered for reads answered in C, and the handles bound to them."""

    def __init__(self, lookup_slots: int = LOOKUP_SLOTS) -> None:
        if _native is None:
            raise RuntimeError("cachefs was built without its native request loop")
        self._table: Any = _native.new_table(metrics.LATENCY_BUCKETS, lookup_slots)
        self._lock = threading.Lock()  # (the next id)
        self._next_id = 1
        # Written by the loop when its event ring stops being empty (see wait_events).
        self._event_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        _native.set_event_fd(self._table, self._event_fd)
        # One drain at a time, so events are handled in the order the loop queued them.
        self._drain_lock = threading.Lock()

    # -- the BackingDevice interface (cachefs.passthrough) --------------------------------
    def backing_open(self, fd: int) -> int:
        """Register a verified cache file; its id (> 0). The loop keeps one duplicate of
        ``fd``, which every handle and template of the file reads: a registered file holds
        one descriptor (:mod:`cachefs.descriptors`). Raises OSError (EMFILE)."""
        with self._lock:
            backing_id = self._next_id
            self._next_id += 1
        assert _native is not None
        _native.register_file(self._table, backing_id, fd)
        return backing_id

    def stamp_file(self, backing_id: int, stamp: tuple[int, int]) -> bool:
        """From now, the loop's reads and opens of registered file ``backing_id`` check
        that it still has ``stamp`` (its inode and change time when it was verified,
        :data:`cachefs.cache.objectfiles.FileStamp`): once it does not (someone wrote to
        it), they are Python's, which reads and checks each block. False if there is no
        such registration."""
        assert _native is not None
        return _native.stamp_file(self._table, backing_id, stamp[0], stamp[1])

    def backing_close(self, backing_id: int) -> None:
        """Forget a registered file (handles and templates using it keep its descriptor
        until they let go)."""
        assert _native is not None
        _native.unregister_file(self._table, backing_id)

    # -- handles ------------------------------------------------------------------------
    def bind(self, fh: int, backing_id: int, size: int) -> bool:
        """Answer reads of handle ``fh`` (up to ``size`` bytes, the object's) from the
        file registered as ``backing_id``; False if it is not registered (the handle's
        reads then go to Python)."""
        assert _native is not None
        return _native.bind(self._table, fh, backing_id, size)

    def unbind(self, fh: int) -> bool:
        """Handle ``fh`` is closed: its reads are no longer answered here. Returns whether
        it was bound."""
        assert _native is not None
        return _native.unbind(self._table, fh)

    # -- opens answered by the loop -------------------------------------------------------
    def add_template(self, ino: int, *, token: int, prefix: str, kernel_backing: int = 0,
                     native_backing: int = 0, size: int = 0, path: str | None = None,
                     stamp: tuple[int, int] | None = None) -> bool:
        """Let the loop answer read-only opens (without O_DIRECT) of inode ``ino`` itself:
        passed through to the kernel's backing ``kernel_backing``, or bound to the file
        registered here as ``native_backing`` (up to ``size`` bytes) -- while the epoch
        ``token`` of its directory ``prefix`` (:meth:`lookup_epoch`, read before Python
        saw the inode listed) lasts: once the listing changes, its opens go to Python
        again (the inode may be gone). An inode with a template has only its epoch
        renewed. False if ``token`` is not current or the registration is gone. Every
        handle the loop opens and releases is an event (:meth:`drain`). With
        ``kernel_backing``, ``path`` and ``stamp`` name its file as it was verified: each
        open checks it still has that stamp, and leaves the open to Python if not (the
        stamp of a ``native_backing`` is its registration's, :meth:`stamp_file`)."""
        assert _native is not None
        key = _dir_key(prefix)
        if native_backing:
            return _native.add_template(self._table, ino, token, key, abi.FOPEN_KEEP_CACHE,
                                        0, native_backing, size)
        if path is None or stamp is None:
            return _native.add_template(self._table, ino, token, key, abi.FOPEN_PASSTHROUGH,
                                        kernel_backing, 0, 0)
        return _native.add_template(self._table, ino, token, key, abi.FOPEN_PASSTHROUGH,
                                    kernel_backing, 0, 0, path, stamp[0], stamp[1])

    def drop_template(self, ino: int) -> bool:
        """The loop no longer opens ``ino`` (True), or it keeps the template because
        handles it opened with it are still open (False: the registration they use must
        stay)."""
        assert _native is not None
        return _native.drop_template(self._table, ino)

    def drain(self, handle: Callable[[list[tuple[int, int, int, int]]], None], *,
              blocking: bool = True) -> None:
        """Hand every event queued so far to ``handle(events)`` in one call, if there are
        any: ``(kind, pid, fh, ino)`` each (kind :data:`OPENED` or :data:`RELEASED`), in
        the order the loop queued them (any thread; one drain at a time: with
        ``blocking`` False, return at once if another runs)."""
        assert _native is not None
        if not self._drain_lock.acquire(blocking):
            return
        try:
            data = _native.take_events(self._table)
            if data:
                handle(list(EVENT.iter_unpack(data)))
        finally:
            self._drain_lock.release()

    async def wait_events(self) -> None:
        """Return once the loop has queued events since the last call (trio thread)."""
        await trio.lowlevel.wait_readable(self._event_fd)
        try:
            os.eventfd_read(self._event_fd)
        except BlockingIOError:
            pass

    # -- lookups ------------------------------------------------------------------------
    def lookup_epoch(self, prefix: str) -> int:
        """The epoch token to pass to :meth:`remember_lookup` for a lookup in directory
        ``prefix`` starting now (read it before the lookup reads anything)."""
        assert _native is not None
        return _native.lookup_epoch(self._table, _dir_key(prefix))

    def remember_lookup(self, token: int, prefix: str, parent: int, name: bytes,
                        answer: bytes, fresh_for: float) -> bool:
        """Answer LOOKUPs of ``name`` in directory inode ``parent`` (``prefix``) with
        ``answer`` (the fuse_entry_out Python gave) for ``fresh_for`` seconds -- unless
        :meth:`forget_dir` of ``prefix`` or :meth:`forget_lookups` was called since
        ``token`` was read (then False)."""
        assert _native is not None
        return _native.remember_lookup(self._table, token, _dir_key(prefix), parent, name,
                                       answer, fresh_for)

    def forget_dir(self, prefix: str) -> None:
        """No answer remembered so far for a name in ``prefix`` is given again (any
        thread; its listing was made current or marked stale)."""
        assert _native is not None
        _native.forget_dir(self._table, _dir_key(prefix))

    def forget_lookups(self) -> None:
        """No answer remembered so far is given again (any thread)."""
        assert _native is not None
        _native.forget_lookups(self._table)

    def stats(self) -> dict[str, Any]:
        """What the native loop answered so far: per timed request kind ("read",
        "lookup") (count, seconds, latency buckets); "read_bytes", "ioctls",
        "fallbacks" (reads given to Python), "bound" (handles now),
        "lookups_remembered", "templates", "events", "open_handovers" and "direct_reads"
        (reads made with O_DIRECT: an object's last bytes, none in the page cache)."""
        assert _native is not None
        return _native.stats(self._table)

    def serve(self, fd: int, buf: bytearray, handle: Callable[[int], bool],
              data_size: int) -> None:
        """A request worker's loop (see the module docstring): returns when the
        connection ended or ``handle`` answered True."""
        assert _native is not None
        _native.serve(self._table, fd, buf, handle, data_size)

    def publish(self) -> None:
        """Count this loop's requests and bytes in the mount's metrics
        (``cachefs_fuse_requests_total``, its latency histogram, ``cachefs_read_bytes_total``,
        ``cachefs_fuse_native_answers_total``)."""
        metrics.FUSE_STATS.add_source(self._request_counts)
        metrics.READ_BYTES.add_source(lambda: self.stats()["read_bytes"])
        metrics.NATIVE_ANSWERS.source = self._answered
        metrics.NATIVE_ANSWERS.direct_reads = lambda: self.stats()["direct_reads"]
        metrics.NATIVE_OPEN_TEMPLATES.set_function(lambda: self.stats()["templates"])

    def _answered(self) -> dict[str, int]:
        st = self.stats()
        return {"read": st["read"][0], "lookup": st["lookup"][0], "open": st["open"][0],
                "release": st["release"][0], "ioctl": st["ioctls"]}

    def _request_counts(self) -> dict[str, tuple[int, float, list[int]]]:
        st = self.stats()
        ioctls = st["ioctls"]
        untimed = [ioctls] + [0] * len(metrics.LATENCY_BUCKETS)  # (as Python counts them)
        return {"read": st["read"], "lookup": st["lookup"], "open": st["open"],
                "release": st["release"], "ioctl": (ioctls, 0.0, untimed)}

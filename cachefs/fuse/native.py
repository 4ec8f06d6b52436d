"""Reads answered in C: the request workers' native loop and the files it reads.

Without FUSE passthrough (a kernel older than 6.9, a daemon without CAP_SYS_ADMIN, or
``--passthrough off``) every read of a cached file costs a request answered in Python.
:class:`NativeReads` takes the kernel's place in :mod:`cachefs.passthrough`: it is the
:class:`~cachefs.passthrough.BackingDevice` the passthrough logic registers verified,
pinned cache files with (the same whole-object check, the same pin, the same bounds),
and a handle opened on such a file is *bound* to it (:meth:`NativeReads.bind`). The
request workers then run :func:`serve`, the loop of ``_native.c``: a READ of a bound
handle is one ``pread`` of the file and one ``writev`` of the answer, without the
interpreter; so is the IOCTL every Python ``open()`` sends. Everything else goes to the
Python handler with the interpreter lock taken, as before.

The guarantee is the passthrough one: bytes served from a bound file were checked with
the whole object when it was registered, and the file stays pinned (never punched) while
registered, so a bound handle never reads bytes that failed or escaped the check. A read
the file cannot answer in full goes to Python, which reads and checks the blocks itself.

The extension is optional (a ``pip install`` without a compiler builds without it):
:data:`AVAILABLE` says whether it is here; without it the workers run the Python loop
and every read is answered in Python.

Concurrency: :meth:`bind` and :meth:`unbind` run on the request workers (open and
release), :meth:`backing_open` and :meth:`backing_close` wherever
:class:`~cachefs.passthrough.Passthrough` registers (workers, its verifying threads);
``_lock`` guards ``_files``. The C table has its own mutex (see ``_native.c``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from cachefs import metrics

try:
    from cachefs.fuse import _native
except ImportError:  # built without the extension (no compiler at install time)
    _native = None  # type: ignore[assignment]

AVAILABLE = _native is not None


class NativeReads:
    """The files registered for reads answered in C, and the handles bound to them."""

    def __init__(self) -> None:
        if _native is None:
            raise RuntimeError("cachefs was built without its native request loop")
        self._table: Any = _native.new_table(metrics.LATENCY_BUCKETS)
        self._lock = threading.Lock()
        self._files: dict[int, int] = {}  # backing id -> our descriptor of the file
        self._next_id = 1

    # -- the BackingDevice interface (cachefs.passthrough) --------------------------------
    def backing_open(self, fd: int) -> int:
        """Register a verified cache file (a duplicate of ``fd`` is kept); its id (> 0)."""
        dup = os.dup(fd)
        with self._lock:
            backing_id = self._next_id
            self._next_id += 1
            self._files[backing_id] = dup
        return backing_id

    def backing_close(self, backing_id: int) -> None:
        """Forget a registered file (handles bound to it keep their own descriptor)."""
        with self._lock:
            fd = self._files.pop(backing_id, None)
        if fd is not None:
            os.close(fd)

    # -- handles ------------------------------------------------------------------------
    def bind(self, fh: int, backing_id: int, size: int) -> bool:
        """Answer reads of handle ``fh`` (up to ``size`` bytes, the object's) from the
        file registered as ``backing_id``; False if it is not registered (the handle's
        reads then go to Python)."""
        with self._lock:
            fd = self._files.get(backing_id)
            if fd is None:
                return False
            assert _native is not None
            _native.bind(self._table, fh, fd, size)  # (under the lock: fd stays open)
        return True

    def unbind(self, fh: int) -> bool:
        """Handle ``fh`` is closed: its reads are no longer answered here. Returns whether
        it was bound."""
        assert _native is not None
        return _native.unbind(self._table, fh)

    def stats(self) -> tuple[int, int, float, list[int], int, int, int]:
        """(reads, read bytes, read seconds, latency buckets, ioctls, reads given to
        Python, handles bound) answered by the native loop so far."""
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
        (``cachefs_fuse_requests_total``, its latency histogram, ``cachefs_read_bytes_total``)."""
        metrics.FUSE_STATS.add_source(self._request_counts)
        metrics.READ_BYTES.add_source(lambda: self.stats()[1])

    def _request_counts(self) -> dict[str, tuple[int, float, list[int]]]:
        reads, _, seconds, buckets, ioctls, _, _ = self.stats()
        untimed = [ioctls] + [0] * (len(buckets) - 1)  # (as the Python loop counts them)
        return {"read": (reads, seconds, buckets), "ioctl": (ioctls, 0.0, untimed)}

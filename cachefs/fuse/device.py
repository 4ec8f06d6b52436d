"""The FUSE device of one mount: mounting, the descriptors requests are read from,
passthrough backing files, and unmounting.

Mounting goes through libfuse (via pyfuse3's ``init``): it parses the mount
options and mounts either directly (root) or through ``fusermount3`` (other
users). Nothing else of libfuse or pyfuse3 is used: cachefs reads requests
from the device itself (:mod:`cachefs.fuse.server`), so libfuse never sees the
INIT request and never runs a request loop. This is the only module that
imports pyfuse3.

Descriptors: the session descriptor belongs to libfuse (it closes it at
unmount); request workers read from a ``dup`` of it each (:meth:`Device.dup`),
closed by their owner after the last request, so no worker ever reads from a
descriptor number that was closed and reused meanwhile.

Passthrough (Linux >= 6.9, CAP_SYS_ADMIN): :meth:`Device.backing_open`
registers an open cache file with the kernel (``FUSE_DEV_IOC_BACKING_OPEN``)
and returns the id an OPEN reply names; :meth:`Device.backing_close` drops
it. Any descriptor of the connection will do.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
from pathlib import Path

import pyfuse3

log = logging.getLogger(__name__)

_BACKING_OPEN = 0x4010E501  # _IOW(229, 1, struct fuse_backing_map)
_BACKING_CLOSE = 0x4004E502  # _IOW(229, 2, uint32_t)
_FUSECTL = Path("/sys/fs/fuse/connections")


def _fuse_fds() -> set[int]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                found.add(int(name))
    return found


class Device:
    """One mounted FUSE connection."""

    def __init__(self, mountpoint: Path, fd: int) -> None:
        self.mountpoint = mountpoint
        self.fd = fd  # libfuse's session descriptor
        self._mounted = True

    @classmethod
    def mount(cls, mountpoint: Path, options: set[str]) -> Device:
        """Mount (through libfuse) and return the device. Raises RuntimeError."""
        before = _fuse_fds()
        pyfuse3.init(pyfuse3.Operations(), str(mountpoint), options)
        new = _fuse_fds() - before
        if len(new) != 1:
            with contextlib.suppress(Exception):
                pyfuse3.close(unmount=True)
            raise RuntimeError(f"cannot find the FUSE device of the mount ({len(new)} candidates)")
        return cls(mountpoint, new.pop())

    def dup(self) -> int:
        """A descriptor of the connection for a request worker (its owner closes it)."""
        return os.dup(self.fd)

    # -- passthrough ----------------------------------------------------------------
    def backing_open(self, fd: int) -> int:
        """Register the open file ``fd`` as a backing file; its id (> 0). Raises OSError
        (EPERM without CAP_SYS_ADMIN or when INIT did not grant passthrough)."""
        return int(fcntl.ioctl(self.fd, _BACKING_OPEN, bytearray(struct.pack("iIQ", fd, 0, 0))))

    def backing_close(self, backing_id: int) -> None:
        """Drop a backing id (files opened with it keep it). Raises OSError."""
        fcntl.ioctl(self.fd, _BACKING_CLOSE, bytearray(struct.pack("I", backing_id)))

    # -- the end -----------------------------------------------------------------------
    @staticmethod
    def abort(dev: str) -> bool:
        """Abort the connection of the mount whose device is ``dev`` (``major:minor`` from
        mountinfo, read while it was mounted): every request then fails and the
        workers' reads end. Needs the fusectl file system; returns whether it worked."""
        try:
            minor = int(dev.split(":")[1])
            (_FUSECTL / str(minor) / "abort").write_text("1")
            return True
        except (OSError, ValueError, IndexError):
            return False

    def close(self, *, unmount: bool) -> None:
        """Unmount (lazily when files are open) and release libfuse's session."""
        if not self._mounted:
            return
        self._mounted = False
        try:
            pyfuse3.close(unmount=unmount)
        except Exception:  # the mount may already be gone
            log.debug("pyfuse3.close failed", exc_info=True)

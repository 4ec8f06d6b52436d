"""The daemon's open-file budget: the limit it runs under, and what is left for cache files.

Without passthrough, every cache file registered for reads in C
(:mod:`cachefs.fuse.native`) holds an open descriptor for as long as it stays registered
(:data:`PER_NATIVE_FILE`: one, shared by the handles and the open template reading it; a
direct read opens and closes its own). Registrations are kept idle, up to
:data:`cachefs.passthrough.MAX_IDLE_BACKINGS` files, so the next epoch's opens need no
Python. When each held three (the registration's, its template's and an O_DIRECT one), a
walk over 14,000 small files ran a daemon out of its 20,000 descriptors, and every cache
write, registration and (through an open template) open then failed with EMFILE. With the
kernel's passthrough a registration holds no descriptor of ours (the kernel keeps its own
reference to the file).

So at start the daemon

* raises its soft ``RLIMIT_NOFILE`` to the hard limit (:func:`raise_limit`): the soft
  limit of 1,024 many shells and service managers give exists for programs that use
  ``select()``; cachefs does not (trio uses epoll), and its systemd unit sets
  ``LimitNOFILE=1048576`` for the same reason;
* keeps :func:`reserved` descriptors for everything else it opens -- two per S3
  connection (its socket, and the cache file a cold GET writes), the FUSE device and its
  clones, LMDB, threads, a direct read's descriptor per request worker, and the control
  and metrics sockets -- and lets registered files use the rest
  (:func:`native_files`), which bounds the idle registrations
  (:meth:`cachefs.passthrough.Passthrough.attach_device`).

Should the budget still run out (another process sharing the limit, a reader holding
thousands of files open), the passthrough layer shrinks its bound at the first EMFILE and
serves those opens in Python (:meth:`cachefs.passthrough.Passthrough.out_of_descriptors`);
reads never fail for it.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

#: Descriptors an idle cache file registered for reads in C holds (see the module docstring).
PER_NATIVE_FILE = 1
#: Descriptors kept for what is not counted per S3 connection: the handles readers hold
#: open, FUSE, LMDB, sockets, threads, logs.
FIXED_RESERVE = 1024


def raise_limit() -> int:
    """Raise the soft limit on open files to the hard limit; returns the soft limit now in
    force (unchanged, with one log line, if it cannot be raised)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        # RLIM_INFINITY is refused for RLIMIT_NOFILE (it must not exceed fs.nr_open): keep
        # the soft limit a kernel of this kind takes by default instead.
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.info("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


def reserved(max_connections: int) -> int:
    """Descriptors kept for everything but registered cache files."""
    return 2 * max_connections + FIXED_RESERVE


def native_files(limit: int, max_connections: int) -> int:
    """Cache files that may stay registered for reads in C under an open-file ``limit``
    (0 when the limit leaves nothing over)."""
    return max(0, limit - reserved(max_connections)) // PER_NATIVE_FILE

"""Failpoints: named places in the code where a test can hold a thread.

Races (an eviction against a passthrough open, a read against a punch) cannot
be tested by hoping for the right timing. The code under test calls
:func:`hit` at the places where the interleaving matters; normally that is one
dict lookup and nothing else. A test arms a point with a callable
(in-process, :func:`arm`), or for a daemon in another process through the
environment::

    CACHEFS_FAILPOINTS=evict.chosen,attach.verified  CACHEFS_FAILPOINT_DIR=/some/dir

An armed point in a daemon holds the thread that reaches it while the file
``DIR/NAME.hold`` exists: it first creates ``DIR/NAME.reached`` (so the test
knows), then waits until the test removes ``NAME.hold`` (at most
:data:`HOLD_LIMIT` seconds). While ``DIR/NAME.raise`` exists instead, the next thread
reaching the point removes it, creates ``NAME.reached`` and raises :class:`Injected`
(once: a failure no code path expects, as a MemoryError would be). Points are only hit
in worker threads (or in the main thread before trio runs: ``mount.made``, just after
the mount is made), never on the trio thread (a held trio thread would stop the whole
mount).

A test may also lower a size bound of such a daemon (:func:`tuned`), so that what the
bound is about happens with small objects: ``CACHEFS_TEST_<NAME>=<bytes>``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

#: A held thread continues after this many seconds whatever the test does.
HOLD_LIMIT = 60.0

_armed: dict[str, Callable[[], None]] = {}


class Injected(Exception):
    """Raised at an armed point of a daemon under test (``NAME.raise``)."""


def hit(name: str) -> None:
    """Run what is armed at ``name`` (nothing, unless a test armed it)."""
    action = _armed.get(name)
    if action is not None:
        action()


def arm(name: str, action: Callable[[], None]) -> None:
    _armed[name] = action


def disarm(name: str) -> None:
    _armed.pop(name, None)


def _holder(name: str, directory: Path) -> Callable[[], None]:
    hold, reached = directory / f"{name}.hold", directory / f"{name}.reached"
    fail = directory / f"{name}.raise"

    def action() -> None:
        try:
            fail.unlink()
        except FileNotFoundError:
            pass
        else:
            reached.touch()
            raise Injected(f"failpoint {name}")
        if not hold.exists():
            return
        reached.touch()
        deadline = time.monotonic() + HOLD_LIMIT
        while hold.exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    return action


def arm_from_environment() -> None:
    """Arm the points named in ``CACHEFS_FAILPOINTS`` (a daemon under test)."""
    names = os.environ.get("CACHEFS_FAILPOINTS", "")
    directory = os.environ.get("CACHEFS_FAILPOINT_DIR", "")
    if not names or not directory:
        return
    for name in filter(None, (n.strip() for n in names.split(","))):
        arm(name, _holder(name, Path(directory)))
    log.warning("failpoints armed for tests: %s", names)


arm_from_environment()


def tuned(name: str, default: int) -> int:
    """The bound ``name`` (a module's constant), lowered by a test through
    ``CACHEFS_TEST_<NAME>`` for a daemon in another process; else ``default``. Read once,
    when the module defining the constant is imported."""
    value = os.environ.get(f"CACHEFS_TEST_{name}", "")
    if not value:
        return default
    log.warning("%s set to %s for tests", name, value)
    return int(value)

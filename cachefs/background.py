"""Background tasks never end the daemon: contain, log, count, go on.

pyfuse3 ends its request loop, and trio its nursery, on the first exception a
task lets escape; for a background task (the maintenance loop, the orphan
scan, a control-socket connection, a cache write after a fetch) that would take
the mount down for a housekeeping failure. So every unit of background work
runs inside :func:`contained`:

* any :class:`Exception` (not only ``OSError``) is caught, counted in
  ``cachefs_background_errors_total{task}`` and logged with the task's name and
  what it was doing: the first failure of a task with its traceback, later ones
  as one line at most every :data:`LOG_INTERVAL` seconds per task (a loop that
  fails every second must not flood the log);
* ``BaseException``\\s that are not ``Exception`` (``trio.Cancelled``,
  ``KeyboardInterrupt``, ``SystemExit``) pass through: only cancellation ends
  a task.

Thread-safety: :func:`report` and :func:`contained` may be used on the trio
thread and in worker threads (the log throttle takes a lock).

Threads of a component's own (the passthrough layer's preparing threads, the
page-cache readahead) are owned by a task through :func:`own_threads`: they
start with it and are stopped and joined before it returns, so none outlives
its owner's nursery (nor touches the cache index after it closed). Their names are
given to the OS too (Linux ``PR_SET_NAME``), so that a thread's CPU in
``/proc/<pid>/task/<tid>`` is told from the FUSE request workers' (the benchmarks
split the daemon's CPU per file that way).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import trio

from cachefs import metrics

log = logging.getLogger(__name__)

_PR_SET_NAME = 15
try:
    _prctl: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # (not Linux: the threads keep the OS's name)
    _prctl = None

LOG_INTERVAL = 60.0  # seconds between log lines of one task after its first failure

_lock = threading.Lock()
_last_logged: dict[str, float] = {}
_suppressed: dict[str, int] = {}


def report(task: str, exc: BaseException, doing: str = "") -> None:
    """Count and (throttled) log one failure of background ``task``."""
    metrics.BACKGROUND_ERRORS.labels(task).inc()
    now = time.monotonic()
    with _lock:
        first = task not in _last_logged
        if not first and now - _last_logged[task] < LOG_INTERVAL:
            _suppressed[task] = _suppressed.get(task, 0) + 1
            return
        _last_logged[task] = now
        suppressed = _suppressed.pop(task, 0)
    what = f" while {doing}" if doing else ""
    more = f" ({suppressed} more since the last report)" if suppressed else ""
    message = "background task %s failed%s: %s: %s%s; it goes on"
    args = (task, what, type(exc).__name__, exc, more)
    if first:
        log.error(message, *args, exc_info=exc)
    else:
        log.warning(message, *args)


@contextmanager
def contained(task: str, doing: str = "") -> Iterator[None]:
    """Run the body; an :class:`Exception` it raises is reported and swallowed."""
    try:
        yield
    except Exception as exc:
        report(task, exc, doing)


def reset_log_throttle() -> None:
    """Forget earlier failures (tests)."""
    with _lock:
        _last_logged.clear()
        _suppressed.clear()


async def own_threads(target: Callable[[], None], count: int, name: str, *,
                      stop: Callable[[], None],
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Run ``count`` threads of ``target`` (named ``name-0``, ``name-1``...) until
    cancelled; then call ``stop()`` on the trio thread, which must make every
    ``target`` return soon, and join them (shielded from the cancellation). Started
    (``task_status``) once the threads run. Each thread names itself for the OS
    first (see the module docstring; Linux keeps 15 bytes of the name)."""
    def run(thread_name: str) -> None:
        if _prctl is not None:
            _prctl(_PR_SET_NAME, thread_name.encode()[:15], 0, 0, 0)
        target()

    threads = [threading.Thread(target=run, args=(f"{name}-{i}",), daemon=True,
                                name=f"{name}-{i}")
               for i in range(count)]
    for t in threads:
        t.start()
    task_status.started()
    try:
        await trio.sleep_forever()
    finally:
        stop()
        with trio.CancelScope(shield=True):
            for t in threads:
                await trio.to_thread.run_sync(t.join)

"""A circuit breaker for an optional dependency (the shared cache tier).

States::

    closed --(threshold failures in a row)--> open --(cooldown)--> half-open
    half-open --(the trial request succeeds)--> closed
    half-open --(the trial request fails)--> open, cooldown doubled (up to max_cooldown)

While open, :meth:`allow` answers False at once, so callers skip the
dependency (reads go to the origin) without waiting on it. A failure is
whatever the caller says it is: an error answer, a refused connection, or a
request that blew its latency budget (the caller's deadline).

Exactly one log line when the breaker opens (after being closed) and one when
it closes again; a failed trial re-opens it silently. The state is exported as
``cachefs_shared_breaker_open``.

Concurrency: trio thread only (no locks). ``clock`` is monotonic seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from cachefs import metrics

log = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class CircuitBreaker:
    def __init__(self, what: str, *, threshold: int = 3, cooldown: float = 2.0,
                 max_cooldown: float = 10.0, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.what = what  # for the log lines: "the shared cache tier s3://..."
        self.threshold = threshold
        self.base_cooldown = cooldown
        self.max_cooldown = max_cooldown
        self._clock = clock
        self.state = CLOSED
        self._failures = 0
        self._cooldown = cooldown
        self._retry_at = 0.0
        self._trial_started = 0.0
        self._opened_at = 0.0
        self.opens = 0
        metrics.SHARED_BREAKER_OPEN.set(0)

    @property
    def is_open(self) -> bool:
        """Open or half-open: nothing but a trial request goes through."""
        return self.state != CLOSED

    def allow(self) -> bool:
        """May a request be sent now? In half-open, one trial at a time (a trial that
        never reports back is replaced after a cooldown)."""
        if self.state == CLOSED:
            return True
        now = self._clock()
        if self.state == OPEN and now >= self._retry_at:
            self.state = HALF_OPEN
            self._trial_started = now
            return True
        if self.state == HALF_OPEN and now - self._trial_started >= self._cooldown:
            self._trial_started = now
            return True
        return False

    def success(self) -> None:
        self._failures = 0
        if self.state != CLOSED:
            down = self._clock() - self._opened_at
            self.state = CLOSED
            self._cooldown = self.base_cooldown
            metrics.SHARED_BREAKER_OPEN.set(0)
            log.info("%s answers again after %.1fs: circuit breaker closed", self.what, down)

    def failure(self, reason: str) -> None:
        now = self._clock()
        if self.state == HALF_OPEN:
            self.state = OPEN
            self._cooldown = min(self.max_cooldown, self._cooldown * 2)
            self._retry_at = now + self._cooldown
            log.debug("%s still failing (%s); next trial in %.1fs", self.what, reason,
                      self._cooldown)
            return
        if self.state == OPEN:
            return  # a request sent before the breaker opened
        self._failures += 1
        if self._failures >= self.threshold:
            self.state = OPEN
            self.opens += 1
            self._opened_at = now
            self._cooldown = self.base_cooldown
            self._retry_at = now + self._cooldown
            metrics.SHARED_BREAKER_OPEN.set(1)
            metrics.SHARED_BREAKER_OPENS.inc()
            log.warning("%s is failing (%s): circuit breaker open, reads go to the origin "
                        "until it answers again", self.what, reason)

"""Readers that keep reading a mount while a fault happens, for the fault figures.

Each reader thread opens a file, reads it whole and compares it with the expected
bytes, over and over. Recorded: successful reads, failed reads (any OSError), wrong
bytes (bytes of successful reads that differ from the expected ones: must be 0),
the longest successful read, and when the last failure and the first success after
it happened (recovery).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path


class Readers:
    def __init__(self, root: Path, files: dict[str, bytes], threads: int = 4) -> None:
        self.root = root
        self.files = files
        self.threads = threads
        self.ok = 0
        self.failed = 0
        self.wrong_bytes = 0
        self.longest = 0.0
        self.last_failure: float | None = None
        self.first_ok_after_failure: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []

    def __enter__(self) -> Readers:
        for i in range(self.threads):
            t = threading.Thread(target=self._run, args=(i,), daemon=True)
            t.start()
            self._workers.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._workers:
            t.join(120)

    def _run(self, seed: int) -> None:
        keys = sorted(self.files)
        i = seed
        while not self._stop.is_set():
            key = keys[i % len(keys)]
            i += 1
            t0 = time.monotonic()
            try:
                with open(self.root / key, "rb") as f:
                    data = f.read()
            except OSError:
                with self._lock:
                    self.failed += 1
                    self.last_failure = time.monotonic()
                    self.first_ok_after_failure = None
                time.sleep(0.1)  # a reader retrying, not a busy loop
                continue
            took = time.monotonic() - t0
            expected = self.files[key]
            wrong = 0
            if data != expected:
                n = min(len(data), len(expected))
                wrong = (sum(a != b for a, b in zip(data[:n], expected[:n], strict=True))
                         + abs(len(data) - len(expected)))
            with self._lock:
                self.ok += 1
                self.wrong_bytes += wrong
                self.longest = max(self.longest, took)
                if self.last_failure is not None and self.first_ok_after_failure is None:
                    self.first_ok_after_failure = time.monotonic()

    def wait_for_success_after(self, since: float, timeout: float = 120) -> float:
        """Seconds from ``since`` to the first successful read after the last failure."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self.first_ok_after_failure is not None:
                    return self.first_ok_after_failure - since
                if self.last_failure is None and self.ok:
                    return 0.0
            time.sleep(0.01)
        raise AssertionError("the readers never succeeded again")

    def row(self, fault: str, recovery: str) -> str:
        """A docs/faults.md table row."""
        return (f"| {fault} | {self.failed} of {self.ok + self.failed} | {self.wrong_bytes} | "
                f"{self.longest:.2f} s | {recovery} |")

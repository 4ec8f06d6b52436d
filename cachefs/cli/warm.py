"""``cachefs warm``: drive a warm job in the daemon and show its progress.

On a terminal: one self-updating line (bytes, objects, rate, ETA). Otherwise a
log line every few seconds. Always a summary at the end; exit 1 if any object
failed (each failure listed), 0 otherwise.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from cachefs.config import format_size
from cachefs.control.client import (
    WARM_PARALLEL_MAX,
    find_mount,
    mount_path,
    relative_paths,
    request,
)
from cachefs.errors import CachefsError, ConfigError

#: Seconds of silence after which a warm gives up on the daemon: a live one reports progress
#: every half second (and waits at most a few seconds for a free connection slot), so only
#: a daemon that is stopped or wedged is silent this long.
IDLE_TIMEOUT = 60.0


def _eta(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _line(p: dict[str, Any], elapsed: float, check: bool) -> str:
    done, total = p["bytes_done"], p["bytes_total"]
    if check:
        return (f"{format_size(done)} of {format_size(total)} cached "
                f"({100 * done / total if total else 100:.1f}%), {p['objects_total']} objects")
    rate = p["bytes_fetched"] / elapsed if elapsed > 0 else 0.0
    left = total - done
    eta = left / rate if rate > 0 and p["listing_done"] else float("nan")
    pct = 100 * done / total if total else 0.0
    return (f"{format_size(done)} / {format_size(total)}{'' if p['listing_done'] else '+'} ({pct:.1f}%)  "
            f"{p['objects_done']}/{p['objects_total']} objects  {format_size(rate)}/s  "
            f"ETA {_eta(eta)}")


def _without_line_ending(line: str) -> str:
    """A manifest line less its ending: CRLF or LF (a lone CR is part of the path)."""
    if line.endswith("\r\n"):
        return line[:-2]
    return line[:-1] if line.endswith("\n") else line


def parse_shard(value: str) -> tuple[int, int]:
    """``I/N`` -> (I, N) with 0 <= I < N."""
    i_text, sep, n_text = value.partition("/")
    try:
        i, n = int(i_text), int(n_text)
    except ValueError:
        i, n = -1, 0
    if not sep or not 0 <= i < n:
        raise ConfigError(f"--shard {value!r}: expected I/N with 0 <= I < N (e.g. 0/4 on the "
                          "first of 4 nodes)")
    return i, n


def warm_main(mountpoint: str, paths: list[str], *, manifest: str | None, parallel: int,
              check: bool, shard: str | None = None) -> int:
    shard_in = parse_shard(shard) if shard is not None else None
    mp, sock = find_mount(mountpoint)
    if mount_path(mountpoint, mp) != mp:
        raise ConfigError(f"{mountpoint} is not a cachefs mount point (it is inside {mp})")
    if any(not p for p in paths):  # ("$DIR" unset: not the whole mount, as it would join)
        raise ConfigError("an empty path: give a path inside the mount (the mount point "
                          "itself for all of it)")
    wanted = [p if os.path.isabs(p) else os.path.join(mp, p) for p in paths]
    if manifest:
        try:
            # A line is a path exactly as written (a key may start or end with spaces),
            # less its line ending (LF or CRLF); empty lines and '#' comments are skipped.
            with open(manifest, encoding="utf-8", newline="") as f:
                lines = [ln for ln in map(_without_line_ending, f)
                         if ln and not ln.startswith("#")]
        except OSError as exc:
            raise ConfigError(f"cannot read manifest {manifest!r}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"manifest {manifest!r} is not UTF-8 text (one path per "
                              "line)") from None
        if not lines and not paths:  # (not the whole mount, as no path at all means)
            raise ConfigError(f"manifest {manifest!r} lists no path to warm")
        wanted += [ln if os.path.isabs(ln) else os.path.join(mp, ln) for ln in lines]
    rel = relative_paths(mp, wanted) if wanted else [""]
    if not 1 <= parallel <= WARM_PARALLEL_MAX:
        raise ConfigError(f"--parallel must be between 1 and {WARM_PARALLEL_MAX}")
    tty = sys.stderr.isatty()
    t0 = time.monotonic()
    last_log = 0.0
    final: dict[str, Any] | None = None
    message: dict[str, Any] = {"op": "warm", "paths": rel, "parallel": parallel, "check": check}
    if shard_in is not None:
        message["shard"] = list(shard_in)
    try:
        for reply in request(sock, message, timeout=IDLE_TIMEOUT):
            elapsed = time.monotonic() - t0
            if reply["event"] == "progress":
                if tty:
                    print("\r" + _line(reply, elapsed, check).ljust(100), end="",
                          file=sys.stderr, flush=True)
                elif elapsed - last_log >= 5:
                    last_log = elapsed
                    print("cachefs warm: " + _line(reply, elapsed, check), file=sys.stderr)
            elif reply["event"] == "done":
                final = reply
    except KeyboardInterrupt:
        print("\ncachefs warm: interrupted; run it again to resume", file=sys.stderr)
        return 130
    if tty:
        print(file=sys.stderr)
    if final is None:
        raise CachefsError("the cachefs daemon ended the warm request without a result")
    elapsed = time.monotonic() - t0
    if check:
        print(_line(final, elapsed, True))
    elif shard_in is not None:
        print(f"warmed shard {shard_in[0]}/{shard_in[1]}: {format_size(final['bytes_done'])} "
              f"of {final['objects_total']} objects resident, "
              f"{format_size(final['bytes_published'])} in the shared tier, "
              f"{format_size(final['bytes_fetched'])} fetched in {elapsed:.1f}s")
    else:
        print(f"warmed {final['objects_done']} of {final['objects_total']} objects, "
              f"{format_size(final['bytes_done'])} resident, {format_size(final['bytes_fetched'])} "
              f"fetched from S3 in {elapsed:.1f}s")
    for path, message in final["failed"]:
        print(f"failed: {path}: {message}", file=sys.stderr)
    if final["failed_count"] > len(final["failed"]):
        print(f"... and {final['failed_count'] - len(final['failed'])} more failures",
              file=sys.stderr)
    return 1 if final["failed_count"] else 0

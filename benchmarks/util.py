"""Small helpers shared by the harness: free ports, process accounting, waiting."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def stop_cleanly_on_signals() -> None:
    """SIGTERM and SIGHUP end the benchmark like Ctrl-C: its ``finally`` blocks unmount
    what it mounted and stop the servers it started (the default action would leave them)."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)



def free_ports(n: int) -> list[int]:
    """Return ``n`` distinct TCP ports free on 127.0.0.1 right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for(pred: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if pred():
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


@dataclass
class ProcSample:
    """CPU seconds (user+system, threads included) and memory of one process."""

    pid: int
    cpu_s: float
    rss_bytes: int
    peak_rss_bytes: int


def proc_sample(pid: int) -> ProcSample | None:
    """Read /proc/<pid>/stat and status; None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm may contain spaces: fields start after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    cutime, cstime = int(fields[13]), int(fields[14])
    rss = hwm = 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    return ProcSample(pid, (utime + stime + cutime + cstime) / CLK_TCK, rss, hwm)


@dataclass(frozen=True)
class ThreadSample:
    """One live thread of a process, from ``/proc/<pid>/task/<tid>``: its name ("main"
    for the main thread), context switches, CPU ticks and CPU seconds so far.

    ``cpu_s`` is the scheduler's own count of the time the thread ran (``schedstat``,
    nanoseconds), which is what to compare threads by. The ticks of ``stat`` are kept
    for the user/system split only: on this project's machines a thread that runs in
    bursts of microseconds between sleeps (an S3 thread waking for each answer) is
    rarely running at a tick, and its ticks showed 30 us per cold file where the
    scheduler counted ~600 us."""

    tid: str
    name: str
    voluntary: int
    involuntary: int
    user_ticks: int
    sys_ticks: int
    cpu_s: float


def thread_samples(pid: int) -> list[ThreadSample]:
    """The live threads of process ``pid`` (none when it is gone; a thread that ends while
    it is read is left out)."""
    out: list[ThreadSample] = []
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            try:  # (a kernel without schedstat: the ticks, whatever they miss)
                cpu_s = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                cpu_s = (int(fields[11]) + int(fields[12])) / CLK_TCK
            switches = {k: int(v) for k, v in (line.split(":") for line in status.splitlines()
                                               if line.endswith("ctxt_switches", 0, line.find(":")))}
            out.append(ThreadSample(
                tid, "main" if tid == str(pid) else stat[stat.index("(") + 1:stat.rindex(")")],
                switches.get("voluntary_ctxt_switches", 0),
                switches.get("nonvoluntary_ctxt_switches", 0), int(fields[11]), int(fields[12]),
                cpu_s))
    return out


def pids_with_arg(arg: str) -> list[int]:
    """PIDs whose command line contains ``arg`` as one exact argument."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if arg.encode() in argv:
            out.append(int(name))
    return out


def terminate(proc: subprocess.Popen, timeout: float = 10.0, group: bool = True) -> None:
    """SIGTERM (the process group when ``group``), then SIGKILL after ``timeout``."""
    if proc.poll() is not None:
        return

    def send(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)

    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        send(sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except KeyboardInterrupt:  # interrupted while stopping it: never leave it running
            send(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5.0)
            raise


def kill_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM one pid we started (found by exact command line), then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}") or _is_zombie(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
        return s[s.rindex(")") + 2] == "Z"
    except OSError:
        return True


def drop_caches() -> bool:
    """Drop the page cache (root only). Returns False when not permitted."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def is_mounted(path: str) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 1 and parts[1].encode().decode("unicode_escape") == real:
                return True
    return False


def fuse_usable() -> tuple[bool, str]:
    """Whether a FUSE mount can be made here, with the exact reason when not."""
    if not os.path.exists("/dev/fuse"):
        return False, "/dev/fuse does not exist"
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
        os.close(fd)
    except OSError as e:
        return False, f"/dev/fuse cannot be opened: {e}"
    import shutil

    if shutil.which("fusermount3") is None:
        return False, "fusermount3 is not installed (apt-get install fuse3)"
    return True, ""


@contextlib.contextmanager
def timed() -> Iterator[list[float]]:
    box = [time.monotonic()]
    yield box
    box.append(time.monotonic() - box[0])


def add_link_args(ap: Any, rtt_ms: float = 70.0) -> None:
    """The WAN emulator's link flags with the small-files issue's link as defaults: 70 ms
    RTT, 48 MB/s in total, 16 MB/s per connection (``args.rtt_ms``, ``args.bandwidth_MBps``,
    ``args.conn_bandwidth_MBps``)."""
    ap.add_argument("--rtt-ms", type=float, default=rtt_ms)
    ap.add_argument("--bandwidth-MBps", type=float, default=48.0)
    ap.add_argument("--conn-bandwidth-MBps", type=float, default=16.0)


def scrape_metrics(addr: str) -> dict[str, float]:
    """A cachefs /metrics endpoint as {sample name: value summed over labels}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def scrape_labeled(url: str) -> dict[str, float]:
    """Every sample of a /metrics page (``url``), its labels in its name:
    ``name{label=value,...}`` (sorted), or the bare name for a sample without labels."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def per_label(before: dict[str, float], after: dict[str, float], prefix: str,
              n: float) -> dict[str, float]:
    """The growth of every sample of ``prefix`` between two :func:`scrape_labeled` pages,
    divided by ``n``, by its (last) label's value ("all" for a sample without labels)."""
    out = {}
    for k, v in after.items():
        if k.startswith(prefix):
            d = v - before.get(k, 0.0)
            if d:
                label = k[len(prefix):].strip("{}").split("=", 1)[-1] or "all"
                out[label] = round(d / n, 3)
    return out


def write_rows(path: Path, args: Any, rows: list[dict[str, Any]]) -> None:
    """A benchmark's rows, with the arguments that made them, as JSON at ``path``
    (``--json``)."""
    import json

    path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                "rows": rows}, indent=2))

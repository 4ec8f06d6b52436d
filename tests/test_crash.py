"""A daemon killed with SIGKILL: the same mount command recovers, and the cache is reused."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from cachefs.control import registry
from tests.conftest import free_port, is_mounted, requires_fuse, run_cachefs, scrape
from tests.faultproxy import FaultProxy
from tests.readers import Readers

pytestmark = [requires_fuse, pytest.mark.fuse]

BLOCK = 64 * 1024


def daemon_pid(mp: Path) -> int:
    proc = run_cachefs("status", "--json", str(mp))
    assert proc.returncode == 0, proc.stderr
    return int(json.loads(proc.stdout)["pid"])


def wait_dead(pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} still alive")


def gets(addr: str) -> float:
    return scrape(addr).get('cachefs_s3_requests_total{op="get"}', 0.0)


def test_sigkill_during_a_fill_then_the_same_command_mounts_and_reuses_the_cache(
        bucket, s3_endpoint, tmp_path):
    client, name = bucket
    rnd = random.Random(5)
    files = {f"d/f{i:02d}.bin": rnd.randbytes(rnd.randrange(3 * BLOCK, 10 * BLOCK))
             for i in range(24)}  # ~3.6 MiB in ~130 blocks
    for key, data in files.items():
        client.put_object(Bucket=name, Key=key, Body=data)
    blocks = sum(-(-len(d) // BLOCK) for d in files.values())
    mp, cache = tmp_path / "mnt", tmp_path / "cache"
    mp.mkdir()
    with FaultProxy(s3_endpoint) as proxy:
        # Slow GETs down so that the kill lands while the fill is running.
        proxy.plan = lambda method, path, n: (time.sleep(0.05) if method == "GET" and
                                              "list-type" not in path else None) or "pass"
        addr = f"127.0.0.1:{free_port()}"
        command = ["mount", f"s3://{name}", str(mp), "--cache-dir", str(cache),
                   "--endpoint-url", proxy.url, "--block-size", "64K",
                   "--metrics-addr", addr]
        proc = run_cachefs(*command)
        assert proc.returncode == 0, proc.stderr
        readers = Readers(mp, files, threads=2)
        try:
            pid = daemon_pid(mp)
            warm = subprocess.Popen(
                [os.sys.executable, "-m", "cachefs", "warm", str(mp), "--parallel", "2"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            readers.__enter__()  # training readers, through the fill, the kill and the restart
            deadline = time.monotonic() + 60
            while gets(addr) < blocks // 4:
                assert time.monotonic() < deadline, "the fill did not start"
                time.sleep(0.02)
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            wait_dead(pid)
            assert is_mounted(mp)  # the dead mount stays behind
            with pytest.raises(OSError):
                os.listdir(mp)
            proxy.plan = lambda method, path, n: "pass"

            again = run_cachefs(*command)  # what systemd's Restart= does (after RestartSec)
            assert again.returncode == 0, again.stderr + (cache / "cachefs.log").read_text()[-3000:]
            recovery = readers.wait_for_success_after(killed_at)
            warm.wait(timeout=30)
            assert daemon_pid(mp) != pid
            for key, data in files.items():
                assert (mp / key).read_bytes() == data, key
            readers.stop()
            assert readers.wrong_bytes == 0 and readers.ok > 0
            print("\nFAULT-ROW " + readers.row("kill -9 of the daemon during a fill, then the "
                                              "same mount command", f"{recovery:.1f} s"))
            second = gets(addr)
            assert 0 < second < blocks, (second, blocks)  # the blocks filled before the kill
            print(f"FAULT-NOTE kill -9: {blocks} blocks; GETs after the restart {second:.0f}")
            metrics = scrape(addr)
            assert metrics["cachefs_dead_mounts_cleaned_total"] == 1
            log = (cache / "cachefs.log").read_text()
            assert len([ln for ln in log.splitlines() if "dead cachefs mount" in ln]) == 1
            status = json.loads(run_cachefs("status", "--json", str(mp)).stdout)
            assert status["dead_mounts_cleaned"] == 1 and status["background_errors"] == 0
            assert "started over a dead mount" in run_cachefs("status", str(mp)).stdout
        finally:
            readers.stop()
            run_cachefs("unmount", str(mp))
            if is_mounted(mp):
                subprocess.run(["fusermount3", "-u", "-z", str(mp)], check=False)


def kill_daemon(mp: Path) -> int:
    pid = daemon_pid(mp)
    os.kill(pid, signal.SIGKILL)
    wait_dead(pid)
    assert is_mounted(mp)
    return pid


def test_dead_mount_without_a_registry_entry_is_recognised(bucket, mount_factory):
    client, name = bucket
    client.put_object(Bucket=name, Key="a.txt", Body=b"alpha")
    m = mount_factory(f"s3://{name}")
    assert (m.path / "a.txt").read_bytes() == b"alpha"
    kill_daemon(m.path)
    for entry in Path(os.environ["CACHEFS_RUNTIME_DIR"]).glob("*.json"):
        entry.unlink()  # e.g. a cleaned /run: only the mount itself tells
    m.start()
    assert (m.path / "a.txt").read_bytes() == b"alpha"
    assert m.metric("cachefs_dead_mounts_cleaned_total") == 1
    assert "no daemon is registered" in m.log()


def test_a_live_cachefs_mount_is_refused(bucket, mount_factory, s3_endpoint, tmp_path):
    client, name = bucket
    client.put_object(Bucket=name, Key="a.txt", Body=b"alpha")
    m = mount_factory(f"s3://{name}")
    proc = run_cachefs("mount", f"s3://{name}", str(m.path), "--cache-dir",
                       str(tmp_path / "other-cache"), "--endpoint-url", s3_endpoint)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "already a live cachefs mount" in proc.stderr
    proc = run_cachefs("mount", f"s3://{name}", str(m.path), "--cache-dir",
                       str(tmp_path / "other-cache"), "--endpoint-url", s3_endpoint,
                       "--foreground")
    assert proc.returncode == 2 and "already a live cachefs mount" in proc.stderr
    assert (m.path / "a.txt").read_bytes() == b"alpha"
    assert m.metric("cachefs_dead_mounts_cleaned_total") == 0


def test_another_file_system_is_refused(bucket, s3_endpoint, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    _, name = bucket
    mp = tmp_path / "mnt"
    mp.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mp)], check=True)
    try:
        proc = run_cachefs("mount", f"s3://{name}", str(mp), "--cache-dir",
                           str(tmp_path / "cache"), "--endpoint-url", s3_endpoint)
        assert proc.returncode == 2
        assert proc.stderr.count("\n") == 1
        assert "already a mount point (tmpfs)" in proc.stderr
        assert registry_type(mp) == "tmpfs"
    finally:
        subprocess.run(["umount", str(mp)], check=False)


def registry_type(mp: Path) -> str | None:
    from cachefs.control import registry

    return registry.mount_type(mp)


class Systemd:
    """Runs the template unit's commands as systemd would for one instance: ExecStartPre,
    ExecStart (Type=notify: started once READY=1 arrives), and ExecStop when the main
    process ends, with /usr/local/bin/cachefs standing for this interpreter's cachefs."""

    def __init__(self, config: Path, tmp_path: Path) -> None:
        import shlex
        import socket as socket_mod

        from tests.test_deploy import CACHEFS, UNIT, unit_settings

        settings = unit_settings(UNIT.read_text())
        self.config = config

        def command(line: str) -> tuple[bool, list[str]]:
            ignore = line.startswith("-")
            argv = shlex.split(line.lstrip("-").replace("/etc/cachefs/%i.toml", str(config)))
            assert argv[0] == CACHEFS
            return ignore, [os.sys.executable, "-m", "cachefs", *argv[1:]]

        self.pre = [command(c) for c in settings.get("Service.ExecStartPre", [])]
        self.start_cmd = command(settings["Service.ExecStart"][0])[1]
        self.stop = [command(c) for c in settings.get("Service.ExecStop", [])]
        self.timeout = float(settings["Service.TimeoutStartSec"][0])
        self.notify_path = tmp_path / "notify.sock"
        self.notify = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.main: subprocess.Popen[bytes] | None = None
        self.log = tmp_path / "journal.log"

    def start(self) -> None:
        for ignore, argv in self.pre:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            assert ignore or proc.returncode == 0, proc.stderr
        env = dict(os.environ, NOTIFY_SOCKET=str(self.notify_path), PYTHONUNBUFFERED="1")
        with open(self.log, "ab") as journal:
            self.main = subprocess.Popen(self.start_cmd, env=env, stdout=journal,
                                         stderr=subprocess.STDOUT)
        self.notify.settimeout(self.timeout)
        while True:
            message = self.notify.recv(4096).decode()
            if "READY=1" in message:
                return
            assert self.main.poll() is None, self.output()

    def main_exited(self) -> None:
        for _ignore, argv in self.stop:  # systemd runs ExecStop even after a crash
            subprocess.run(argv, capture_output=True, text=True, timeout=60)

    def output(self) -> str:
        return self.log.read_text()

    def close(self) -> None:
        self.notify.close()


def test_systemd_unit_restart_after_sigkill_recovers(bucket, s3_endpoint, tmp_path):
    client, name = bucket
    data = random.Random(3).randbytes(5 * BLOCK + 7)
    client.put_object(Bucket=name, Key="ds/blob.bin", Body=data)
    mp, cache = tmp_path / "mnt", tmp_path / "cache"
    mp.mkdir()
    addr = f"127.0.0.1:{free_port()}"
    config = tmp_path / "demo.toml"
    config.write_text(f'source = "s3://{name}/ds"\nmountpoint = "{mp}"\ncache_dir = "{cache}"\n'
                      f'endpoint_url = "{s3_endpoint}"\nblock_size = "64K"\n'
                      f'metrics_addr = "{addr}"\n')
    unit = Systemd(config, tmp_path)
    try:
        unit.start()
        assert (mp / "blob.bin").read_bytes() == data
        deadline = time.monotonic() + 30
        while scrape(addr)["cachefs_cache_blocks"] < 6:  # written behind the reads
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first = unit.main
        assert first is not None
        reader = open(mp / "blob.bin", "rb")  # a training process still holds a file
        readers = Readers(mp, {"blob.bin": data}, threads=2).__enter__()
        killed_at = time.monotonic()
        first.kill()  # SIGKILL, as the OOM killer would
        first.wait(timeout=30)
        assert is_mounted(mp)
        unit.main_exited()  # ExecStop cannot unmount a busy mount
        assert is_mounted(mp)
        unit.start()  # Restart=on-failure (systemd waits RestartSec=5 first)
        recovery = readers.wait_for_success_after(killed_at)
        readers.stop()
        assert readers.wrong_bytes == 0
        print("\nFAULT-ROW " + readers.row("kill -9 under the systemd unit (ExecStop fails: a "
                                          "file is held open; restart)",
                                          f"{recovery:.1f} s + RestartSec (5 s)"))
        reader.close()  # (its reads may fail or come from the page cache)
        assert (mp / "blob.bin").read_bytes() == data
        assert gets(addr) == 0  # every block from the cache
        assert scrape(addr)["cachefs_dead_mounts_cleaned_total"] == 1
        assert unit.output().count("held a dead cachefs mount") == 1
        subprocess.run([*unit.stop[0][1]], check=True, timeout=60)
        assert unit.main is not None and unit.main.wait(timeout=60) == 0
        assert not is_mounted(mp)
    finally:
        unit.close()
        if unit.main is not None and unit.main.poll() is None:
            unit.main.kill()
        if is_mounted(mp):
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], check=False)


#: Signals whose default action ends a process, that an operator or a tool may send a
#: daemon by mistake: a log rotation's "kill -USR1", a terminal's hang-up, stray timer
#: signals (an alarm, a profiler's timer aimed at the wrong pid).
IGNORED = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGVTALRM,
           signal.SIGPROF)


def test_sighup_and_the_user_signals_leave_the_mount_serving(bucket, mount_factory):
    """SIGHUP, SIGUSR1 and SIGUSR2 (a log rotation's "kill -USR1"), and the timer signals
    SIGALRM, SIGVTALRM and SIGPROF, are logged and ignored: their default action ended
    the daemon and left a dead mount ("Transport endpoint is not connected")."""
    client, name = bucket
    client.put_object(Bucket=name, Key="a.txt", Body=b"alpha")
    m = mount_factory(f"s3://{name}")
    assert (m.path / "a.txt").read_bytes() == b"alpha"
    pid = daemon_pid(m.path)
    for sig in IGNORED:
        os.kill(pid, sig)
        time.sleep(0.1)  # (one at a time: signals of one kind pending together merge)
    deadline = time.monotonic() + 30
    while (m.log().count("; ignored (SIGTERM unmounts)") < len(IGNORED)
           and time.monotonic() < deadline):
        time.sleep(0.05)
    os.kill(pid, 0)  # (alive)
    assert m.log().count("; ignored (SIGTERM unmounts)") == len(IGNORED)
    client.put_object(Bucket=name, Key="b.txt", Body=b"beta")
    assert (m.path / "a.txt").read_bytes() == b"alpha"
    assert daemon_pid(m.path) == pid


@pytest.mark.parametrize("sig", [signal.SIGQUIT, signal.SIGXCPU], ids=["sigquit", "sigxcpu"])
def test_sigquit_and_sigxcpu_unmount_cleanly_like_sigterm(bucket, mount_factory, sig):
    """SIGQUIT (a terminal's Ctrl-\\, a process manager's stop signal) and SIGXCPU (the
    kernel's, at the soft CPU-time limit: LimitCPU=) ended the daemon by their default
    action (a core dump), leaving a dead mount ("Transport endpoint is not connected")
    that every reader then met. They now stop it as SIGTERM does: unmounted, nothing
    left behind."""
    client, name = bucket
    client.put_object(Bucket=name, Key="a.txt", Body=b"alpha")
    m = mount_factory(f"s3://{name}")
    assert (m.path / "a.txt").read_bytes() == b"alpha"
    pid = daemon_pid(m.path)
    os.kill(pid, sig)
    wait_dead(pid, timeout=60)
    dead_mount = is_mounted(m.path)
    if dead_mount:
        subprocess.run(["fusermount3", "-u", "-z", str(m.path)], check=False)
    assert not dead_mount, "the daemon left its mount behind"
    log = m.log()
    assert f"received {signal.Signals(sig).name}; unmounting" in log, log[-2000:]
    assert "Traceback" not in log


def _mount_held_once_made(bucket: Any, tmp_path: Path, s3_endpoint: str,
                          *extra: str) -> tuple[subprocess.Popen[str], Path, Path]:
    """``cachefs mount`` of ``bucket`` (one object, a.txt) at ``tmp_path/mnt`` with its
    cache in ``tmp_path/cache``, the daemon held at the failpoint ``mount.made`` (its mount
    made, its signal watcher not running yet) until the test removes
    ``holds/mount.made.hold``; returns (the command's process, the mount point, holds)."""
    import sys

    client, name = bucket
    client.put_object(Bucket=name, Key="a.txt", Body=b"alpha")
    mp = tmp_path / "mnt"
    mp.mkdir()
    holds = tmp_path / "failpoints"
    holds.mkdir()
    (holds / "mount.made.hold").touch()
    env = {**os.environ, "CACHEFS_FAILPOINTS": "mount.made",
           "CACHEFS_FAILPOINT_DIR": str(holds)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cachefs", "mount", f"s3://{name}", str(mp), "--cache-dir",
         str(tmp_path / "cache"), "--endpoint-url", s3_endpoint, *extra],
        stderr=subprocess.PIPE, text=True, env=env)
    return proc, mp, holds


def _wait_held(proc: subprocess.Popen[str], holds: Path) -> None:
    deadline = time.monotonic() + 120
    while not (holds / "mount.made.reached").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "not held"
        time.sleep(0.01)


def _outcome_once_let_go(proc: subprocess.Popen[str], mp: Path, holds: Path,
                         daemon: int) -> tuple[str, bool, bool]:
    """Let the daemon held with its mount made go on; once the mount command has ended
    and the daemon is gone (or 30 s passed): (the command's stderr, whether the daemon
    still runs, whether the mount is there)."""
    (holds / "mount.made.hold").unlink()
    _, err = proc.communicate(timeout=120)
    deadline = time.monotonic() + 30
    while registry.pid_alive(daemon) and time.monotonic() < deadline:
        time.sleep(0.05)
    return err, registry.pid_alive(daemon), is_mounted(mp)


def _clean_up(proc: subprocess.Popen[str], mp: Path, daemon: int) -> None:
    """Whatever a failed test left: the mount command, the daemon, the mount."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if daemon and registry.pid_alive(daemon):
        os.kill(daemon, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while is_mounted(mp) and time.monotonic() < deadline:
        time.sleep(0.05)
    if is_mounted(mp):
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], check=False)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGXCPU],
                         ids=["sigterm", "sigint", "sigquit", "sigxcpu"])
def test_a_stop_signal_just_after_the_mount_is_made_unmounts_cleanly(bucket, tmp_path,
                                                                      s3_endpoint, sig):
    """The daemon took SIGTERM and SIGINT only once its signal watcher ran, a moment
    after the mount was made: one arriving in between (a service manager stopping a
    unit that was just starting) ended it by the signal's default action (or a
    KeyboardInterrupt somewhere in the start-up), leaving a dead mount behind. The
    signal is now held from just before the mount until the watcher takes it, then
    acted on: the daemon unmounts and exits 0. (A failpoint holds the daemon in the
    window while the signal is sent.)"""
    proc, mp, holds = _mount_held_once_made(bucket, tmp_path, s3_endpoint, "--foreground")
    try:
        _wait_held(proc, holds)
        assert is_mounted(mp)
        proc.send_signal(sig)
        time.sleep(0.5)  # (the signal is delivered while the daemon is held)
        (holds / "mount.made.hold").unlink()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if is_mounted(mp):
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], check=False)
            unmounted_by_test = True
        else:
            unmounted_by_test = False
    assert proc.returncode == 0, f"ended with {proc.returncode}: {err}"
    assert not unmounted_by_test, "the daemon left its mount behind"
    assert "Traceback" not in err, err
    assert f"received {signal.Signals(sig).name}" in err, err


def test_sighup_and_the_user_signals_during_start_up_are_ignored_too(bucket, tmp_path):
    """The daemon took these signals only once it served: one arriving while it started
    (checking the bucket, reading a large index; a foreground daemon whose terminal
    closed, a log rotation's "kill -USR1" meeting a restart) ended it at once, by the
    signal's default action, with not a line said. They are ignored from the start. (S3
    is a socket that never answers here, so the start-up waits on it.)"""
    import socket
    import sys

    _, name = bucket
    mp = tmp_path / "mnt"
    mp.mkdir()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # (connections are made, never answered)
    port = silent.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "cachefs", "mount", f"s3://{name}", str(mp), "--cache-dir",
         str(tmp_path / "cache"), "--endpoint-url", f"http://127.0.0.1:{port}",
         "--foreground"], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:  # (the daemon has started its start-up checks)
            lines.append(line)
            if "open-file limit" in line:
                break
        for sig in IGNORED:
            proc.send_signal(sig)
        silent.close()  # (sent already: S3 now refuses, and the start-up fails at once)
        rest = proc.stderr.read()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        silent.close()
    assert code > 0, f"ended by signal {-code}: {''.join(lines)}{rest}"
    assert rest.strip().splitlines()[-1].startswith("cachefs: error: "), rest
    assert "Traceback" not in rest
    assert not is_mounted(mp)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_mount_command_stopped_while_it_waits_stops_its_daemon(bucket, tmp_path,
                                                                  s3_endpoint, sig):
    """`cachefs mount` (without --foreground) waits for its daemon to be ready. Stopped
    meanwhile (Ctrl-C at a slow start: a manifest loading, S3 across regions; `timeout`'s
    SIGTERM), it exited at once and quietly, and the daemon went on and mounted all the
    same, afterwards: the user who had given up found the mount there, and a second try
    'in use by another cachefs daemon'. It now stops its daemon (nothing stays mounted)
    and says so in one line. (A failpoint holds the daemon with its mount made.)"""
    proc, mp, holds = _mount_held_once_made(bucket, tmp_path, s3_endpoint)
    daemon = 0
    try:
        _wait_held(proc, holds)
        daemon = int((tmp_path / "cache" / "lock").read_text())
        proc.send_signal(sig)
        time.sleep(0.5)  # (the mount command acts on it while the daemon is held)
        err, daemon_alive, mounted = _outcome_once_let_go(proc, mp, holds, daemon)
    finally:
        _clean_up(proc, mp, daemon)
    assert not mounted and not daemon_alive, (mounted, daemon_alive, err)
    assert proc.returncode == 128 + sig, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("cachefs: error: "), err
    assert "stopped" in lines[0] and "Traceback" not in err


def test_a_mount_command_that_gives_up_waiting_stops_its_daemon(bucket, tmp_path, s3_endpoint):
    """`cachefs mount` waits for its daemon (180 s; `--start-timeout`). When it gave up
    (a large manifest, a slow index) it said 'did not become ready' and exited 1, and the
    daemon went on and mounted afterwards: an fstab mount or a script that had failed
    found the mount there later, and its next try 'in use by another cachefs daemon'. A
    mount command that fails leaves nothing: it now stops its daemon, says so and how to
    give the start more time. (A failpoint holds the daemon with its mount made, past a
    short wait.)"""
    proc, mp, holds = _mount_held_once_made(bucket, tmp_path, s3_endpoint,
                                            "--start-timeout", "2s")
    daemon = 0
    try:
        _wait_held(proc, holds)
        daemon = int((tmp_path / "cache" / "lock").read_text())
        time.sleep(4)  # (past the wait: the command has given up and stops its daemon)
        err, daemon_alive, mounted = _outcome_once_let_go(proc, mp, holds, daemon)
    finally:
        _clean_up(proc, mp, daemon)
    assert not mounted and not daemon_alive, (mounted, daemon_alive, err)
    assert proc.returncode == 1, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("cachefs: error: "), err
    assert "within 2s" in lines[0] and f"stopped its daemon (pid {daemon})" in lines[0]
    assert "--start-timeout" in lines[0] and "Traceback" not in err
    again = run_cachefs("mount", f"s3://{bucket[1]}", str(mp), "--cache-dir",
                        str(tmp_path / "cache"), "--endpoint-url", s3_endpoint)
    assert again.returncode == 0, again.stderr  # (the cache directory is free)
    assert run_cachefs("unmount", str(mp)).returncode == 0

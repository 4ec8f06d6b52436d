"""``cachefs status`` against a live mount."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import pytest

from cachefs.cache.objectfiles import allocation_unit
from cachefs.control import registry
from tests.conftest import is_mounted, run_cachefs

pytestmark = pytest.mark.fuse


def test_status_reports_a_live_mount(bucket, mount_factory, tmp_path):
    client, name = bucket
    client.put_object(Bucket=name, Key="ds/a.bin", Body=b"a" * 300_000)
    m = mount_factory(f"s3://{name}/ds", "--cache-size", "1G")
    assert (m.path / "a.bin").read_bytes() == b"a" * 300_000
    assert (m.path / "a.bin").read_bytes() == b"a" * 300_000
    deadline = time.monotonic() + 10
    while True:  # the daemon publishes its counters every second
        proc = run_cachefs("status", "--json", str(m.path))
        assert proc.returncode == 0, proc.stderr
        st = json.loads(proc.stdout)
        if st["s3_bytes"] >= 300_000 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert st["mountpoint"] == str(m.path)
    assert st["source"] == f"s3://{name}/ds/"
    assert st["cache_capacity_bytes"] == 1 << 30
    # the disk its one block takes: whole allocation units of the cache's file system
    unit = allocation_unit(m.cache_dir)
    assert st["cache_used_bytes"] == -(-300_000 // unit) * unit
    assert st["s3_bytes"] == 300_000
    assert st["read_bytes"] >= 300_000
    assert st["uptime_seconds"] >= 0
    assert 0.0 <= st["hit_ratio"] < 1.0
    assert st["shared"] is None  # no shared tier on this mount
    assert st["tier_read_bytes"]["s3"] > 0 and st["tier_loads"]["s3"] == 1

    table = run_cachefs("status")
    assert table.returncode == 0
    assert str(m.path) in table.stdout and f"s3://{name}/ds/" in table.stdout

    m.stop()
    gone = run_cachefs("status", "--json", str(m.path))
    assert gone.returncode == 1
    assert "not a live cachefs mount" in gone.stderr


def test_status_describes_the_tiers_and_the_shared_tier():
    from cachefs.cli.status import describe

    info = {
        "mountpoint": "/mnt/x", "source": "s3://b/", "pid": 1, "cache_dir": "/c",
        "stats": {"cachefs_shared_get_bytes_total": 4096.0,
                  "cachefs_shared_published_bytes_total": 8192.0,
                  "cachefs_shared_publish_queue_blocks": 2.0,
                  "cachefs_shared_publish_queue_bytes": 512.0},
        "tiers": {"read_bytes": {"memory": 1.0, "disk": 2.0, "shared": 4096.0, "s3": 9.0},
                  "loads": {"shared": 1.0, "s3": 3.0},
                  "shared_publishes": {"stored": 2.0, "dropped_full": 1.0,
                                       "dropped_unavailable": 4.0},
                  "shared_leases": {"won": 3.0, "lost_served": 1.0}},
        "shared": {"url": "s3://cache/p/", "breaker": "open", "publishing": False,
                   "leases": True, "conditional_writes": True},
    }
    d = describe(info, now=0.0)
    assert d["tier_read_bytes"] == {"memory": 1, "disk": 2, "shared": 4096, "s3": 9}
    sh = d["shared"]
    assert sh["url"] == "s3://cache/p/" and sh["breaker"] == "open"
    assert (sh["hit_bytes"], sh["published_blocks"], sh["dropped_blocks"]) == (4096, 2, 5)
    assert sh["queue_blocks"] == 2 and sh["lease_outcomes"] == {"won": 3, "lost_served": 1}


def test_status_shows_what_the_sweep_did(capsys, monkeypatch):
    from cachefs.cli import status

    info = {
        "mountpoint": "/mnt/x", "source": "s3://b/", "pid": 1, "cache_dir": "/c",
        "stats": {"cachefs_sweep_files_total": 1100.0, "cachefs_sweep_bytes_total": 121e6,
                  "cachefs_sweep_unread_bytes": 4e6},
        "sweep_stops": {"done": 1.0, "no_space": 0.0, "unread_bound": 2.0},
    }
    d = status.describe(info, now=0.0)
    assert (d["sweep_files"], d["sweep_bytes"], d["sweep_unread_bytes"]) == (1100, 121_000_000,
                                                                             4_000_000)
    assert d["sweep_stops_by_reason"] == {"done": 1, "unread_bound": 2}
    monkeypatch.setattr(status.registry, "cachefs_mounts", lambda: {"/mnt/x"})
    monkeypatch.setattr(status.registry, "all_mounts", lambda: [info])
    assert status.status_main(None, as_json=False) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  sweep"))
    assert "1100 files" in line and "stopped: done 1, unread_bound 2" in line


def test_status_says_when_fetch_leases_are_off_and_why(capsys, monkeypatch):
    """Without fetch leases, nodes that miss a block at once each fetch it across regions:
    the one copy per cluster an operator set the tier up for is not kept. The status
    table said nothing of it (the JSON had "leases": false)."""
    from cachefs.cli import status

    def shared_line(leases: bool, conditional: bool | None) -> list[str]:
        info = {"mountpoint": "/mnt/x", "source": "s3://b/", "pid": 1, "cache_dir": "/c",
                "stats": {}, "tiers": {},
                "shared": {"url": "s3://cache/p/", "breaker": "closed", "publishing": True,
                           "leases": leases, "conditional_writes": conditional}}
        monkeypatch.setattr(status.registry, "cachefs_mounts", lambda: {"/mnt/x"})
        monkeypatch.setattr(status.registry, "all_mounts", lambda: [info])
        assert status.status_main(None, as_json=False) == 0
        return [x.strip() for x in capsys.readouterr().out.splitlines()
                if "fetch leases off" in x]

    assert shared_line(True, True) == []
    assert shared_line(True, None) == []  # (not checked yet: leases are taken meanwhile)
    (line,) = shared_line(False, False)
    assert "does not honour conditional writes" in line and "from the origin" in line
    (line,) = shared_line(False, True)
    assert "turned off" in line


def _status(m) -> dict:  # type: ignore[no-untyped-def]
    proc = run_cachefs("status", "--json", str(m.path))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_an_idle_mount_stops_rewriting_its_snapshot_and_a_read_refreshes_it(bucket, mount_factory):
    """A snapshot collects every metric (milliseconds of CPU): taken every second while
    the mount works, not while it is idle (at most every STATUS_IDLE_INTERVAL then), and
    again at once when it works again."""
    client, name = bucket
    client.put_object(Bucket=name, Key="ds/a.bin", Body=b"a" * 1000)
    client.put_object(Bucket=name, Key="ds/b.bin", Body=b"b" * 2000)
    m = mount_factory(f"s3://{name}/ds")
    assert (m.path / "a.bin").read_bytes() == b"a" * 1000
    ages = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # idle: the snapshot ages past the busy interval
        ages.append(_status(m)["stats_age_seconds"])
        if ages[-1] >= 2.5:
            break
        time.sleep(0.5)
    assert ages[-1] >= 2.5, f"an idle mount rewrote its snapshot every second: {ages}"
    assert _status(m)["s3_bytes"] == 1000
    assert (m.path / "b.bin").read_bytes() == b"b" * 2000
    deadline = time.monotonic() + 5
    while (st := _status(m))["s3_bytes"] < 3000 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert st["s3_bytes"] == 3000, "a read of an idle mount did not refresh its snapshot"
    assert st["stats_age_seconds"] < 2.5


@pytest.mark.parametrize("how", ["unmount", "lazy"])
def test_a_stopped_mount_leaves_nothing_in_the_runtime_directory(bucket, mount_factory, how):
    """Its registry entry and its control socket both go: a node that mounts and unmounts
    many times (a mount per job) does not collect dead sockets."""
    client, name = bucket
    client.put_object(Bucket=name, Key="a.bin", Body=b"a")
    m = mount_factory(f"s3://{name}")
    sock = registry.control_socket(m.path)
    run, me = sock.parent, sock.stem
    assert sorted(p.name for p in run.iterdir() if p.stem == me) == [f"{me}.json", f"{me}.sock"]
    if how == "unmount":
        proc = run_cachefs("unmount", str(m.path))
        assert proc.returncode == 0, proc.stderr
    else:
        subprocess.run(["fusermount3", "-u", "-z", str(m.path)], check=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
            is_mounted(m.path) or any(p.stem == me for p in run.iterdir())):
        time.sleep(0.05)
    assert sorted(p.name for p in run.iterdir() if p.stem == me) == []


def test_status_says_which_reads_the_hit_ratio_counts(capsys, monkeypatch):
    """Files opened for the kernel to read (passthrough, the C loop) count whole in the hit
    ratio while the daemon sees none of their reads: the line says both, so the ratio and
    the bytes read agree ("reads 152 MiB, byte hit ratio 99.3%, 152 MiB from S3" did not)."""
    from cachefs.cli import status

    mib = 1 << 20
    info = {
        "mountpoint": "/mnt/x", "source": "s3://b/", "pid": 1, "cache_dir": "/c",
        "stats": {"cachefs_read_bytes_total": 152.0 * mib,
                  "cachefs_cache_miss_bytes_total": 152.0 * mib,
                  "cachefs_cache_hit_bytes_total": 20 * 1024.0 * mib,
                  "cachefs_s3_bytes_total": 152.0 * mib},
    }
    d = status.describe(info, now=0.0)
    assert d["kernel_opened_bytes"] == 20 * 1024 * mib
    monkeypatch.setattr(status.registry, "cachefs_mounts", lambda: {"/mnt/x"})
    monkeypatch.setattr(status.registry, "all_mounts", lambda: [info])
    assert status.status_main(None, as_json=False) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  reads"))
    assert line.startswith("  reads   152.0 MiB by the daemon + 20.0 GiB of files opened for "
                           "the kernel to read from the cache; byte hit ratio 99.3%"), line


def _a_live_and_a_dead_mount(bucket: Any, mount_factory: Any) -> tuple[Any, Any, int]:
    """Two mounts of one bucket, the second's daemon killed with SIGKILL (its mount left
    behind): (live mount, dead mount, the dead daemon's pid)."""
    import os
    import signal

    client, name = bucket
    client.put_object(Bucket=name, Key="a.bin", Body=b"a")
    live = mount_factory(f"s3://{name}")
    dead = mount_factory(f"s3://{name}")
    pid = int(registry.lookup(dead.path)["pid"])
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while registry.pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert is_mounted(dead.path)
    return live, dead, pid


def test_status_names_a_dead_mount_and_fails(bucket, mount_factory):
    """A daemon killed with SIGKILL (the OOM killer) leaves its mount dead ('Transport
    endpoint is not connected'). 'cachefs status' left it out and exited 0, so a node's
    health check saw nothing wrong; 'cachefs status MP' said only 'not a live cachefs
    mount'. Now both name it as dead, with the dead pid and what recovers it, and exit 1."""
    live, dead, pid = _a_live_and_a_dead_mount(bucket, mount_factory)

    table = run_cachefs("status")
    assert table.returncode == 1, (table.stdout, table.stderr)
    assert str(live.path) in table.stdout  # the live one is still described
    assert f"{dead.path} is a dead cachefs mount (daemon pid {pid} is gone)" in table.stderr
    assert "cachefs unmount --lazy" in table.stderr and "Traceback" not in table.stderr
    as_json = run_cachefs("status", "--json")
    assert as_json.returncode == 1 and str(dead.path) in as_json.stderr
    assert str(live.path) in {row["mountpoint"] for row in json.loads(as_json.stdout)}
    one = run_cachefs("status", str(dead.path))
    assert one.returncode == 1 and one.stderr.count("\n") == 1, one.stderr
    assert f"{dead.path} is a dead cachefs mount (daemon pid {pid} is gone)" in one.stderr


def test_status_names_a_dead_mount_whose_pid_another_process_took(bucket, mount_factory):
    """The pid of a daemon killed with SIGKILL is free for the next process (a busy node
    recycles pids within minutes). 'cachefs status' took any process with that pid for
    the daemon: the dead mount was shown as live, from its last snapshot, and never
    named as dead. The pid must name a cachefs daemon. (A process that took the pid is
    emulated by writing the pid of a 'sleep' into the dead mount's registry entry.) A live
    mount whose pid names no cachefs daemon here (its daemon runs in another pid namespace,
    a container's) still answers, and is not called dead."""
    live, dead, _ = _a_live_and_a_dead_mount(bucket, mount_factory)
    entry = registry.control_socket(dead.path).with_suffix(".json")
    live_entry = registry.control_socket(live.path).with_suffix(".json")
    live_text = live_entry.read_text()
    other = subprocess.Popen(["sleep", "300"])
    try:
        for path in (entry, live_entry):
            info = json.loads(path.read_text())
            info["pid"] = other.pid
            path.write_text(json.dumps(info))

        table = run_cachefs("status")
        assert table.returncode == 1, (table.stdout, table.stderr)
        assert str(dead.path) not in table.stdout
        assert f"{dead.path} is a dead cachefs mount (daemon pid {other.pid} is gone)" \
            in table.stderr, table.stderr
        one = run_cachefs("status", "--json", str(dead.path))
        assert one.returncode == 1 and one.stderr.count("\n") == 1, one.stderr
        assert f"{dead.path} is a dead cachefs mount" in one.stderr
        assert str(live.path) in table.stdout and f"{live.path} is a dead" not in table.stderr
        assert run_cachefs("status", str(live.path)).returncode == 0
    finally:
        live_entry.write_text(live_text)
        other.kill()
        other.wait()


def test_status_of_a_hung_daemon_says_its_figures_are_old_and_fails(bucket, mount_factory):
    """A daemon that stops (SIGSTOP here; a wedged one alike) stops publishing its snapshot,
    but 'cachefs status' went on showing the last one as current and exited 0, so the
    DaemonSet's readiness probe ('cachefs status --json MP') kept a hung node ready. A
    live daemon publishes every 10 s at least; a snapshot older than STALE_AFTER is now
    named on stderr and status exits 1. The snapshot's age is set by rewriting its time
    while the daemon is stopped (waiting for it would take a minute)."""
    import os
    import signal

    from cachefs.cli.status import STALE_AFTER

    client, name = bucket
    client.put_object(Bucket=name, Key="a.bin", Body=b"a")
    m = mount_factory(f"s3://{name}")
    info = registry.lookup(m.path)
    pid = int(info["pid"])
    entry = registry.control_socket(m.path).with_suffix(".json")
    os.kill(pid, signal.SIGSTOP)
    try:
        info = json.loads(entry.read_text())
        info["updated_at"] = time.time() - STALE_AFTER - 240
        entry.write_text(json.dumps(info))
        for args in (["status", str(m.path)], ["status", "--json", str(m.path)], ["status"]):
            proc = run_cachefs(*args)
            assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
            assert f"{m.path}: the cachefs daemon (pid {pid}) has published no figures for " \
                   f"{(STALE_AFTER + 240) // 60:.0f}m" in proc.stderr, proc.stderr
            assert str(m.path) in proc.stdout  # still described, as of its last snapshot
    finally:
        os.kill(pid, signal.SIGCONT)


def test_status_and_unmount_of_a_symbolic_link_to_the_mount(bucket, mount_factory, tmp_path):
    """'cachefs status LINK' and 'cachefs unmount LINK' (LINK -> the mount point, as
    /data -> /mnt/cachefs/data) said 'not a (live) cachefs mount', though umount(8) takes
    the link; both now follow it."""
    client, name = bucket
    client.put_object(Bucket=name, Key="a.bin", Body=b"a")
    m = mount_factory(f"s3://{name}")
    (tmp_path / "links").mkdir()
    link = tmp_path / "links" / "data"
    link.symlink_to(m.path)
    (tmp_path / "hop").symlink_to(tmp_path / "links")  # a link in the folders too
    proc = run_cachefs("status", "--json", str(tmp_path / "hop" / "data"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["mountpoint"] == str(m.path)
    proc = run_cachefs("unmount", str(link))
    assert proc.returncode == 0, proc.stderr
    deadline = time.monotonic() + 30
    while is_mounted(m.path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_mounted(m.path)


def test_a_mount_made_through_a_symbolic_link_is_found_by_every_command(bucket, s3_endpoint,
                                                                       tmp_path):
    """'cachefs mount s3://b /data' with /data a link to the real directory (a node's
    /data -> /mnt/nvme/data): the kernel mounts at the real path, but the daemon registered
    itself, its control socket and its readahead under the link's. 'cachefs status' then
    said 'not a live cachefs mount', 'cachefs warm' 'has no control socket' (and so the
    sampler's hints went nowhere), and the mount kept the kernel's 128 KiB readahead
    ('could not find ... in mountinfo'). The mount point is now the real path."""
    client, name = bucket
    client.put_object(Bucket=name, Key="a.bin", Body=b"a" * 1000)
    real = tmp_path / "nvme" / "data"
    real.mkdir(parents=True)
    link = tmp_path / "data"
    link.symlink_to(real)
    proc = run_cachefs("mount", f"s3://{name}", str(link), "--cache-dir",
                       str(tmp_path / "cache"), "--endpoint-url", s3_endpoint)
    try:
        assert proc.returncode == 0, proc.stderr
        assert is_mounted(real)
        for where in (real, link):
            st = run_cachefs("status", "--json", str(where))
            assert st.returncode == 0, st.stderr
            assert json.loads(st.stdout)["mountpoint"] == str(real)
        warm = run_cachefs("warm", str(link))
        assert warm.returncode == 0, warm.stderr
        assert "warmed 1 of 1 objects" in warm.stdout
        log = (tmp_path / "cache" / "cachefs.log").read_text()
        assert "to set its readahead" not in log, log
        assert run_cachefs("unmount", str(link)).returncode == 0
    finally:
        if is_mounted(real):
            subprocess.run(["fusermount3", "-u", "-z", str(real)], check=False)


def test_status_names_the_metrics_port_the_kernel_chose(bucket, mount_factory):
    """'--metrics-addr 127.0.0.1:0' (a free port, for several mounts on a node) served on
    the port the kernel chose, but 'cachefs status' named port 0, so nothing could find
    the endpoint from it. The registry now holds the address served."""
    from tests.conftest import scrape

    client, name = bucket
    client.put_object(Bucket=name, Key="a.bin", Body=b"a")
    # (the flag given last wins over the fixture's own --metrics-addr)
    other = mount_factory(f"s3://{name}", "--metrics-addr", "127.0.0.1:0")
    addr = json.loads(run_cachefs("status", "--json", str(other.path)).stdout)["metrics_addr"]
    host, port = addr.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0, addr
    assert "cachefs_cache_capacity_bytes" in scrape(addr)


@pytest.mark.parametrize("args", [["status", ""], ["status", "--json", ""]],
                         ids=["text", "json"])
def test_status_of_an_empty_path_is_refused_not_the_current_directory(bucket, mount_factory,
                                                                      args):
    """'cachefs status "$MNT"' with MNT unset or empty reported the mount the shell was
    in (the empty path taken as the current directory), or said the current directory was
    not a live cachefs mount. An empty path is one line and exit 2, as 'cachefs warm' does."""
    import sys

    client, name = bucket
    client.put_object(Bucket=name, Key="a.bin", Body=b"a")
    m = mount_factory(f"s3://{name}")
    proc = subprocess.run([sys.executable, "-m", "cachefs", *args], capture_output=True,
                          text=True, timeout=120, cwd=m.path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cachefs: error: "), proc.stderr
    assert "empty path" in lines[0]
    assert proc.stdout == ""


def test_a_mount_made_over_a_lazily_unmounted_one_keeps_its_entry_and_socket(bucket,
                                                                           mount_factory,
                                                                           tmp_path):
    """'umount -l' (what an operator does when an unmount says 'target is busy') detaches a
    mount whose files are still open: its daemon runs on until they are closed. A new mount
    at the same mount point, made meanwhile, was then shown with the old daemon's figures
    (its snapshots, every 10 s, overwrote the new daemon's entry), and when the old daemon
    ended it removed the new one's entry and control socket: 'cachefs status' said 'not a
    live cachefs mount' and 'cachefs warm' found no socket, for a mount that served."""
    from tests.conftest import Mount

    client, name = bucket
    client.put_object(Bucket=name, Key="a.bin", Body=b"a" * 5000)
    old = mount_factory(f"s3://{name}")
    old_pid = int(registry.lookup(old.path)["pid"])
    held = open(old.path / "a.bin", "rb")  # (held across the remount)
    try:
        assert held.read(10) == b"a" * 10
        subprocess.run(["fusermount3", "-u", "-z", str(old.path)], check=True)
        assert not is_mounted(old.path) and registry.pid_alive(old_pid)
        new = Mount(old.source, old.path, tmp_path / "cache-new", old.endpoint, [])
        new.start()
        try:
            new_pid = int((new.cache_dir / "lock").read_text())  # (the daemon holding it)
            assert new_pid != old_pid and registry.pid_alive(new_pid)
            # Past the old daemon's idle snapshot interval: the entry stays the new one's.
            deadline = time.monotonic() + 12
            while time.monotonic() < deadline:
                entry = registry.entry(new.path) or {}
                assert entry.get("pid") == new_pid, f"the entry is pid {entry.get('pid')}'s"
                time.sleep(0.2)
            assert held.read() == b"a" * 4990  # the detached mount still serves its file
        finally:
            held.close()
            held = None
            deadline = time.monotonic() + 30
            while registry.pid_alive(old_pid):
                assert time.monotonic() < deadline, "the detached daemon never ended"
                time.sleep(0.1)
            ended = (registry.entry(new.path) or {}).get("pid")
            socket_left = registry.control_socket(new.path).exists()
            status = run_cachefs("status", str(new.path))
            warm = run_cachefs("warm", str(new.path), "a.bin")
            new.stop()
        assert ended == new_pid and socket_left
        assert status.returncode == 0, status.stderr
        assert f"(pid {new_pid}," in status.stdout and str(tmp_path / "cache-new") in status.stdout
        assert warm.returncode == 0, warm.stderr
    finally:
        if held is not None:
            held.close()


def test_a_daemon_detached_by_a_lazy_unmount_is_listed_until_it_ends(bucket, mount_factory):
    """After 'umount -l' with a file open, the daemon runs on until the file is closed,
    holding its cache directory ('cachefs mount' of it: 'in use by another cachefs
    daemon'), and no command showed it: 'cachefs status' said 'no cachefs mounts'. It is
    listed now as detached, with its pid, open handles and cache directory, in text and
    in --json, and named where the cache directory is refused, until it ends."""
    from tests.conftest import Mount

    client, name = bucket
    client.put_object(Bucket=name, Key="a.bin", Body=b"a" * 5000)
    old = mount_factory(f"s3://{name}/")
    old_pid = int(registry.lookup(old.path)["pid"])
    held = open(old.path / "a.bin", "rb")
    try:
        assert held.read(10) == b"a" * 10
        subprocess.run(["fusermount3", "-u", "-z", str(old.path)], check=True)
        assert not is_mounted(old.path) and registry.pid_alive(old_pid)
        deadline = time.monotonic() + 15
        while True:  # (the daemon sees its mount leave the mount table within a second)
            rows = json.loads(run_cachefs("status", "--json").stdout)
            mine = [r for r in rows if r["pid"] == old_pid]
            if mine or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(mine) == 1, rows
        row = mine[0]
        assert row["detached"] is True and row["mountpoint"] == str(old.path)
        assert row["cache_dir"] == str(old.cache_dir) and row["open_handles"] == 1
        assert row["detached_seconds"] >= 0

        table = run_cachefs("status")
        assert table.returncode == 0, table.stderr
        assert f"{old.path} (detached)" in table.stdout and f"pid {old_pid}," in table.stdout
        assert str(old.cache_dir) in table.stdout and "1 open file handle" in table.stdout
        one = run_cachefs("status", str(old.path))
        assert one.returncode == 1
        assert "not a live cachefs mount" in one.stderr
        assert f"pid {old_pid}) runs on detached" in one.stderr

        again = Mount(old.source, old.path, old.cache_dir, old.endpoint, [])
        refused = run_cachefs("mount", again.source, str(again.path), "--cache-dir",
                              str(again.cache_dir), "--endpoint-url", again.endpoint)
        assert refused.returncode != 0 and not is_mounted(old.path)
        assert f"(pid {old_pid}), detached from {old.path} by a lazy unmount" in refused.stderr

        assert held.read() == b"a" * 4990  # (the detached daemon still serves its file)
    finally:
        held.close()
    deadline = time.monotonic() + 30
    while registry.pid_alive(old_pid):
        assert time.monotonic() < deadline, "the detached daemon never ended"
        time.sleep(0.1)
    rows = json.loads(run_cachefs("status", "--json").stdout)
    assert [r for r in rows if r["pid"] == old_pid] == []
    assert list(registry.runtime_dir().glob(f"{old_pid}.detached")) == []

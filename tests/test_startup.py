"""Start-up checks without FUSE: how a cachefs mount at the mount point is judged, and the
modes of the cache directory (the real-mount cases are in test_crash.py and
test_local_users.py)."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

import pytest

from cachefs import startup
from cachefs.errors import ConfigError


@pytest.mark.parametrize("answer,daemon_alive,state", [
    ("ok", True, "live"),
    ("ok", False, "live"),  # something answers: never detach it
    (errno.ENOTCONN, False, "dead"),
    (errno.ENOTCONN, True, "dead"),  # the connection was aborted: nobody can serve it
    (errno.ECONNABORTED, False, "dead"),
    ("timeout", False, "dead"),  # no answer and the daemon is gone
    ("timeout", True, "hung"),  # no answer, but its daemon runs: refuse, do not detach
    (errno.EACCES, False, "live"),  # another user's mount answered
])
def test_mount_state(monkeypatch, tmp_path, answer, daemon_alive, state):
    monkeypatch.setattr(startup, "_probe", lambda path, timeout: answer)
    monkeypatch.setattr(startup.registry, "pid_alive", lambda pid: daemon_alive)
    assert startup._mount_state(tmp_path, 4242) == state


def test_mount_state_without_a_registered_daemon(monkeypatch, tmp_path):
    monkeypatch.setattr(startup, "_probe", lambda path, timeout: "timeout")
    assert startup._mount_state(tmp_path, 0) == "dead"


def test_other_file_systems_and_live_mounts_are_refused_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(startup.registry, "mount_type", lambda path: "nfs4")
    with pytest.raises(ConfigError, match=r"already a mount point \(nfs4\)"):
        startup.check_mountpoint(tmp_path)
    monkeypatch.setattr(startup.registry, "mount_type", lambda path: "fuse.cachefs")
    monkeypatch.setattr(startup, "_mount_state", lambda path, pid: "live")
    with pytest.raises(ConfigError, match="already a live cachefs mount"):
        startup.check_mountpoint(tmp_path)
    monkeypatch.setattr(startup, "_mount_state", lambda path, pid: "hung")
    with pytest.raises(ConfigError, match="does not answer"):
        startup.check_mountpoint(tmp_path)


def test_the_parent_leaves_a_dead_mount_to_the_daemon(monkeypatch, tmp_path):
    monkeypatch.setattr(startup.registry, "mount_type", lambda path: "fuse.cachefs")
    monkeypatch.setattr(startup, "_mount_state", lambda path, pid: "dead")
    monkeypatch.setattr(startup, "_detach", lambda path: pytest.fail("the parent detached"))
    assert startup.check_mountpoint(tmp_path, clean_dead=False) is True


def test_the_probe_gives_up_on_a_mount_that_never_answers(monkeypatch, tmp_path):
    import threading

    never = threading.Event()
    monkeypatch.setattr(startup.os, "statvfs", lambda path: never.wait(30))
    try:
        assert startup._probe(tmp_path, 0.2) == "timeout"
    finally:
        never.set()


def test_cache_dir_is_created_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        startup.prepare_cache_dir(tmp_path / "a" / "cache", 1 << 20)
        with startup.lock_cache_dir(tmp_path / "a" / "cache"):
            lock = tmp_path / "a" / "cache" / "lock"
            assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a" / "cache").stat().st_mode) == 0o700
    # The parents it made are closed to other users' writes too (they were 0777 under umask 0:
    # anyone could then move the cache directory aside and put their own in its place).
    assert not (tmp_path / "a").stat().st_mode & 0o022


def test_a_cache_dir_open_to_others_is_tightened_with_one_log_line(tmp_path, caplog):
    cache = tmp_path / "cache"
    (cache / "meta.lmdb").mkdir(parents=True)
    (cache / "objects").mkdir()
    for name in ("lock", "cachefs.log", "meta.lmdb/data.mdb", "meta.lmdb/lock.mdb"):
        (cache / name).write_text("x")
        (cache / name).chmod(0o644)
    for d in (cache, cache / "meta.lmdb", cache / "objects"):
        d.chmod(0o755)
    with caplog.at_level(logging.INFO, logger="cachefs.startup"):
        startup.prepare_cache_dir(cache, 1 << 20)
        startup.prepare_cache_dir(cache, 1 << 20)  # nothing left to do: no second line
    assert len([r for r in caplog.records if "open to other local users" in r.getMessage()]) == 1
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    for name in ("meta.lmdb", "objects"):
        assert stat.S_IMODE((cache / name).stat().st_mode) == 0o700
    for name in ("lock", "cachefs.log", "meta.lmdb/data.mdb", "meta.lmdb/lock.mdb"):
        assert stat.S_IMODE((cache / name).stat().st_mode) == 0o600


def test_a_node_identity_is_made_once_per_cache_dir_and_kept(tmp_path, monkeypatch):
    """The shared tier's node identity (what fetch leases hold) survives restarts on one
    cache directory, differs between cache directories and between hosts, and is kept
    private; an unreadable one is made anew."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        startup.prepare_cache_dir(d, 1 << 20)
    first = startup.node_identity(a)
    assert startup.node_identity(a) == first  # a restart: the same node
    assert startup.node_identity(b) != first  # another daemon on this host
    assert stat.S_IMODE((a / "node-id").stat().st_mode) == 0o600
    assert sorted(p.name for p in a.iterdir()) == ["node-id"]  # no temporary left
    monkeypatch.setattr(startup.socket, "gethostname", lambda: "other-host")
    copied = startup.node_identity(a)  # the directory copied to another host
    assert copied != first and copied.split(":")[1] == first.split(":")[1]
    (a / "node-id").write_text("garbage")
    assert startup.node_identity(a) not in (first, copied)


def test_a_node_name_given_stands_for_the_host_name(tmp_path, monkeypatch):
    """In a Kubernetes pod without hostNetwork the host's name is the pod's, and a pod
    that replaces another on its node (a rollout) has a new one: with the node's name
    given (--node-name, from the downward API), the identity is the node's across pods
    on one cache directory, and still another for another node."""
    a = tmp_path / "a"
    startup.prepare_cache_dir(a, 1 << 20)
    monkeypatch.setattr(startup.socket, "gethostname", lambda: "cachefs-x7k2p")
    first = startup.node_identity(a, "ip-10-0-1-17")
    monkeypatch.setattr(startup.socket, "gethostname", lambda: "cachefs-q9w4m")  # replaced
    assert startup.node_identity(a, "ip-10-0-1-17") == first
    assert first.startswith("ip-10-0-1-17:")
    assert startup.node_identity(a, "ip-10-0-1-18") != first  # (copied to another node)
    assert startup.node_identity(a) == f"cachefs-q9w4m:{first.split(':')[1]}"


def test_a_cache_dir_inside_a_file_is_one_clear_error(tmp_path):
    from cachefs.errors import CacheError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CacheError, match="cannot create cache directory"):
        startup.prepare_cache_dir(blocker / "cache", 1 << 20)


def test_zombies_are_not_alive():
    import subprocess

    from cachefs.control import registry

    child = subprocess.Popen(["true"])
    while True:  # exited, not yet reaped: a zombie
        with open(f"/proc/{child.pid}/stat", "rb") as f:
            if f.read().rpartition(b")")[2].split()[0] == b"Z":
                break
    assert not registry.pid_alive(child.pid)
    child.wait()
    assert not registry.pid_alive(child.pid)
    assert registry.pid_alive(os.getpid())
    assert not registry.pid_alive(0)


def test_mount_type_reads_mountinfo():
    from cachefs.control import registry

    assert registry.mount_type(Path("/proc")) == "proc"
    assert registry.mount_type(Path("/proc/self")) is None

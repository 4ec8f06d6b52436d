"""Another local user (nobody, via setpriv) next to a cachefs mount made by root.

It may read through the mount what the mount's modes allow (with --allow-other), and
nothing else: not the cached bytes, not the index, not the log, not the control socket.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port, is_mounted, requires_fuse, run_cachefs, scrape
from tests.readers import Readers

pytestmark = [requires_fuse, pytest.mark.fuse]

NOBODY = 65534
OTHER = 65533  # in no group the mount names
PY = "/usr/bin/python3"  # runnable by any user (the test's own interpreter may not be)

PROBE = textwrap.dedent('''
    import json, os, socket, sys
    args = json.loads(sys.argv[1])
    out = {}
    def attempt(name, fn):
        try:
            out[name] = ["ok", fn()]
        except OSError as exc:
            out[name] = ["error", exc.errno]
    def read(p):
        with open(p, "rb") as f:
            return len(f.read())
    for i, p in enumerate(args["files"]):
        attempt(f"mount_read_{i}", lambda p=p: read(p))
    attempt("cache_listdir", lambda: os.listdir(args["cache"]))
    for i, p in enumerate(args["cache_files"]):
        attempt(f"cache_read_{i}", lambda p=p: read(p))
    def talk():
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        s.connect(args["socket"])
        try:
            s.sendall(b'{"op": "warm", "paths": [""]}\\n')
        except OSError:
            pass  # the daemon may answer and hang up first
        return s.recv(65536).decode()
    attempt("control", talk)
    print(json.dumps(out))
''')


@pytest.fixture
def shared_base(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory every user may traverse (pytest's own tmp dirs are private), holding
    the mount point, the cache dir and the runtime dir: so only cachefs's own modes stand
    between the other user and the files."""
    if os.geteuid() != 0:
        pytest.skip("acting as another user needs root (setpriv)")
    for tool in ("setpriv", PY):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    base = Path(tempfile.mkdtemp(prefix="cachefs-users-", dir="/tmp"))
    base.chmod(0o755)
    (base / "run").mkdir(mode=0o755)
    (base / "run").chmod(0o755)
    monkeypatch.setenv("CACHEFS_RUNTIME_DIR", str(base / "run"))
    yield base
    for mp in base.glob("mnt*"):
        if is_mounted(mp):
            run_cachefs("unmount", str(mp))
        if is_mounted(mp):
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], check=False)
    shutil.rmtree(base, ignore_errors=True)


def as_user(uid: int, gid: int, args: dict[str, object]) -> dict[str, list[object]]:
    proc = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", PY, "-c", PROBE,
         json.dumps(args)], capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    result: dict[str, list[object]] = json.loads(proc.stdout)
    return result


def mount_as_root(base: Path, source: str, endpoint: str, *extra: str, umask: int = 0) -> Path:
    mp = base / "mnt"
    mp.mkdir()
    mp.chmod(0o755)
    proc = subprocess.run(
        [os.sys.executable, "-m", "cachefs", "mount", source, str(mp), "--cache-dir",
         str(base / "cache"), "--endpoint-url", endpoint, *extra],
        capture_output=True, text=True, timeout=120, preexec_fn=lambda: os.umask(umask))
    assert proc.returncode == 0, proc.stderr
    return mp


def test_another_user_reads_through_the_mount_only(bucket, s3_endpoint, shared_base):
    from cachefs.control import registry

    client, name = bucket
    files = {f"d/f{i}.bin": os.urandom(50_000 + i) for i in range(3)}
    for key, data in files.items():
        client.put_object(Bucket=name, Key=key, Body=data)
    addr = f"127.0.0.1:{free_port()}"
    # umask 0: whatever the mounting shell's umask, nothing in the cache is for others.
    mp = mount_as_root(shared_base, f"s3://{name}", s3_endpoint, "--allow-other",
                       "--gid", str(NOBODY), "--file-mode", "0440", "--dir-mode", "0555",
                       "--block-size", "64K", "--metrics-addr", addr, umask=0)
    for key, data in files.items():
        assert (mp / key).read_bytes() == data  # fills the cache
    cache = shared_base / "cache"
    sock = registry.control_socket(mp)
    modes = {p: stat.S_IMODE(p.lstat().st_mode) for p in [cache, *cache.rglob("*")]}
    assert modes[cache] == 0o700
    for p, mode in modes.items():
        if p.is_dir():
            assert mode == 0o700, (p, oct(mode))
        else:
            assert mode == 0o600, (p, oct(mode))
    cache_files = sorted(str(p) for p in cache.rglob("*") if p.is_file())
    assert any("/objects/" in p for p in cache_files) and any("data.mdb" in p for p in cache_files)
    st = sock.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0  # despite --allow-other

    probe = {"files": [str(mp / k) for k in files], "cache": str(cache),
             "cache_files": cache_files, "socket": str(sock)}
    readers = Readers(mp, files, threads=2).__enter__()  # the owner's job goes on meanwhile
    nobody = as_user(NOBODY, NOBODY, probe)
    for i, data in enumerate(files.values()):  # group read (gid 65534, mode 0440)
        assert nobody[f"mount_read_{i}"] == ["ok", len(data)]
    assert nobody["cache_listdir"] == ["error", 13]
    for i in range(len(cache_files)):
        assert nobody[f"cache_read_{i}"] == ["error", 13], cache_files[i]
    assert nobody["control"] == ["error", 13]

    other = as_user(OTHER, OTHER, probe)
    for i in range(len(files)):  # neither owner nor group: the modes say no
        assert other[f"mount_read_{i}"] == ["error", 13]
    assert other["control"] == ["error", 13]

    # Even a socket made reachable by mistake serves only root and the mounting user.
    sock.chmod(0o666)
    refused = as_user(NOBODY, NOBODY, probe)["control"]
    assert refused[0] == "ok" and "permission denied" in str(refused[1]), refused
    metrics = scrape(addr)
    assert metrics['cachefs_control_rejected_total{reason="peer"}'] == 1
    assert metrics.get('cachefs_warm_objects_total', 0) == 0  # nothing was warmed for them
    assert (mp / "d/f0.bin").read_bytes() == files["d/f0.bin"]
    readers.stop()
    assert readers.failed == 0 and readers.wrong_bytes == 0 and readers.ok > 0
    print("\nFAULT-ROW " + readers.row(
        "a second local user (--allow-other): reads by the modes, the cache dir, the index, the "
        "control socket (also opened to 0666 by mistake)", "none needed"))
    deadline = time.monotonic() + 10
    while True:  # the daemon publishes its status every second
        status = json.loads(run_cachefs("status", "--json", str(mp)).stdout)
        if status["control_rejected"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status["control_rejected_by_reason"] == {"peer": 1}
    assert "1 control requests refused (peer 1)" in run_cachefs("status", str(mp)).stdout


def test_an_existing_cache_dir_open_to_others_is_tightened(bucket, s3_endpoint, shared_base):
    client, name = bucket
    client.put_object(Bucket=name, Key="a.bin", Body=b"a" * 1000)
    cache = shared_base / "cache"
    mp = mount_as_root(shared_base, f"s3://{name}", s3_endpoint, "--allow-other")
    assert (mp / "a.bin").read_bytes() == b"a" * 1000
    run_cachefs("unmount", str(mp))
    assert not is_mounted(mp)
    # As an older cachefs (or a careless admin) left it:
    cache.chmod(0o755)
    for p in cache.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    mp.rmdir()
    mp = mount_as_root(shared_base, f"s3://{name}", s3_endpoint, "--allow-other", umask=0o022)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    for top in ["lock", "cachefs.log", "meta.lmdb", "meta.lmdb/data.mdb", "objects"]:
        mode = stat.S_IMODE((cache / top).stat().st_mode)
        assert mode == (0o700 if (cache / top).is_dir() else 0o600), (top, oct(mode))
    log = (cache / "cachefs.log").read_text()
    assert log.count("was open to other local users") == 1
    probe = {"files": [str(mp / "a.bin")], "cache": str(cache), "cache_files": [],
             "socket": "/nonexistent"}
    nobody = as_user(NOBODY, NOBODY, probe)
    assert nobody["cache_listdir"] == ["error", 13]
    assert nobody["mount_read_0"] == ["ok", 1000]


def test_idle_connections_to_the_metrics_port_do_not_pile_up_threads(bucket, mount_factory):
    """Any local process can connect to the metrics port (it has no access control, as
    Prometheus endpoints go). A thread per connection, unbounded, let one that opens
    connections and never finishes a request grow the daemon by a thread (and its stack)
    for each, and every one of them rendered a whole page once the client went away. The
    daemon now serves a few scrapes at once and leaves the others waiting to be
    accepted; its reads go on."""
    import socket
    import urllib.request

    from cachefs.control import registry

    client, name = bucket
    files = {f"d/f{i:02d}": os.urandom(50_000) for i in range(20)}
    for key, body in files.items():
        client.put_object(Bucket=name, Key=key, Body=body)
    m = mount_factory(f"s3://{name}")
    info = registry.lookup(m.path)
    assert info is not None
    pid = int(info["pid"])

    def threads() -> int:
        return len(os.listdir(f"/proc/{pid}/task"))

    host, port = m.metrics_addr.rsplit(":", 1)
    baseline = threads()
    idle: list[socket.socket] = []
    try:
        for _ in range(60):  # (fewer than the accept queue holds: none waits to connect)
            s = socket.create_connection((host, int(port)), timeout=30)
            idle.append(s)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the end of the headers
        time.sleep(2)  # (a thread per connection would be started by now)
        assert threads() - baseline < 30
        for key, body in files.items():
            assert (m.path / key).read_bytes() == body
    finally:
        for s in idle:
            s.close()
    page = urllib.request.urlopen(f"http://{m.metrics_addr}/metrics", timeout=120).read()
    assert b"cachefs_build_info" in page


def test_metrics_clients_that_go_away_mid_request_leave_no_traceback(bucket, mount_factory):
    """A client of the metrics port that reset its connection while sending its request
    (or sent nothing until it was cut off) made the daemon write socketserver's traceback,
    a dozen lines under 'Exception occurred during processing of request', into its log:
    any local process could fill the log with them. Such a client is its own business
    now: nothing is logged, and scrapes go on."""
    import socket
    import struct
    import urllib.request

    client, name = bucket
    client.put_object(Bucket=name, Key="a.bin", Body=b"a")
    m = mount_factory(f"s3://{name}")
    host, port = m.metrics_addr.rsplit(":", 1)
    for i in range(8):
        s = socket.create_connection((host, int(port)), timeout=30)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"GET /met")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # (linger 0: a reset, not an orderly end)
    for _ in range(8):  # (the connections above are gone or cut off)
        page = urllib.request.urlopen(f"http://{m.metrics_addr}/metrics", timeout=120).read()
        assert b"cachefs_build_info" in page
    assert (m.path / "a.bin").read_bytes() == b"a"
    log = m.log()
    assert "Traceback" not in log and "Exception occurred" not in log, log


def test_clients_that_trickle_their_request_cannot_starve_scrapes(bucket, mount_factory):
    """The metrics port served a few connections at once, and its timeout was
    per socket read: a client that sent its request a byte every second or so was never
    cut off, so a few of them held every slot for as long as they liked and Prometheus
    could not scrape the node at all. A connection now has a total deadline, however the
    bytes trickle in, so a scrape behind such clients is served."""
    import socket
    import threading
    import urllib.request

    from cachefs import metricsport

    client, name = bucket
    client.put_object(Bucket=name, Key="a.bin", Body=b"a")
    m = mount_factory(f"s3://{name}")
    host, port = m.metrics_addr.rsplit(":", 1)
    stop = threading.Event()
    slow = [socket.create_connection((host, int(port)), timeout=30)
            for _ in range(4 * metricsport.SCRAPERS)]

    def trickle(s: socket.socket) -> None:
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: y\r\n" * 1000
        for byte in request:
            if stop.wait(1.0):
                return
            try:
                s.sendall(bytes([byte]))
            except OSError:
                return  # (cut off)

    workers = [threading.Thread(target=trickle, args=(s,), daemon=True) for s in slow]
    for w in workers:
        w.start()
    try:
        time.sleep(2)  # (every trickling client has sent some of its request by now)
        page = urllib.request.urlopen(f"http://{m.metrics_addr}/metrics", timeout=60).read()
        assert b"cachefs_build_info" in page
    finally:
        stop.set()
        for w in workers:
            w.join()
        for s in slow:
            s.close()
    assert (m.path / "a.bin").read_bytes() == b"a"


def test_a_scrape_is_served_at_once_behind_clients_that_hold_connections_open(
        bucket, mount_factory):
    """A few scrapes were served at a time, each connection for up to 5 s: a local
    process holding sixty connections open with an unfinished request (and opening new
    ones as those were cut off) kept Prometheus's scrape waiting in the accept queue for
    over a minute, past its 10 s scrape timeout. Requests are now read all at once by one
    thread and only a complete one is served: the scrape is answered within that timeout
    while the others stay open, and those are cut off at their deadline."""
    import socket
    import urllib.request

    from cachefs import metricsport

    client, name = bucket
    client.put_object(Bucket=name, Key="a.bin", Body=b"a")
    m = mount_factory(f"s3://{name}")
    host, port = m.metrics_addr.rsplit(":", 1)
    idle: list[socket.socket] = []
    try:
        for _ in range(60):
            s = socket.create_connection((host, int(port)), timeout=30)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the end of the headers
            idle.append(s)
        time.sleep(0.5)  # (every one of them accepted or waiting to be)
        page = urllib.request.urlopen(f"http://{m.metrics_addr}/metrics", timeout=10).read()
        assert b"cachefs_build_info" in page
        for s in idle:  # cut off at their deadline, not left open for good
            s.settimeout(metricsport.REQUEST_DEADLINE + 10)
            assert s.recv(1) == b""
    finally:
        for s in idle:
            s.close()
    assert (m.path / "a.bin").read_bytes() == b"a"


VICTIM = 65531  # a user without XDG_RUNTIME_DIR: its runtime dir falls back to /tmp


def test_a_runtime_directory_another_user_made_first_is_refused_not_written_through():
    """A user without XDG_RUNTIME_DIR keeps the registry, mount locks and control sockets in
    /tmp/cachefs-UID/cachefs, a name any local user can take first. Another user made it
    (mode 0777) and planted symbolic links at the names the daemon writes: registering the
    mount wrote its JSON through the link into the victim's own file (and the mount lock
    truncated another), and the squatter could swap the control socket for its own. Now a
    runtime directory not owned by the user, or writable by others, is refused in one line
    that says what to do, and nothing is written."""
    if os.geteuid() != 0:
        pytest.skip("acting as other users needs root (setpriv)")
    if shutil.which("setpriv") is None or shutil.which(PY) is None:
        pytest.skip(f"setpriv and {PY} are needed")
    base = Path(f"/tmp/cachefs-{VICTIM}")
    home = Path(tempfile.mkdtemp(prefix="cachefs-victim-", dir="/tmp"))
    shutil.rmtree(base, ignore_errors=True)
    try:
        os.chown(home, VICTIM, VICTIM)
        precious = {name: home / name for name in ("notes.txt", "todo.txt")}
        for path in precious.values():
            path.write_text("the victim's own words\n")
            os.chown(path, VICTIM, VICTIM)
        mountpoint = home / "mnt"
        digest = hashlib.sha1(str(mountpoint).encode()).hexdigest()[:16]
        squat = (f"mkdir -p {base}/cachefs && chmod 0777 {base} {base}/cachefs && "
                 f"ln -s {precious['notes.txt']} {base}/cachefs/{digest}.tmp && "
                 f"ln -s {precious['todo.txt']} {base}/cachefs/{digest}.lock")
        subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                        "sh", "-c", squat], check=True, cwd="/", timeout=30)
        register = textwrap.dedent(f"""
            import sys
            from pathlib import Path
            from cachefs.control import registry
            try:
                registry.register(Path({str(mountpoint)!r}), {{"pid": 1}})
            except Exception as exc:
                print(type(exc).__name__, exc)
                sys.exit(3)
        """)
        env = {k: v for k, v in os.environ.items()
               if k not in ("XDG_RUNTIME_DIR", "CACHEFS_RUNTIME_DIR")}
        # (a copy of the package the victim can read: the checkout may be in a directory
        # only root can enter, such as a private temporary directory)
        src = home / "src"
        shutil.copytree(Path(__file__).resolve().parents[1] / "cachefs", src / "cachefs",
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        for d, _, names in os.walk(src):
            os.chmod(d, 0o755)
            for n in names:
                os.chmod(os.path.join(d, n), 0o644)
        env["PYTHONPATH"] = str(src)
        proc = subprocess.run(["setpriv", f"--reuid={VICTIM}", f"--regid={VICTIM}",
                               "--clear-groups", PY, "-c", register], capture_output=True,
                              text=True, env=env, cwd="/", timeout=60)
        for path in precious.values():
            assert path.read_text() == "the victim's own words\n", path
        assert proc.returncode == 3, (proc.stdout, proc.stderr)
        assert "UnsafeRuntimeDir" in proc.stdout and f"{base}" in proc.stdout, proc.stdout
        assert f"uid {NOBODY}" in proc.stdout and "CACHEFS_RUNTIME_DIR" in proc.stdout
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def test_a_mount_with_a_runtime_directory_others_can_write_is_refused(bucket, s3_endpoint,
                                                                       tmp_path, monkeypatch):
    """The daemon's side of the rule above: its mount lock is the first thing it writes
    there, so the mount fails in one line, before anything is mounted or written."""
    client, name = bucket
    client.put_object(Bucket=name, Key="a", Body=b"a")
    run = Path(tempfile.mkdtemp(prefix="cachefs-squatted-", dir="/tmp"))
    try:
        os.chown(run, NOBODY, NOBODY)
        run.chmod(0o777)
        monkeypatch.setenv("CACHEFS_RUNTIME_DIR", str(run))
        mp = tmp_path / "mnt"
        mp.mkdir()
        proc = run_cachefs("mount", f"s3://{name}", str(mp), "--cache-dir",
                           str(tmp_path / "cache"), "--endpoint-url", s3_endpoint)
        assert proc.returncode == 2 and not is_mounted(mp), proc.stderr
        assert proc.stderr.startswith("cachefs: error: refusing runtime directory")
        assert proc.stderr.count("\n") == 1 and f"uid {NOBODY}" in proc.stderr, proc.stderr
        assert list(run.iterdir()) == []
    finally:
        if is_mounted(tmp_path / "mnt"):
            subprocess.run(["fusermount3", "-u", "-z", str(tmp_path / "mnt")], check=False)
        shutil.rmtree(run, ignore_errors=True)


def test_a_cache_directory_another_user_made_first_is_refused_not_written_through(
        bucket, s3_endpoint, tmp_path):
    """Root mounted with a cache directory that another local user had made (any name under
    /tmp can be taken first) with links planted at 'lock' and 'cachefs.log': the mount went
    on (the directory tightened to 0700, but still the other user's), and root truncated and
    wrote its pid and log lines into the file the links named. Now a cache directory not
    owned by the mounting user, or under a directory others may write to, is refused in
    one line and nothing is written."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("acting as another user needs root and setpriv")
    client, name = bucket
    client.put_object(Bucket=name, Key="a", Body=b"a")
    precious = tmp_path / "root-only.conf"
    precious.write_text("root's own settings\n")
    for made in ("cache", "parent"):
        base = Path(tempfile.mkdtemp(prefix="cachefs-taken-", dir="/tmp"))
        try:
            os.chown(base, NOBODY, NOBODY)
            base.chmod(0o777 if made == "parent" else 0o755)
            cache = base / "cache"
            cache.mkdir()
            if made == "cache":  # the other user's own directory, links planted in it
                os.chown(cache, NOBODY, NOBODY)
                cache.chmod(0o777)
                for link in ("lock", "cachefs.log"):
                    (cache / link).symlink_to(precious)
                    os.lchown(cache / link, NOBODY, NOBODY)
            mp = tmp_path / f"mnt-{made}"
            mp.mkdir()
            proc = run_cachefs("mount", f"s3://{name}", str(mp), "--cache-dir", str(cache),
                               "--endpoint-url", s3_endpoint)
            mounted = is_mounted(mp)
            if mounted:
                subprocess.run(["fusermount3", "-u", "-z", str(mp)], check=False)
            assert precious.read_text() == "root's own settings\n", made
            assert proc.returncode == 1 and not mounted, (made, proc.stderr)
            assert proc.stderr.startswith(f"cachefs: error: refusing cache directory {cache}")
            assert proc.stderr.count("\n") == 1 and f"uid {NOBODY}" in proc.stderr, proc.stderr
        finally:
            shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("plant", ["symlink", "file"])
def test_a_log_file_another_user_planted_is_refused_not_written_through(bucket, s3_endpoint,
                                                                        shared_base, plant):
    """`--log-file` in a directory every user may write to (`/tmp/cachefs.log`): another
    user who made that name first, as a link to a file of root's, had root's cachefs
    append its log (key names and paths, and lines it chooses through the key names of a
    bucket) to that file; as a file of their own, had the log handed to them. The mount
    is now refused in one line, and nothing is written through."""
    client, name = bucket
    client.put_object(Bucket=name, Key="a.bin", Body=b"a")
    public = shared_base / "public"
    public.mkdir()
    public.chmod(0o1777)  # (as /tmp)
    victim = shared_base / "victim"
    victim.write_text("root's own\n")
    victim.chmod(0o600)
    log = public / "cachefs.log"
    if plant == "symlink":
        make = f"import os; os.symlink({str(victim)!r}, {str(log)!r})"
    else:
        make = f"open({str(log)!r}, 'w').close(); import os; os.chmod({str(log)!r}, 0o666)"
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                    PY, "-c", make], check=True)
    mp = shared_base / "mnt"
    mp.mkdir()
    proc = subprocess.run(
        [os.sys.executable, "-m", "cachefs", "mount", f"s3://{name}", str(mp), "--cache-dir",
         str(shared_base / "cache"), "--endpoint-url", s3_endpoint, "--log-file", str(log)],
        capture_output=True, text=True, timeout=120)
    try:
        assert proc.returncode != 0, "mounted, logging into a file another user planted"
        assert not is_mounted(mp)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("cachefs: error: "), proc.stderr
        assert str(log) in lines[0], lines[0]
    finally:
        if is_mounted(mp):
            run_cachefs("unmount", str(mp))
    assert victim.read_text() == "root's own\n"
    if plant == "file":
        assert log.read_text() == ""

"""Bad input gets one clear line on stderr, a non-zero exit, no traceback, and no mount."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from tests.conftest import free_port, is_mounted, requires_fuse, run_cachefs

pytestmark = requires_fuse


def assert_one_line_error(proc, *fragments: str, code: int | None = None) -> None:
    assert proc.returncode != 0, proc
    if code is not None:
        assert proc.returncode == code, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("cachefs: error: "), lines[0]
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def mp(tmp_path: Path) -> Path:
    p = tmp_path / "mnt"
    p.mkdir()
    return p


def mount(source: str, mp: Path, cache: Path, *extra: str, env=None):
    return run_cachefs("mount", source, str(mp), "--cache-dir", str(cache), *extra, env=env,
                       timeout=120)


def test_url_that_is_not_s3(mp, tmp_path, s3_endpoint):
    proc = mount("http://bucket/prefix", mp, tmp_path / "c", "--endpoint-url", s3_endpoint)
    assert_one_line_error(proc, "s3://BUCKET", code=2)
    assert not is_mounted(mp)


def test_missing_mount_point(tmp_path, s3_endpoint, bucket):
    _, name = bucket
    proc = mount(f"s3://{name}", tmp_path / "nope", tmp_path / "c", "--endpoint-url",
                 s3_endpoint)
    assert_one_line_error(proc, "does not exist", code=2)


def test_non_empty_mount_point(mp, tmp_path, s3_endpoint, bucket):
    _, name = bucket
    (mp / "precious.txt").write_text("keep me")
    proc = mount(f"s3://{name}", mp, tmp_path / "c", "--endpoint-url", s3_endpoint)
    assert_one_line_error(proc, "not empty", code=2)
    assert (mp / "precious.txt").read_text() == "keep me"
    assert not is_mounted(mp)


@pytest.mark.parametrize("where", ["cache", "."])
def test_cache_dir_inside_the_mount_point(mp, tmp_path, s3_endpoint, bucket, where):
    """The mount would hide it. cachefs made the directory in the empty mount point, then
    refused its own doing with 'mount point is not empty', and left the directory there."""
    _, name = bucket
    proc = mount(f"s3://{name}", mp, mp / where, "--endpoint-url", s3_endpoint)
    assert_one_line_error(proc, "inside the mount point", code=2)
    assert list(mp.iterdir()) == []
    assert not is_mounted(mp)


@pytest.mark.parametrize("flag,value", [("--uid", "4294967296"), ("--gid", "4294967295"),
                                        ("--uid", "99999999999999999999")])
def test_an_owner_id_out_of_range(mp, tmp_path, s3_endpoint, bucket, flag, value):
    """IDs are 32 bits and (uid_t)-1 means 'no change': the daemon mounted, crashed on
    its first getattr with a traceback in its log, and the command said only that it
    exited during start-up."""
    import subprocess

    _, name = bucket
    try:
        proc = mount(f"s3://{name}", mp, tmp_path / "c", "--endpoint-url", s3_endpoint,
                     flag, value)
        assert_one_line_error(proc, flag, code=2)
        assert not is_mounted(mp)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)


def test_bucket_that_does_not_exist(mp, tmp_path, s3_endpoint):
    proc = mount("s3://no-such-bucket-here", mp, tmp_path / "c", "--endpoint-url", s3_endpoint)
    assert_one_line_error(proc, "no-such-bucket-here", "does not exist")
    assert not is_mounted(mp)


def test_endpoint_that_does_not_answer(mp, tmp_path):
    port = free_port()  # nothing listens there
    proc = mount("s3://some-bucket", mp, tmp_path / "c", "--endpoint-url",
                 f"http://127.0.0.1:{port}")
    assert_one_line_error(proc, "cannot reach", f"127.0.0.1:{port}")
    assert not is_mounted(mp)


def test_missing_credentials(mp, tmp_path, s3_endpoint, bucket):
    _, name = bucket
    env = {k: v for k, v in os.environ.items()
           if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    proc = mount(f"s3://{name}", mp, tmp_path / "c", "--endpoint-url", s3_endpoint, env=env)
    assert_one_line_error(proc, "credentials")
    assert not is_mounted(mp)


def test_cache_dir_that_cannot_be_written(mp, tmp_path, s3_endpoint, bucket):
    _, name = bucket
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    proc = mount(f"s3://{name}", mp, blocker / "cache", "--endpoint-url", s3_endpoint)
    assert_one_line_error(proc, "cache directory")
    assert not is_mounted(mp)


@pytest.mark.parametrize("size,fragment", [
    ("1000P", "larger than the file system"),
    ("lots", "invalid size"),
    ("0", "too small"),
    ("-5G", "invalid size"),
])
def test_impossible_cache_size(mp, tmp_path, s3_endpoint, bucket, size, fragment):
    _, name = bucket
    proc = mount(f"s3://{name}", mp, tmp_path / "c", "--endpoint-url", s3_endpoint,
                 f"--cache-size={size}")
    assert_one_line_error(proc, fragment, code=2)
    assert not is_mounted(mp)


@pytest.mark.parametrize("flag,value,fragment", [
    ("--cache-size", "-5G", "negative"),
    ("--metadata-ttl", "-5s", "invalid duration"),
    ("--max-connections", "-3", "must not be negative"),
    ("--registered-files", "-1", "must not be negative"),
    ("--memory-budget", "-1", "negative"),
])
def test_negative_values_are_named_as_such(mp, tmp_path, flag, value, fragment):
    # "--cache-size -5G", not only "--cache-size=-5G": argparse took -5G for an option.
    proc = mount("s3://bucket", mp, tmp_path / "c", flag, value)
    assert_one_line_error(proc, flag, fragment, code=2)
    assert "expected one argument" not in proc.stderr


def test_a_value_option_followed_by_an_option_still_needs_its_value(mp, tmp_path):
    proc = mount("s3://bucket", mp, tmp_path / "c", "--cache-size", "--allow-other")
    assert_one_line_error(proc, "--cache-size", "expected one argument", code=2)


@pytest.mark.parametrize("url", ["file:///tmp/store", "s3://bucket", "localhost:9000"])
def test_endpoint_url_that_is_not_http(mp, tmp_path, url):
    proc = mount("s3://bucket", mp, tmp_path / "c", "--endpoint-url", url)
    assert_one_line_error(proc, "--endpoint-url", "http", code=2)
    assert not (tmp_path / "c").exists()  # refused before anything started


def test_endpoint_from_the_environment_that_is_not_http(mp, tmp_path, bucket):
    _, name = bucket
    env = dict(os.environ, AWS_ENDPOINT_URL="file:///tmp/store")
    proc = mount(f"s3://{name}", mp, tmp_path / "c", env=env)
    assert_one_line_error(proc, "endpoint", code=2)
    log = (tmp_path / "c" / "cachefs.log").read_text()
    assert "Traceback" not in log
    assert not is_mounted(mp)


def test_unknown_flag(mp, tmp_path):
    proc = mount("s3://bucket", mp, tmp_path / "c", "--no-such-flag")
    assert_one_line_error(proc, "--no-such-flag", code=2)


def test_bad_config_file(mp, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('cache_dri = "/tmp/x"\n')
    proc = run_cachefs("mount", "--config", str(cfg), "s3://bucket", str(mp))
    assert_one_line_error(proc, "unknown option 'cache_dri'", code=2)
    cfg.write_text("this is = = not toml")
    proc = run_cachefs("mount", "--config", str(cfg), "s3://bucket", str(mp))
    assert_one_line_error(proc, "not valid TOML", code=2)


def test_a_config_file_that_is_not_text_is_one_line(mp, tmp_path):
    """A config file that is not UTF-8 (a binary copied by mistake, a Latin-1 editor) ended
    in a UnicodeDecodeError traceback with exit 1."""
    cfg = tmp_path / "c.toml"
    cfg.write_bytes(b'\xff\xfecache_dir = "/tmp/x"\n')
    proc = run_cachefs("mount", "--config", str(cfg), "s3://bucket", str(mp))
    assert_one_line_error(proc, "not valid TOML", code=2)
    cfg.write_bytes('log_file = "/var/log/caf\u00e9.log"\n'.encode("latin-1"))
    proc = run_cachefs("unmount", "--config", str(cfg))
    assert_one_line_error(proc, "not valid TOML", code=2)


@pytest.mark.parametrize("line, fragment", [
    ("fuse_workers = 2.5", "2.5"),  # was 2, silently
    ("fuse_workers = true", "True"),  # was 1
    ("max_connections = 16.9", "16.9"),  # was 16
])
def test_a_whole_number_option_given_a_fraction_or_a_boolean_is_refused(mp, tmp_path, line,
                                                                          fragment):
    cfg = tmp_path / "c.toml"
    cfg.write_text(line + "\n")
    proc = run_cachefs("mount", "--config", str(cfg), "s3://bucket", str(mp), "--cache-dir",
                       str(tmp_path / "c"))
    assert_one_line_error(proc, f"invalid number {fragment}", code=2)


@pytest.mark.parametrize("line, fragment", [
    ("cache_dir = 5", "--cache-dir: invalid path 5"),  # was a directory named 5
    ("cache_dir = [\"/var/cache/a\"]", "--cache-dir: invalid path"),
    ("cache_dir = \"\"", "--cache-dir: empty path"),  # was the current directory
    ("mountpoint = 7", "mount point: invalid path 7"),
    ("log_file = 1", "--log-file: invalid value 1"),
    ("manifest = true", "--manifest: invalid value True"),
    ("region = 1", "--region: invalid value 1"),
    ("metrics_addr = 9477", "--metrics-addr: invalid value 9477"),
    ("shared_cache_profile = 2", "--shared-cache-profile: invalid value 2"),
    ("allow_other = 1", "--allow-other: invalid boolean 1"),
    ("retry_deadline = nan", "--retry-deadline: invalid duration nan"),  # was never
    ("metadata_ttl = nan", "--metadata-ttl: invalid duration nan"),
    ("log_level = 10", "--log-level: invalid value 10"),
])
def test_a_config_value_of_the_wrong_type_is_refused(mp, tmp_path, line, fragment):
    """TOML has types: a number, a boolean or a list where a path or a name belongs was
    taken as the text of its Python spelling (cache_dir = 5 made a cache directory '5')."""
    cfg = tmp_path / "c.toml"
    cache = "" if line.startswith("cache_dir") else f"cache_dir = {str(tmp_path / 'c')!r}\n"
    place = "" if line.startswith("mountpoint") else f"mountpoint = {str(mp)!r}\n"
    cfg.write_text(f"source = \"s3://bucket\"\n{place}{cache}{line}\n")
    proc = run_cachefs("mount", "--config", str(cfg), preexec_fn=lambda: os.chdir(tmp_path))
    assert_one_line_error(proc, fragment, code=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml", "mnt"]
    assert not is_mounted(mp)


def test_unmount_reads_the_mount_point_of_a_config_file_as_mount_does(tmp_path, s3_endpoint,
                                                                      bucket):
    """'cachefs unmount --config FILE' (the systemd unit's ExecStop) took the file's
    mountpoint as written: a '~/data' that 'cachefs mount --config FILE' had mounted at the
    home directory's data was '<cwd>/~/data is not a cachefs mount' (exit 2), so stopping
    the unit failed; and 'mountpoint = 5' was a directory named 5. Both read it alike now."""
    _, name = bucket
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    env = {**os.environ, "HOME": str(home)}
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'source = "s3://{name}"\nmountpoint = "~/data"\n'
                   f'cache_dir = {str(tmp_path / "cache")!r}\nendpoint_url = "{s3_endpoint}"\n')
    up = run_cachefs("mount", "--config", str(cfg), env=env)
    assert up.returncode == 0, up.stderr
    try:
        assert is_mounted(home / "data")
        down = run_cachefs("unmount", "--config", str(cfg), env=env,
                           preexec_fn=lambda: os.chdir(tmp_path))
        assert down.returncode == 0, down.stderr
        assert not is_mounted(home / "data")
    finally:
        if is_mounted(home / "data"):
            run_cachefs("unmount", "--lazy", str(home / "data"))
    cfg.write_text("mountpoint = 5\n")
    proc = run_cachefs("unmount", "--config", str(cfg))
    assert_one_line_error(proc, "mount point: invalid path 5", code=2)


def test_a_daemon_started_inside_another_mount_does_not_keep_it_busy(tmp_path, s3_endpoint,
                                                                     bucket, mount_factory):
    """The daemon kept the working directory 'cachefs mount' was run from for its whole
    life: mounted from inside another mount (or any file system), it kept that one busy,
    and 'cachefs unmount' of it was refused ('in use by pid ... (python)'). The daemon
    now works from /, its relative paths (a manifest, the AWS files) made absolute first."""
    client, name = bucket
    client.put_object(Bucket=name, Key="d/a.bin", Body=b"a" * 1000)
    first = mount_factory(f"s3://{name}")
    etag = client.head_object(Bucket=name, Key="d/a.bin")["ETag"].strip('"')
    (tmp_path / "m.csv").write_text(f"d/a.bin,1000,{etag}\n")
    second = tmp_path / "second"
    second.mkdir()
    proc = run_cachefs("mount", f"s3://{name}", str(second), "--cache-dir",
                       str(tmp_path / "cache2"), "--endpoint-url", s3_endpoint,
                       "--manifest", "../../m.csv",  # (from the working directory)
                       preexec_fn=lambda: os.chdir(first.path / "d"))
    assert proc.returncode == 0, proc.stderr
    try:
        assert (second / "d" / "a.bin").read_bytes() == b"a" * 1000
        down = run_cachefs("unmount", str(first.path))
        assert down.returncode == 0, down.stderr
        assert (second / "d" / "a.bin").read_bytes() == b"a" * 1000
    finally:
        run_cachefs("unmount", "--lazy", str(second))


def test_metrics_address_in_use(mp, tmp_path, s3_endpoint, bucket):
    _, name = bucket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = mount(f"s3://{name}", mp, tmp_path / "c", "--endpoint-url", s3_endpoint,
                     "--metrics-addr", f"127.0.0.1:{port}")
    assert_one_line_error(proc, "address already in use")
    assert not is_mounted(mp)


def test_cache_dir_in_use_by_another_mount(tmp_path, s3_endpoint, bucket, mount_factory):
    _, name = bucket
    m = mount_factory(f"s3://{name}")
    other = tmp_path / "other"
    other.mkdir()
    proc = mount(f"s3://{name}", other, m.cache_dir, "--endpoint-url", s3_endpoint)
    assert_one_line_error(proc, "in use by another cachefs")
    assert not is_mounted(other)
    assert is_mounted(m.path)


def test_two_mounts_of_one_mount_point_at_once(mp, tmp_path, s3_endpoint, bucket):
    """Both found the mount point empty and both mounted, one over the other: two daemons,
    the lower one hidden, and the registry naming only one (a launcher that mounts from
    every rank of a job, or fstab and a unit at boot). One wins; the other says why."""
    import subprocess
    import sys

    _, name = bucket
    try:
        procs = [subprocess.Popen(
            [sys.executable, "-m", "cachefs", "mount", f"s3://{name}", str(mp), "--cache-dir",
             str(tmp_path / f"c{i}"), "--endpoint-url", s3_endpoint],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
        results = [(p.wait(timeout=120), p.stderr.read() if p.stderr else "") for p in procs]
        with open("/proc/self/mountinfo") as f:
            stacked = sum(1 for line in f if line.split()[4] == str(mp))
        assert stacked == 1, results
        assert sorted(code for code, _ in results) == [0, 2], results
        (err,) = [e.strip() for code, e in results if code != 0]
        assert len(err.splitlines()) == 1 and "cachefs: error: " in err, err
        assert str(mp) in err and ("being mounted" in err or "already" in err), err
    finally:
        for _ in range(3):
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)


def test_unmount_of_something_else(tmp_path):
    proc = run_cachefs("unmount", str(tmp_path))
    assert_one_line_error(proc, "not a cachefs mount")
    assert run_cachefs("unmount", "--quiet", str(tmp_path)).returncode == 0


def test_output_nobody_reads_ends_quietly() -> None:
    """`cachefs plan ... | head -1`: the reader closing the pipe is no error to report.
    (The pipe's reading end is closed before cachefs starts, so every write fails.)"""
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "cachefs", "plan", "--dataset-size", "2G", "--cache-size",
             "3G", "--bandwidth", "150MB/s", "--latency", "70ms", "--demand", "300MB/s"],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert proc.stderr == "", proc.stderr
    assert proc.returncode == 141, proc


def test_an_unknown_word_after_the_options_of_a_command_is_refused(mp, tmp_path):
    """Only `warm` takes words after its options (as paths); elsewhere they stay errors."""
    proc = run_cachefs("status", str(mp), "--json", "extra")
    assert proc.returncode == 2 and "unrecognized arguments: extra" in proc.stderr, proc
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", ["plan", "export", "status"])
def test_output_to_a_full_disk_is_one_line_and_a_failure(bucket, s3_endpoint, command):
    """'cachefs manifest export > dataset.csv' on a full disk ended in an OSError traceback
    (ENOSPC); the manifest file is incomplete, which the user must learn in one line. Every
    command's output goes through the same check (/dev/full: every write fails ENOSPC)."""
    import subprocess
    import sys

    client, name = bucket
    client.put_object(Bucket=name, Key="d/a", Body=b"a")
    args = {"plan": ["plan", "--dataset-size", "1G", "--cache-size", "1G", "--bandwidth",
                     "1GB/s", "--latency", "1ms", "--demand", "1GB/s"],
            "export": ["manifest", "export", f"s3://{name}", "--endpoint-url", s3_endpoint],
            "status": ["status"]}[command]
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "cachefs", *args], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert_one_line_error(proc, "cannot write the output", "No space left on device", code=1)


def test_an_endpoint_that_is_not_s3_fails_the_mount_at_once(mp, tmp_path):
    """An --endpoint-url of a web server that answers every request with a 200 HTML page (a
    storage console's port instead of its S3 API, a proxy's welcome page): the mount
    said it was live, then the first 'ls' waited out the whole retry deadline (5 minutes)
    and failed with EIO, every listing answer taken for one cut short. The start-up
    listing now checks the answer is S3's and the mount fails in one line."""
    import http.server
    import threading

    page = b"<!DOCTYPE html><html><body>Welcome to the storage console</body></html>"

    class Console(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _page(self, body: bool) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            if body:
                self.wfile.write(page)

        def do_GET(self) -> None:
            self._page(True)

        def do_HEAD(self) -> None:
            self._page(False)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Console)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proc = mount("s3://bucket", mp, tmp_path / "c", "--endpoint-url",
                     f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        if is_mounted(mp):
            import subprocess

            subprocess.run(["fusermount3", "-u", "-z", str(mp)], check=False)
    assert_one_line_error(proc, "not an S3 listing", "--endpoint-url", code=1)
    assert not is_mounted(mp)


@pytest.mark.parametrize("prefix", ["Train", "train/img0.jpg", "nothing-here"])
def test_a_source_that_holds_no_keys_mounts_with_a_warning(mp, tmp_path, s3_endpoint, bucket,
                                                           prefix):
    """A prefix with no key under it (a typo, S3's case, a file's URL given for its folder's)
    mounted an empty folder without a word: the job on it found no files. It still mounts
    (keys may come), with one warning line naming the source, in the log too."""
    client, name = bucket
    client.put_object(Bucket=name, Key="train/img0.jpg", Body=b"x")
    proc = mount(f"s3://{name}/{prefix}", mp, tmp_path / "c", "--endpoint-url", s3_endpoint)
    try:
        assert proc.returncode == 0, proc.stderr
        assert is_mounted(mp) and os.listdir(mp) == []
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith("cachefs: warning: "), lines[0]
        assert f"s3://{name}/{prefix}/ holds no keys" in lines[0]
        assert f"s3://{name}/{prefix}/ holds no keys" in (tmp_path / "c/cachefs.log").read_text()
    finally:
        if is_mounted(mp):
            assert run_cachefs("unmount", str(mp)).returncode == 0
    # A source with keys mounts without a word.
    proc = mount(f"s3://{name}/train", mp, tmp_path / "c", "--endpoint-url", s3_endpoint)
    try:
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert os.listdir(mp) == ["img0.jpg"]
    finally:
        if is_mounted(mp):
            assert run_cachefs("unmount", str(mp)).returncode == 0

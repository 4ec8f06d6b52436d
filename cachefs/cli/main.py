"""The ``cachefs`` command line: mount, unmount, status.

Every failure a user can cause ends as one line on stderr
(``cachefs: error: ...``) and a non-zero exit; tracebacks are only for bugs.
Exit codes: 0 ok, 1 runtime failure, 2 usage/configuration error.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import math
import os
import select
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cachefs import __version__
from cachefs.config import (
    OPTIONS,
    OPTIONS_BY_NAME,
    MountConfig,
    config_mountpoint,
    load_config_file,
    resolve,
    speculative_window,
)
from cachefs.errors import CachefsError, ConfigError

log = logging.getLogger("cachefs")

READY_FD_ENV = "CACHEFS_READY_FD"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2
        print(f"cachefs: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cachefs", description="Read-through caching FUSE file system for "
                     "S3 datasets.")
    parser.add_argument("--version", action="version", version=f"cachefs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    mount = sub.add_parser("mount", help="mount s3://BUCKET[/PREFIX] at MOUNTPOINT",
                           description="Mount a bucket prefix read-only with a local block cache.")
    mount.add_argument("source", nargs="?", help="s3://BUCKET[/PREFIX]")
    mount.add_argument("mountpoint", nargs="?", help="an empty directory")
    mount.add_argument("--config", metavar="FILE", help="TOML file with options (flags and "
                       "CACHEFS_* environment variables take precedence)")
    mount.add_argument("-f", "--foreground", action="store_true",
                       help="stay in the foreground (logs to stderr)")
    for opt in OPTIONS:
        default_note = "" if opt.default is None else f" (default: {opt.default})"
        if opt.flag:
            mount.add_argument(opt.cli, dest=opt.name, action="store_const", const=True,
                               default=None, help=opt.help + default_note)
        else:
            mount.add_argument(opt.cli, dest=opt.name, metavar=opt.metavar, default=None,
                               help=opt.help + default_note)

    unmount = sub.add_parser("unmount", aliases=["umount"], help="unmount a cachefs mount")
    unmount.add_argument("mountpoint", nargs="?")
    unmount.add_argument("--config", metavar="FILE", help="take the mount point from this file")
    unmount.add_argument("-z", "--lazy", action="store_true",
                         help="detach now even if busy (also clears a dead mount)")
    unmount.add_argument("-q", "--quiet", action="store_true",
                         help="exit 0 if nothing is mounted there")
    unmount.add_argument("--timeout", type=float, default=60.0,
                         help="seconds to wait for the daemon to finish (default 60)")

    warm = sub.add_parser("warm", help="fill the cache of a running mount ahead of training",
                          description="Make whole directories (or the files a manifest lists) "
                          "resident in the block cache of a running cachefs mount.")
    warm.add_argument("mountpoint", help="a live cachefs mount point")
    warm.add_argument("paths", nargs="*", help="files or directories under the mount "
                      "(relative to it or absolute; default: everything)")
    warm.add_argument("--manifest", metavar="FILE", help="a file listing one path per line "
                      "(relative to the mount, or absolute), exactly as written: spaces "
                      "count; empty lines and lines starting with '#' are skipped")
    warm.add_argument("--parallel", type=int, default=16, metavar="N",
                      help="objects warmed at once (default 16)")
    warm.add_argument("--check", action="store_true",
                      help="only report what share is cached; fetch nothing")
    warm.add_argument("--shard", metavar="I/N",
                      help="cluster warm: fetch only node I's share of the blocks (0 <= I < N, "
                      "a stable hash of each block) into the shared cache tier and the local "
                      "cache; run it on N nodes with I = 0..N-1 and the dataset crosses "
                      "regions once (needs --shared-cache on the mount)")

    probe = sub.add_parser("probe", help="measure latency and throughput to a bucket")
    probe.add_argument("source", help="s3://BUCKET[/PREFIX] with some objects to read")
    probe.add_argument("--endpoint-url", metavar="URL")
    probe.add_argument("--region", metavar="REGION")
    probe.add_argument("--no-sign-request", action="store_true")
    probe.add_argument("--samples", type=int, default=20, help="latency samples (default 20)")
    probe.add_argument("--parallel", type=int, default=16, help="parallel streams (default 16)")
    probe.add_argument("--seconds", type=float, default=5.0,
                       help="duration of each throughput test (default 5)")
    probe.add_argument("--json", action="store_true")

    plan = sub.add_parser("plan", help="expected warm-up, hit ratio and throughput per policy")
    plan.add_argument("--dataset-size", required=True, metavar="SIZE", help="e.g. 144G")
    plan.add_argument("--cache-size", required=True, metavar="SIZE", help="per node, e.g. 2T")
    plan.add_argument("--bandwidth", metavar="RATE", help="link goodput, e.g. 150MB/s, 10Gbit")
    plan.add_argument("--latency", metavar="DURATION", help="request latency, e.g. 70ms")
    plan.add_argument("--probe", metavar="FILE", help="'cachefs probe --json' output")
    plan.add_argument("--demand", required=True, metavar="RATE",
                      help="what the job reads co-located, e.g. 1.8GB/s")
    plan.add_argument("--files", type=int, default=0, help="number of files in the dataset")
    plan.add_argument("--mean-file-size", metavar="SIZE", help="instead of --files (default 110K)")
    plan.add_argument("--epochs", type=int, default=10)
    plan.add_argument("--workers", type=int, default=8, help="DataLoader workers (default 8)")
    in_flight = speculative_window(OPTIONS_BY_NAME["max_connections"].default)
    plan.add_argument("--in-flight", type=int, default=in_flight,
                      help="requests cachefs keeps in flight when prefetching (default "
                           f"{in_flight}: 3/4 of --max-connections' default)")
    plan.add_argument("--nodes", type=int, default=1, metavar="N",
                      help="nodes of the training job sharing the link: adds cross-region bytes "
                      "and warm-up with and without a shared cache tier (default 1)")
    plan.add_argument("--shared-cache-size", metavar="SIZE",
                      help="capacity of the shared cache tier (default: the whole dataset)")
    plan.add_argument("--allocation-unit", default="4K", metavar="SIZE",
                      help="allocation unit of the cache's file system, which each cached file "
                      "rounds up to (default 4K: ext4, XFS, btrfs, tmpfs)")
    plan.add_argument("--json", action="store_true")

    manifest = sub.add_parser("manifest", help="write a manifest of a bucket prefix "
                              "(for 'cachefs mount --manifest')")
    msub = manifest.add_subparsers(dest="manifest_command", required=True, parser_class=_Parser)
    export = msub.add_parser("export", help="list s3://BUCKET/PREFIX (in parallel) to stdout",
                             description="List every object under s3://BUCKET/PREFIX, many "
                             "directories at once, and write key,size,etag,mtime rows to "
                             "stdout (CSV with a header, or JSON lines).")
    export.add_argument("source", help="s3://BUCKET[/PREFIX]")
    export.add_argument("--endpoint-url", metavar="URL")
    export.add_argument("--region", metavar="REGION")
    export.add_argument("--no-sign-request", action="store_true")
    export.add_argument("--parallel", type=int, default=16, metavar="N",
                        help="directories listed at once (default 16)")
    export.add_argument("--format", default="csv", choices=("csv", "jsonl"),
                        help="csv (default) or jsonl")

    status = sub.add_parser("status", help="show cachefs mounts on this node")
    status.add_argument("mountpoint", nargs="?")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def _option_strings(parser: argparse.ArgumentParser) -> tuple[set[str], set[str]]:
    """(options taking one value, every option string) of ``parser`` and its subcommands."""
    valued: set[str] = set()
    every: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                v, e = _option_strings(sub)
                valued |= v
                every |= e
            continue
        every.update(action.option_strings)
        if action.option_strings and action.nargs is None:
            valued.update(action.option_strings)
    return valued, every


def join_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--cache-size -5G`` -> ``--cache-size=-5G``. argparse takes a value that starts with
    '-' (and is not a plain negative number) for an option and fails with "expected one
    argument"; joined, the value reaches its parser, which says what is wrong with it. A
    following token that is itself an option of the command line is left alone."""
    valued, every = _option_strings(parser)
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            out += argv[i:]
            break
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if (token in valued and nxt is not None and nxt.startswith("-") and nxt != "--"
                and nxt.split("=", 1)[0] not in every):
            out.append(f"{token}={nxt}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def _mount_config(args: argparse.Namespace) -> MountConfig:
    file_values = load_config_file(args.config) if args.config else None
    cli: dict[str, Any] = {opt.name: getattr(args, opt.name) for opt in OPTIONS}
    cli["source"] = args.source
    cli["mountpoint"] = args.mountpoint
    return resolve(cli, file_values=file_values)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Request-level chatter of the AWS SDK is never useful at info and may echo headers.
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


#: AWS settings that name files, which the SDK may read again later (credentials renewed
#: in place, a new session's configuration).
_AWS_FILE_VARIABLES = ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_CA_BUNDLE",
                       "AWS_WEB_IDENTITY_TOKEN_FILE")


def _leave_working_directory(cfg: MountConfig) -> MountConfig:
    """The daemon works from /: the directory it was started in, kept for its whole life,
    would keep the file system holding it busy (another mount could not be unmounted).
    Relative paths it reads later (the manifest, the AWS files) are made absolute first."""
    for var in _AWS_FILE_VARIABLES:
        value = os.environ.get(var)
        if value and not os.path.isabs(os.path.expanduser(value)):
            os.environ[var] = os.path.abspath(value)
    for name in ("manifest", "log_file"):
        value = getattr(cfg, name)
        if value and not os.path.isabs(os.path.expanduser(value)):
            cfg = dataclasses.replace(cfg, **{name: os.path.abspath(value)})
    try:
        os.chdir("/")
    except OSError:  # (then it stays where it is, as before)
        pass
    return cfg


def cmd_mount(args: argparse.Namespace) -> int:
    cfg = _mount_config(args)
    ready_fd = os.environ.pop(READY_FD_ENV, None)
    if not args.foreground:
        return _spawn_daemon(cfg, args.argv)
    cfg = _leave_working_directory(cfg)
    # Ignored from the start, not only once the daemon serves (it then logs them): their
    # default action would end it while it starts, without a word.
    from cachefs.startup import IGNORED_SIGNALS

    for signum in IGNORED_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    _setup_logging(cfg.log_level)

    def report(message: str) -> None:
        if ready_fd is not None:
            try:
                os.write(int(ready_fd), (message + "\n").encode())
                os.close(int(ready_fd))
            except OSError:
                pass

    from cachefs.daemon import Daemon  # imports pyfuse3: only needed to mount

    daemon = Daemon(cfg)

    def ready() -> None:  # ("ready", then each warning after a NUL: the parent's one line)
        report("\0".join(["ready", *(w.replace("\n", "\\n").replace("\0", "\\0")
                                      for w in daemon.warnings)]))

    try:
        daemon.run(on_ready=ready)
    except CachefsError as exc:
        report(f"error: {exc}")
        print(f"cachefs: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    return 0


def _spawn_daemon(cfg: MountConfig, argv_in: list[str]) -> int:
    """Start ``cachefs mount --foreground`` detached; return once it is live or failed."""
    from cachefs.startup import check_mountpoint, prepare_cache_dir

    # Fail fast, in this process, on the common errors. A dead cachefs mount at the mount
    # point is left to the daemon, which detaches it (and logs and counts that).
    check_mountpoint(cfg.mountpoint, clean_dead=False)
    prepare_cache_dir(cfg.cache_dir, cfg.cache_size, tighten=False)
    log_path = Path(cfg.log_file) if cfg.log_file else cfg.cache_dir / "cachefs.log"
    read_end, write_end = os.pipe()
    env = dict(os.environ, **{READY_FD_ENV: str(write_end)})
    argv = [sys.executable, "-m", "cachefs", *argv_in, "--foreground"]
    log_file = os.fdopen(_open_log(log_path), "ab")
    # Ctrl-C or SIGTERM (`timeout`) while the daemon starts: it is stopped too, or it
    # would mount afterwards, for a user who gave up (and whose next try found the cache
    # directory in use).
    child: subprocess.Popen[bytes] | None = None
    previous = {signum: signal.signal(signum, _raise_stopped) for signum in STOPPED_BY}
    try:
        with log_file:
            child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file,
                                     stderr=log_file, env=env, pass_fds=(write_end,),
                                     start_new_session=True, close_fds=True)
        os.close(write_end)
        write_end = -1
        message = _read_line(read_end, cfg.start_timeout)
        if message is None:  # (given up: stopped like a Ctrl-C's, below)
            for signum in STOPPED_BY:
                signal.signal(signum, signal.SIG_IGN)
            waited = f"{cfg.start_timeout:g}s"
            how = ("a mount from a large manifest or of a large cache may need longer: "
                   "--start-timeout, start_timeout= in fstab")
            if _stop_daemon(child):
                print(f"cachefs: error: the daemon did not become ready within {waited}: "
                      f"stopped its daemon (pid {child.pid}); nothing is mounted ({how}); "
                      f"see {log_path}", file=sys.stderr)
            else:
                print(f"cachefs: error: the daemon did not become ready within {waited}, and "
                      f"its daemon (pid {child.pid}) is still stopping after {STOP_WAIT:.0f}s "
                      f"({how}); see {log_path}", file=sys.stderr)
            return 1
    except _Stopped as stop:
        for signum in STOPPED_BY:  # (a second Ctrl-C must not cut the stop short)
            signal.signal(signum, signal.SIG_IGN)
        name = signal.Signals(stop.signum).name
        if child is None:
            print(f"cachefs: error: {name}: stopped before the daemon started",
                  file=sys.stderr)
        elif _stop_daemon(child):
            print(f"cachefs: error: {name} while the mount was starting: stopped its daemon "
                  f"(pid {child.pid}); nothing is mounted", file=sys.stderr)
        else:
            print(f"cachefs: error: {name} while the mount was starting: its daemon (pid "
                  f"{child.pid}) is still stopping after {STOP_WAIT:.0f}s; see {log_path}",
                  file=sys.stderr)
        return 128 + stop.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for fd in (read_end, write_end):
            if fd >= 0:
                os.close(fd)
    assert child is not None  # (started, or the except above returned)
    head, *warnings = message.split("\0")
    if head == "ready":
        for warning in warnings:
            print(f"cachefs: warning: {warning}", file=sys.stderr)
        return 0
    if message.startswith("error: "):
        child.wait(timeout=30)
        print(f"cachefs: {message}", file=sys.stderr)
        return child.returncode or 1
    if not message:
        try:  # the pipe closes as the child exits: give it a moment to be reaped
            code: int | None = child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:  # (it closed its end and runs on: never seen)
            print(f"cachefs: error: the daemon (pid {child.pid}) closed its start-up pipe "
                  f"without a word; see {log_path}", file=sys.stderr)
            return 1
        print(f"cachefs: error: the daemon exited during start-up (exit {code}); see "
              f"{log_path}", file=sys.stderr)
        return 1
    print(f"cachefs: error: unexpected start-up message {message!r}", file=sys.stderr)
    return 1


def _open_log(path: Path) -> int:
    """The log file, opened to append (created 0600: it names keys and paths, private to
    the mounting user like the cache). In a directory other users may write to
    (``/tmp/cachefs.log``), whoever made the name first would choose what is written
    into: a symbolic or hard link to a file of this user's (root's) is refused, and so is
    a file of another user's (the log handed to them)."""
    from cachefs.startup import open_private

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"refusing log file {path}: {why}, in a directory other users "
                           "may write to (give a log file in a directory of your own)")

    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    try:
        parent = os.stat(path.parent)
        shared = bool(parent.st_mode & 0o022) or parent.st_uid not in (0, os.geteuid())
        fd = open_private(path, flags | (os.O_NOFOLLOW if shared else 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP and shared:
            raise refuse("it is a symbolic link") from None
        raise ConfigError(f"cannot open log file {path}: {exc.strerror}") from None
    st = os.fstat(fd)
    why = None
    if shared and stat.S_ISREG(st.st_mode):
        if st.st_uid != os.geteuid():
            why = f"it belongs to uid {st.st_uid}, another user"
        elif st.st_nlink > 1:
            why = "it has other names (hard links)"
    elif shared and st.st_uid not in (0, os.geteuid()):
        why = f"it belongs to uid {st.st_uid}, another user"
    if why:
        os.close(fd)
        raise refuse(why)
    return fd


#: Signals that stop ``cachefs mount`` while it waits for its daemon (which is stopped
#: too), and how long it then waits for the daemon to end (an unmount, once ready).
STOPPED_BY = (signal.SIGINT, signal.SIGTERM)
STOP_WAIT = 30.0


class _Stopped(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame: Any) -> None:
    raise _Stopped(signum)


def _stop_daemon(child: subprocess.Popen[bytes]) -> bool:
    """SIGTERM to a starting daemon (before its mount: its end; after: held until it is
    ready, then an unmount), then wait for it; whether it ended within STOP_WAIT."""
    try:
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=STOP_WAIT)
    except subprocess.TimeoutExpired:
        return False
    return True


def _read_line(fd: int, timeout: float) -> str | None:
    """The daemon's start-up line from ``fd``: "" if the pipe closed without one (the
    daemon ended), None if none came within ``timeout`` seconds (``inf``: no limit)."""
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], None if math.isinf(left) else left)
        if not ready:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    return buf.decode(errors="replace").strip()


def cmd_unmount(args: argparse.Namespace) -> int:
    from cachefs.control import registry

    if args.mountpoint:
        mp = registry.as_mounted(args.mountpoint)
    elif args.config:
        values = load_config_file(args.config)
        if "mountpoint" not in values:
            raise ConfigError(f"config file {args.config!r} names no mountpoint")
        mp = registry.as_mounted(config_mountpoint(values["mountpoint"]))
    else:
        raise ConfigError("give the mount point (or --config FILE)")
    if not 0 <= args.timeout < float("inf"):  # (nan too)
        raise ConfigError(f"--timeout must be a number of seconds, not {args.timeout}")
    mounted = registry.cachefs_mounts()
    if str(mp) not in mounted:
        if args.quiet:
            return 0
        raise ConfigError(f"{mp} is not a cachefs mount")
    info = registry.lookup(mp)
    cmd = ["fusermount3", "-u", *(["-z"] if args.lazy else []), str(mp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        reason = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"
        under = registry.mounts_under(mp) if "busy" in reason.lower() else []
        if not args.lazy and under:  # (a mount on one of its folders: not open files)
            reason += (f"; {', '.join(under[:5])} {'is' if len(under) == 1 else 'are'} "
                       "mounted under it (unmount that first)")
        elif not args.lazy and "busy" in reason.lower():
            users = _users_of(mp)
            reason += ("; in use by " + ", ".join(users) if users else "; files are open under it")
            reason += " (close them, or --lazy: detach now, and their reads then fail)"
        print(f"cachefs: error: cannot unmount {mp}: {reason}", file=sys.stderr)
        return 1
    if info is not None and registry.is_daemon(int(info["pid"])):
        pid = int(info["pid"])
        if not _wait_for_exit(pid, args.timeout):
            print(f"cachefs: error: {mp} is unmounted, but its daemon (pid {pid}) is still "
                  f"running after {args.timeout:g}s (finishing its cache writes, or hung: see "
                  f"its log); its cache directory stays in use until it ends", file=sys.stderr)
            return 1
    return 0


def _users_of(mp: Path, most: int = 5) -> list[str]:
    """'pid (command)' of up to ``most`` processes with a descriptor or working directory
    under ``mp`` (what makes an unmount busy), as far as /proc lets this user see."""
    inside = str(mp).rstrip("/") + "/"
    users: list[str] = []
    for pid in sorted((p for p in os.listdir("/proc") if p.isdigit()), key=int):
        links = [f"/proc/{pid}/cwd"]
        try:
            links += [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            pass  # (gone, or another user's)
        for link in links:
            try:
                target = os.readlink(link)
            except OSError:
                continue
            if target == inside[:-1] or target.startswith(inside):
                try:
                    with open(f"/proc/{pid}/comm") as f:
                        users.append(f"pid {pid} ({f.read().strip()})")
                except OSError:
                    users.append(f"pid {pid}")
                break
        if len(users) >= most:
            break
    return users


def _wait_for_exit(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for process ``pid`` to end; whether it has."""
    from cachefs.control.registry import pid_alive

    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        try:  # reap it if it is our child (it is not, normally)
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return not pid_alive(pid)


def cmd_warm(args: argparse.Namespace) -> int:
    from cachefs.cli.warm import warm_main

    return warm_main(args.mountpoint, args.paths, manifest=args.manifest,
                     parallel=args.parallel, check=args.check, shard=args.shard)


def cmd_status(args: argparse.Namespace) -> int:
    from cachefs.cli.status import status_main

    return status_main(args.mountpoint, as_json=args.json)


SUBCOMMANDS = ("mount", "unmount", "umount", "status", "warm", "probe", "plan", "manifest")


def _run(args: argparse.Namespace) -> int:
    """Run the subcommand ``args`` names; its exit status."""
    if args.command == "mount":
        return cmd_mount(args)
    if args.command in ("unmount", "umount"):
        return cmd_unmount(args)
    if args.command == "status":
        return cmd_status(args)
    if args.command == "warm":
        return cmd_warm(args)
    if args.command == "probe":
        from cachefs.cli.probe import probe_main

        return probe_main(args)
    if args.command == "manifest":
        from cachefs.cli.manifest import export_main

        return export_main(args)
    if args.command == "plan":
        from cachefs.cli.plan import plan_main

        return plan_main(args)
    raise ConfigError(f"unknown command {args.command}")


class OutputError(CachefsError):
    """Standard output could not be written (a full disk under 'cachefs manifest export >
    dataset.csv', a quota, an I/O error): what was written is incomplete."""


class _GuardedOutput:
    """Standard output whose failed writes (but a reader gone: BrokenPipeError) raise
    OutputError, one line for the user, instead of an OSError traceback."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(f"cannot write the output: {exc.strerror or exc}") from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(f"cannot write the output: {exc.strerror or exc}") from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("s3://") and "-o" in argv:
        # mount.fuse3 runs "cachefs SOURCE MOUNTPOINT -o OPTIONS" for fstab type fuse.cachefs.
        from cachefs.cli.mount_helper import main as mount_helper_main

        return int(mount_helper_main(argv) or 0)
    parser = build_parser()
    argv = join_dash_values(parser, argv)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command == "warm" and not any(r.startswith("-") for r in rest):
        # argparse gives a positional list (nargs="*") only the words before the first
        # option: "warm MP --parallel 8 train/" leaves train/ over. They are paths too.
        args.paths = [*args.paths, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.argv = argv
    stdout = sys.stdout
    sys.stdout = _GuardedOutput(stdout)  # type: ignore[assignment]
    try:
        code = _run(args)
        sys.stdout.flush()  # here, so a reader gone is caught below, not at exit
        return code
    except OutputError as exc:
        print(f"cachefs: error: {exc}", file=sys.stderr)
        # What is still buffered cannot be written either: the interpreter's flush at exit
        # must not fail again (a second report, with a traceback).
        os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
        return 1
    except CachefsError as exc:
        print(f"cachefs: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Whoever read the output stopped reading (`cachefs plan ... | head`): nothing is
        # wrong here to report. Quiet, with the exit status of a process SIGPIPE ended,
        # as other command-line tools; stdout goes to /dev/null so the interpreter's own
        # flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
        return 128 + 13
    finally:
        sys.stdout = stdout


__all__ = ["build_parser", "main"]

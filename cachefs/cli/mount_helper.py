"""``mount.cachefs``: the mount(8) helper that lets /etc/fstab mount cachefs.

An fstab line such as::

    s3://bucket/prefix /mnt/data cachefs _netdev,cache_dir=/var/cache/cachefs,allow_other 0 0

makes mount(8) run::

    mount.cachefs s3://bucket/prefix /mnt/data [-s] [-f] [-n] [-v] -o rw,cache_dir=...

mount(8) looks for helpers only in /sbin (and /sbin/fs.d, /sbin/fs), so the
installed console script must be linked there as ``/sbin/mount.cachefs``.
Linking it as ``/sbin/mount.fuse.cachefs`` as well makes fstab type
``fuse.cachefs`` work too: mount(8) prefers that helper to the generic
mount.fuse3 and calls it the same way (it may add ``-t fuse.cachefs``).

The helper turns the options into ``cachefs mount SOURCE MOUNTPOINT --opt val
...`` (option names with underscores turned into dashes, exactly as in the
TOML config) and execs it with the interpreter it runs under, so the daemon
comes from the same installation as the helper. Generic mount options that
mean nothing to cachefs (``_netdev``, ``nofail``, ``x-systemd.*``, atime
variants...) are dropped; anything else unknown is an error unless mount(8)
was given ``-s`` (sloppy).

``rw`` is dropped rather than rejected: mount(8) adds ``rw`` to every helper
call whose options do not say ``ro``, so the helper cannot tell a user's
``rw`` from the default. The mount is read-only whatever the options say.
"""

from __future__ import annotations

import os
import shlex
import sys

from cachefs.config import OPTIONS
from cachefs.errors import CachefsError, ConfigError

PROG = "mount.cachefs"

#: cachefs options that take a value (``key=value`` in fstab, ``--key value`` on the CLI).
VALUE_OPTIONS = frozenset(o.name for o in OPTIONS if not o.flag)

#: cachefs options that are plain flags (``key`` in fstab, ``--key`` on the CLI).
FLAG_OPTIONS = frozenset(o.name for o in OPTIONS if o.flag)

#: Generic options handled by mount(8), systemd or the kernel mount flags; meaningless to
#: cachefs. mount(8) itself adds rw, and noexec,nosuid,nodev for ``user``; mount.fuse3
#: adds dev,suid.
IGNORED_OPTIONS = frozenset({
    "defaults", "auto", "noauto", "nofail", "_netdev", "user", "nouser", "users", "owner",
    "group", "ro", "rw", "exec", "noexec", "suid", "nosuid", "dev", "nodev", "async", "sync",
    "atime", "noatime", "diratime", "nodiratime", "relatime", "norelatime", "strictatime",
    "nostrictatime", "lazytime", "nolazytime",
})

#: Prefixes of generic options with a free-form part: x-systemd.automount,
#: x-systemd.requires=..., x-mount.mkdir, comment=systemd.automount...
IGNORED_PREFIXES = ("x-", "comment=")

#: File system types this helper answers for (``-t``).
FS_TYPES = ("cachefs", "fuse.cachefs")

USAGE = f"usage: {PROG} SOURCE MOUNTPOINT [-s] [-f] [-n] [-v] [-t TYPE] [-o OPTIONS]"


def fstab_options_to_argv(
    source: str, mountpoint: str, options: str, *, sloppy: bool = False
) -> list[str]:
    """Translate an fstab option string into the argument list of the ``cachefs`` CLI.

    Returns ``["mount", source, mountpoint, "--cache-dir", "/x", "--allow-other", ...]``
    with the cachefs options in the order given. Raises ConfigError for an unknown
    option (unless ``sloppy``), a flag given a value, or a value option without one.
    """
    argv = ["mount", source, mountpoint]
    for item in options.split(","):
        item = item.strip()
        if not item or item in IGNORED_OPTIONS or item.startswith(IGNORED_PREFIXES):
            continue
        key, has_value, value = item.partition("=")
        if key in FLAG_OPTIONS:
            if has_value:
                raise ConfigError(f"option {key!r} takes no value (got {item!r})")
            argv.append("--" + key.replace("_", "-"))
        elif key in VALUE_OPTIONS:
            if not has_value or not value:
                raise ConfigError(f"option {key!r} needs a value: {key}=...")
            argv += ["--" + key.replace("_", "-"), value]
        elif key in ("source", "mountpoint"):
            raise ConfigError(
                f"option {key!r} is not allowed: the {key} is the fstab field itself")
        elif not sloppy:
            raise ConfigError(f"unknown option {item!r}")
    return argv


def _parse_args(args: list[str]) -> tuple[str, str, str, dict[str, bool]]:
    """Split mount(8)'s helper arguments into source, mountpoint, options and flags."""
    positional: list[str] = []
    options: list[str] = []
    flags = {"sloppy": False, "fake": False, "verbose": False}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-o", "-t"):
            if i + 1 == len(args):
                raise ConfigError(f"{arg} needs an argument; {USAGE}")
            value = args[i + 1]
            i += 2
            if arg == "-o":
                options.append(value)
            elif value not in FS_TYPES:
                raise ConfigError(f"file system type {value!r} is not cachefs")
            continue
        if arg.startswith("-o") and len(arg) > 2:
            options.append(arg[2:])
        elif arg == "-s":
            flags["sloppy"] = True
        elif arg == "-f":
            flags["fake"] = True
        elif arg == "-v":
            flags["verbose"] = True
        elif arg == "-n":
            pass  # no /etc/mtab to skip: the kernel's mount table is the only one
        elif arg.startswith("-") and arg != "-":
            raise ConfigError(f"unknown argument {arg!r}; {USAGE}")
        else:
            positional.append(arg)
        i += 1
    if len(positional) != 2:
        raise ConfigError(f"expected SOURCE and MOUNTPOINT; {USAGE}")
    return positional[0], positional[1], ",".join(options), flags


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mount.cachefs`` console script; execs ``cachefs mount``."""
    args = sys.argv[1:] if argv is None else argv
    try:
        source, mountpoint, options, flags = _parse_args(args)
        cli_argv = fstab_options_to_argv(source, mountpoint, options, sloppy=flags["sloppy"])
    except CachefsError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    command = [sys.executable, "-m", "cachefs", *cli_argv]
    if flags["verbose"]:
        print(f"{PROG}: running {shlex.join(command)}", file=sys.stderr)
    if flags["fake"]:
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, command)
    except OSError as exc:
        print(f"{PROG}: cannot run {sys.executable}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0  # not reached: execv replaced the process


if __name__ == "__main__":
    raise SystemExit(main())

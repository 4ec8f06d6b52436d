"""The FUSE kernel protocol: opcodes, message layouts and the INIT negotiation.

Pure data and packing (no I/O), after ``include/linux/fuse.h`` (protocol 7.x;
cachefs speaks minor 40 and accepts kernels from minor 31, Linux 5.4 on). A
request read from the device is a ``fuse_in_header`` (:data:`IN_HEADER`)
followed by the operation's arguments; a reply is a ``fuse_out_header``
(:data:`OUT_HEADER`: length, negative errno, the request's ``unique``)
followed by the operation's answer. FORGET and BATCH_FORGET get no reply.
"""

from __future__ import annotations

import dataclasses
import stat
import struct

# -- opcodes (enum fuse_opcode) ----------------------------------------------------
LOOKUP = 1
FORGET = 2
GETATTR = 3
SETATTR = 4
READLINK = 5
SYMLINK = 6
MKNOD = 8
MKDIR = 9
UNLINK = 10
RMDIR = 11
RENAME = 12
LINK = 13
OPEN = 14
READ = 15
WRITE = 16
STATFS = 17
RELEASE = 18
FSYNC = 20
SETXATTR = 21
GETXATTR = 22
LISTXATTR = 23
REMOVEXATTR = 24
FLUSH = 25
INIT = 26
OPENDIR = 27
READDIR = 28
RELEASEDIR = 29
FSYNCDIR = 30
GETLK = 31
SETLK = 32
SETLKW = 33
ACCESS = 34
CREATE = 35
INTERRUPT = 36
BMAP = 37
DESTROY = 38
IOCTL = 39
POLL = 40
BATCH_FORGET = 42
FALLOCATE = 43
READDIRPLUS = 44
RENAME2 = 45
LSEEK = 46
COPY_FILE_RANGE = 47
TMPFILE = 51
STATX = 52

#: Operations that would modify the file system: answered EROFS.
MODIFYING = frozenset({SETATTR, SYMLINK, MKNOD, MKDIR, UNLINK, RMDIR, RENAME, LINK, WRITE,
                       SETXATTR, REMOVEXATTR, CREATE, FALLOCATE, RENAME2, COPY_FILE_RANGE,
                       TMPFILE})

# -- INIT flags ------------------------------------------------------------------------
ASYNC_READ = 1 << 0
EXPORT_SUPPORT = 1 << 4
DO_READDIRPLUS = 1 << 13
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22
INIT_EXT = 1 << 30
PASSTHROUGH = 1 << 37  # in flags2 (bit 5) on the wire

# -- open reply flags (FOPEN_*) -----------------------------------------------------------
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NOFLUSH = 1 << 5
FOPEN_PASSTHROUGH = 1 << 7

#: The unique id of an INTERRUPT request has this bit set in replies' eyes (FUSE_INT_REQ_BIT).
KERNEL_MAJOR = 7
KERNEL_MINOR = 40
MIN_KERNEL_MINOR = 31

# -- layouts -------------------------------------------------------------------------------
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, extlen, pad
OUT_HEADER = struct.Struct("<IiQ")  # len, error (negative errno), unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr (88 bytes)
ENTRY_HEAD = struct.Struct("<QQQQII")  # nodeid, generation, entry/attr valid (s), nsec x2
ATTR_HEAD = struct.Struct("<QII")  # attr_valid, attr_valid_nsec, dummy
OPEN_IN = struct.Struct("<II")  # flags, open_flags
OPEN_OUT = struct.Struct("<QIi")  # fh, open_flags, backing_id
READ_IN = struct.Struct("<QQII")  # fh, offset, size, read_flags (lock_owner, flags follow)
RELEASE_IN = struct.Struct("<QII")  # fh, flags, release_flags (lock_owner follows)
GETATTR_IN = struct.Struct("<IIQ")  # getattr_flags, dummy, fh
GETATTR_FH = 1 << 0  # getattr_flags: fh is the open file the kernel asks for
ACCESS_IN = struct.Struct("<II")  # mask, padding
GETXATTR_IN = struct.Struct("<II")  # size, padding
GETXATTR_OUT = struct.Struct("<II")  # size, padding
INTERRUPT_IN = struct.Struct("<Q")  # unique of the interrupted request
BATCH_FORGET_IN = struct.Struct("<II")  # count, dummy
INIT_IN = struct.Struct("<IIIII")  # major, minor, max_readahead, flags, flags2
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")  # 64 bytes
KSTATFS = struct.Struct("<QQQQQIIII24x")  # blocks, bfree, bavail, files, ffree, bsize, namelen, frsize
DIRENT = struct.Struct("<QQII")  # ino, off (position of the next entry), namelen, type

#: Bytes a request buffer must hold: the kernel refuses reads into anything smaller than
#: a WRITE request of max_write bytes (the mount is read-only, but the rule stands).
MAX_WRITE = 128 * 1024
BUFFER_SIZE = MAX_WRITE + 4096
#: The largest read request (max_pages x 4 KiB): 1 MiB, what --read-ahead may ask for.
MAX_PAGES_VALUE = 256
MAX_READ = MAX_PAGES_VALUE * 4096


class ProtocolError(Exception):
    """The kernel speaks a protocol cachefs cannot serve (one clear line)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Negotiated:
    """What INIT settled: the protocol minor version and the features in use."""

    minor: int
    passthrough: bool
    max_readahead: int


def negotiate(body: bytes | memoryview, *, want_passthrough: bool) -> tuple[bytes, Negotiated]:
    """The INIT reply body for the kernel's INIT arguments ``body``, and what it settled.

    Raises ProtocolError for a kernel too old (or too new in its major version)."""
    major, minor, max_readahead, flags, flags2 = INIT_IN.unpack_from(body)
    if major != KERNEL_MAJOR:
        raise ProtocolError(f"the kernel speaks FUSE {major}.{minor}; cachefs needs 7.x")
    if minor < MIN_KERNEL_MINOR:
        raise ProtocolError(f"the kernel speaks FUSE 7.{minor}; cachefs needs 7.{MIN_KERNEL_MINOR} "
                            "(Linux 5.4) or newer")
    offered = flags | (flags2 << 32 if flags & INIT_EXT else 0)
    want = ASYNC_READ | EXPORT_SUPPORT | DO_READDIRPLUS | PARALLEL_DIROPS | MAX_PAGES | INIT_EXT
    passthrough = bool(want_passthrough and offered & PASSTHROUGH)
    if passthrough:
        want |= PASSTHROUGH
    granted = want & offered
    reply = INIT_OUT.pack(
        KERNEL_MAJOR, min(minor, KERNEL_MINOR), max_readahead, granted & 0xFFFFFFFF,
        0, 0,  # max_background, congestion_threshold: the kernel's defaults
        MAX_WRITE, 1,  # max_write, time_gran (ns)
        MAX_PAGES_VALUE, 0,  # max_pages, map_alignment
        granted >> 32,
        1 if passthrough else 0)  # max_stack_depth: backing files on a plain file system
    return reply, Negotiated(min(minor, KERNEL_MINOR), passthrough, max_readahead)


# -- answers ------------------------------------------------------------------------------
def attr(ino: int, is_dir: bool, size: int, mtime: float, *, uid: int, gid: int,
         file_mode: int, dir_mode: int) -> bytes:
    """A fuse_attr."""
    secs = int(mtime)
    nsec = int((mtime - secs) * 1e9)
    if is_dir:
        return ATTR.pack(ino, 0, 0, secs, secs, secs, nsec, nsec, nsec,
                         stat.S_IFDIR | dir_mode, 2, uid, gid, 0, 1 << 20, 0)
    return ATTR.pack(ino, size, (size + 511) // 512, secs, secs, secs, nsec, nsec, nsec,
                     stat.S_IFREG | file_mode, 1, uid, gid, 0, 1 << 20, 0)


def split_timeout(seconds: float) -> tuple[int, int]:
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


def entry_out(ino: int, attr_bytes: bytes, timeout: tuple[int, int]) -> bytes:
    """A fuse_entry_out: the inode, its attributes and how long the kernel may keep both."""
    return ENTRY_HEAD.pack(ino, 0, timeout[0], timeout[0], timeout[1], timeout[1]) + attr_bytes


def attr_out(attr_bytes: bytes, timeout: tuple[int, int]) -> bytes:
    return ATTR_HEAD.pack(timeout[0], timeout[1], 0) + attr_bytes


def open_out(fh: int, flags: int, backing_id: int = 0) -> bytes:
    return OPEN_OUT.pack(fh, flags, backing_id)


def statfs_out(capacity: int, used: int) -> bytes:
    blocks = capacity // 4096
    free = max(0, capacity - used) // 4096
    return KSTATFS.pack(blocks, free, free, 0, 0, 4096, 255, 4096, 0)


def dirent_plus(entry: bytes, ino: int, next_pos: int, name: bytes, is_dir: bool) -> bytes:
    """One fuse_direntplus record (entry_out + dirent + name, padded to 8 bytes)."""
    kind = (stat.S_IFDIR if is_dir else stat.S_IFREG) >> 12
    rec = entry + DIRENT.pack(ino, next_pos, len(name), kind) + name
    return rec + b"\0" * (-len(rec) % 8)


def dirent(ino: int, next_pos: int, name: bytes, is_dir: bool) -> bytes:
    """One fuse_dirent record (plain READDIR)."""
    kind = (stat.S_IFDIR if is_dir else stat.S_IFREG) >> 12
    rec = DIRENT.pack(ino, next_pos, len(name), kind) + name
    return rec + b"\0" * (-len(rec) % 8)

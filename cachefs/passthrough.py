"""FUSE passthrough: the kernel reads fully cached objects straight from their cache file.

When the kernel grants it at INIT (Linux >= 6.9; see :mod:`cachefs.fuse.abi`)
and the daemon holds CAP_SYS_ADMIN, an open of an object whose every block is
cached is answered with a *backing id* for the object's cache file
(registered through the FUSE device, :class:`BackingDevice`). The kernel then
serves ``read()`` on that handle from the file itself, page cache included,
and the daemon sees no read request for it: warm reads cost what local disk
reads cost.

Contracts:

* A cache file is handed to the kernel only after every block of the object
  passed its length and checksum test (the test every daemon read makes), when
  it is registered. Verifying reads the whole file, which also leaves it in the
  page cache, where the kernel's reads then find it -- unless this daemon wrote
  every block of that file itself from checked bytes and released none since
  (:meth:`~cachefs.cache.blocks.BlockCache.verify_object`: written marks), as
  for the files a cold pass fetches just before their open; and a small file a
  prediction waits for is registered by the S3 thread that checked its bytes, as it
  writes them (below), which is what the written marks would say. The file's stamp
  (inode and change time) taken before it was verified (or just after that thread's
  write) is kept with the registration and
  checked again at each open (here, :meth:`Passthrough.open`, and in the native loop's
  template opens and reads): a file someone else wrote to since is closed and verified
  again when idle, and its opens fail with EIO while handles still use it (closed once
  they are gone); the cache's own writes of checked blocks into it are not a change
  (:meth:`Passthrough.written` moves the registration's stamp with each of them). A
  registered file stays
  registered while handles use it and, idle, until it is among the least
  recently used beyond ``max_idle`` files (``--registered-files``: by default
  scaled to the memory, at least :data:`MAX_IDLE_BACKINGS`; fewer when the
  open-file limit binds, see :mod:`cachefs.descriptors`) or the cache evicts its blocks; reopening it
  meanwhile needs no verification. Objects larger than :data:`MAX_OBJECT_BYTES`
  are passed through only when no block of their file needs reading back (written
  marks), and served by the daemon otherwise -- at that open: the open queues the object
  for one read-back in the background (below), after which its opens are passed through.
* Read-back in the background. An object cached whole whose file an open cannot register
  without reading it back (over :data:`MAX_OBJECT_BYTES`, cached by an earlier daemon:
  the marks of its life are gone), or that a bind of a handle found marked but not
  trusted (:meth:`Passthrough.upgrade`, any size; rare: it is tried once every block is
  marked), is queued
  (:meth:`Passthrough.read_back_later`, at most :data:`READ_BACK_QUEUE`, each object
  once) for one thread that reads it back (:meth:`Passthrough.read_back`): the check every
  registration makes (:meth:`~cachefs.cache.blocks.BlockCache.verify_object` through a
  descriptor of the file, under a yielding pin), one block at a time, resting after each
  :data:`READ_BACK_CHUNK` bytes as long as they took to read (times
  :data:`READ_BACK_REST`), and giving up as soon as a block is no longer indexed as when it
  started (evicted, or stored anew) or the daemon stops. A block that fails is dropped as
  corrupt, exactly as at an open (refetched when read; the object is read back again once
  it is cached whole again and opened); when every block passes, the file holds marks as
  if this daemon had written it, so the object's next open registers it without reading
  it (and a handle of it opened before, served by the daemon, is bound to the native
  loop at its next READ: :meth:`Passthrough.upgrade_due`). Nothing is
  registered by the read-back itself: it only takes what an open would read off the open.
* While registered, an object is pinned in the block cache: its bytes are never
  punched out of its file (an evicted block's hole would read as zeros; see
  :meth:`~cachefs.cache.blocks.BlockCache.pin` for how pins and evictions
  interleave), and nothing else writes to its file (blocks are written once,
  before they are indexed; a block evicted from the index but kept for the
  kernel may be written again, with the same bytes). The pin is taken before
  the file is opened and verified, and the descriptor verified is the one
  handed to the kernel. While handles use the registration the pin keeps
  eviction away too; idle, the pin *yields*: eviction may drop the object's
  blocks from the index (so idle registrations never cost the cache room:
  their number is the only bound), the cache tells :meth:`Passthrough.evicted`,
  and the registration is closed -- at once, or within
  :data:`EVICTED_RECHECK_SECONDS` of the native loop's last handle of it closing --
  which releases the bytes. Until then new opens may
  still use it: the bytes it reads are kept.
* The kernel allows one I/O mode and one backing file per inode at a time:
  while an inode has handles served by the daemon, no passthrough is granted;
  while it has passed-through handles, every new open shares their file. An
  inode is one object version (see :mod:`cachefs.fs`), so that file always
  holds the version the new handle opened.
* A handle opened before its object was cached whole is served by the daemon for
  its life (the kernel set its mode at the open). Once the object is cached whole
  and registered, such a handle is bound to the native loop (:meth:`Passthrough.upgrade`,
  tried at its READs): with the loop's reads, it uses the registration as a handle
  opened on it would; with the kernel's passthrough, the file is also registered with
  the loop, beside the kernel, once for all such handles of the inode, each of which
  still counts as served by the daemon for the one-mode rule and holds the registration
  (pinned) until its release (:meth:`Passthrough.release_beside`).
* Verification need not wait for the open: files the directory lookahead
  predicts (:meth:`Passthrough.predicted`; one still being fetched is queued
  once its load settles, :meth:`Passthrough.settled`), and files opened before they were
  cached once their last handle closes (for the next epoch's open, and only while
  the idle bounds have room for them without closing another), are verified
  and registered ahead by :data:`PREPARE_THREADS` preparing threads
  (:meth:`Passthrough.prepare`, same pin, same checks, same descriptor) and left
  idle: their next open takes the backing without reading the disk. Only
  objects up to :data:`PREPARE_MAX_BYTES` are, from a queue of at most
  :data:`PREPARE_QUEUE` (further predictions are dropped: those opens verify
  themselves). The idle bounds above bound what this pins.
* Registered by the thread that wrote it. A predicted file still being fetched waits for
  its load (``_awaiting``). When it is a whole object of one block (a small file: one
  whole-object GET), the S3 thread that has just checked its bytes against S3 takes it
  from there (:meth:`Passthrough.write_checked`, the fetcher's sink) and, instead of
  handing it to a preparing thread once the load settles, pins the object, writes the
  block and indexes it (:meth:`~cachefs.cache.blocks.BlockCache.put_kept`), and registers
  the file with the descriptor it wrote through, left idle with its template ahead, like
  a preparing thread's registration. No index read, no second open, no comparison with
  the written marks: the pin taken before the write keeps eviction from choosing the
  block and defers any release of the object's bytes from then on, so the file handed
  over holds the bytes checked against S3 for this version, indexed with their
  checksum -- what that comparison would conclude. It is published in ``_backings``
  only once registered, so no open waits on it; an open that registered the object
  first (through the written marks) keeps its own registration, and the S3 thread
  closes its one. When the block is not admitted, passthrough is off or the object is
  registered already, nothing is registered here (the tier writes it, or not, as for
  any file).
* An object whose file is gone by the time it is opened (evicted since the
  index was consulted) is a miss for that open only: the daemon serves it. If
  the kernel refuses a backing (no CAP_SYS_ADMIN, passthrough not granted at
  INIT), passthrough is switched off for the mount, logged once, and reads go
  through the daemon as before; other refusals decline that open only.

* Opens answered by the native loop. A file opened here with a registered backing
  (kernel or native) is given an *open template* in the request workers' native loop
  (:meth:`Passthrough.add_template`, at most :attr:`Passthrough.max_templates`): the
  loop answers the inode's next read-only opens (not O_DIRECT) and their releases
  itself, the same way, and Python learns of those handles afterwards, in order
  (:meth:`Passthrough.adopted`; see :mod:`cachefs.fuse_ops`). Those handles are not in
  ``opens``: the loop counts them per template, and a registration whose inode has a
  template is closed only after its template could be dropped, which the loop refuses
  while a handle it opened with it is open -- so such a handle keeps the pin and the
  kernel's backing exactly as a handle opened here does. An inode with a template counts
  as passed through for the one-mode rule above (the loop may have handles of it open).
  A file the directory lookahead predicted gets its template as soon as a preparing thread
  has registered it (:attr:`Passthrough.on_prepared`, :meth:`Passthrough.add_template_ahead`),
  before any open of it: a cold walk's first opens are the loop's too. Not a file read cold in
  Python and registered at its close: its next open, in Python, gives it one.

Concurrency: opens and releases run on the FUSE request workers, several at a
time, and so does :meth:`Passthrough.upgrade` (at a READ of the handle it binds: the
kernel sends no RELEASE of a handle while one of its READs runs, but may send several
READs of it at once, so the caller lets one at a time try, and each handle takes its
use once (:meth:`cachefs.fs.FileSystem.bind_later`); it registers outside
``_lock`` like an open, and moves the handle from ``_direct`` to ``_active`` under it); a preparing thread calls
``on_prepared`` holding none of this class's locks (it
takes the file system's, then ``_lock`` in :meth:`Passthrough.add_template_ahead`);
predictions and settled loads arrive on the trio thread (they only queue). ``_awaiting``
is guarded by ``_awaiting_lock`` (held for a dictionary operation only, never with another
lock: the trio thread adds to it and takes from it, an S3 thread in
:meth:`Passthrough.write_checked` takes its object from it). That S3 thread then holds none
of this class's locks while it writes (the cache's locks) and registers the file (the
ioctl); it takes ``_lock`` to publish the registration (and, for a prediction that may
only take spare room, before the write to take that room), and calls ``on_prepared`` holding
none, as a preparing thread does. Its owner is the fetcher's sink gate: the write and
registration run inside it, and :meth:`cachefs.read.fetcher.Fetcher.run` waits for them
before it returns (a prediction taken after :meth:`Passthrough.run` stopped the preparing
threads finds ``_awaiting`` empty). ``_lock`` guards
``_backings``, ``_active``, ``_direct``, ``_beside``, ``_fetched``, ``_idle``,
``_spare_taken`` and ``_evicted_idle`` (held for dictionary work and the close ioctl
only, never while a file is verified);
``_queue_cond`` guards the preparing threads' queue and ``_landing`` (never held with
``_lock``); ``_read_back_cond`` guards the read-back queue ``_read_backs`` and
``_reading_back`` (never held with another lock of this class: an open queues an object
after its registration failed, outside ``_lock``); ``_templates`` and each backing's
``templates`` are under ``_lock`` too, and
the loop's calls made under it (adding and dropping templates) take only the loop's own
locks. Verification and the backing ioctl run on the opening worker or a
preparing thread (either may wait on the disk); whoever puts an object's entry
in ``_backings`` first verifies it, and opens of that object meanwhile wait for
its outcome (one registration per object at a time). The preparing threads
belong to :meth:`Passthrough.run` (a task of the daemon's nursery), which
joins them before it returns, so none outlives the cache index; so does the read-back
thread (the stop event ends its rests and makes its check give up at the next block); its
other task
looks at ``_evicted_idle`` every :data:`EVICTED_RECHECK_SECONDS` and, when not
empty, trims in a worker thread (never on the trio thread: it takes ``_lock``). The
cache calls :meth:`Passthrough.evicted` holding none of its locks; under ``_lock`` this class calls
the cache's pin methods (they take only the cache's innermost lock). The cache calls
:meth:`Passthrough.written` holding an object's lock: it takes no lock of this class (a
peek at ``_backings``, one attribute written; the object's lock orders the writes that
move a registration's stamp) and only the native loop's mutex (``stamp_file``). An open
that finds a registration's stamp moved (:meth:`Passthrough._still_intact`) takes that
object's lock (``settled_stamp``) holding none of this class's locks, so the two never
wait for each other.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Protocol

import trio

from cachefs import failpoints, metrics
from cachefs.background import own_threads
from cachefs.cache.blockid import split_block_id
from cachefs.cache.blocks import BlockCache
from cachefs.cache.objectfiles import FileStamp, file_stamp, path_stamp
from cachefs.errors import CacheError, ObjectChanged
from cachefs.read.fetcher import Fetcher, ObjectVersion
from cachefs.read.prefetcher import PrefetchLedger

log = logging.getLogger(__name__)

#: Larger objects are passed through only when their file needs no reading back to be
#: verified (this daemon wrote or checked every block of it and released none since: the
#: written marks of cachefs.cache.blocks), as after a first epoch that fetched them;
#: otherwise they are served by the daemon: reading one whole at its open would cost a
#: random reader more than it reads. (Served by the daemon, warm reads of a 1.5 GiB shard
#: ran at 0.1 of local disk; passed through, 0.7-0.8: benchmarks/RESULTS.md.) Such an open
#: queues the object for the read-back in the background instead (read_back_later).
MAX_OBJECT_BYTES = failpoints.tuned("MAX_OBJECT_BYTES", 1 << 30)
#: Idle backings kept registered unless told otherwise (the least ``--registered-files
#: auto`` gives, :data:`cachefs.config.REGISTERED_FILES_AUTO_MIN`, is the same number; this
#: unit may not import config; each holds one open file in the kernel, about 1 KiB of kernel
#: memory with its inode and dentry). A dataset with more files than the bound re-registers
#: each file every epoch (an open and two ioctls, and a read-back if this daemon did not
#: write or check it), so the bound is set well above a node's share of files: 4,096 made
#: warm epochs over 4,800 files 2x slower, 65,536 warm epochs over 80,000 files 2.3x.
MAX_IDLE_BACKINGS = 65536
#: Files predicted to be opened next (directory lookahead) are verified and registered
#: ahead of their open by this many threads, so that the open finds its backing ready
#: and answers without reading the disk. Each waits on the disk most of the time (a
#: cache file's inode and bytes after the page cache was dropped).
PREPARE_THREADS = 2
#: Predictions waiting for those threads; beyond this they are dropped (the open then
#: verifies its file itself, as without them).
PREPARE_QUEUE = 256
#: Predicted objects still being fetched, remembered until their load settles (then
#: queued like any prediction); beyond this, further ones are dropped.
AWAITING_LOADS = 512
#: The largest READ the kernel sends (``cachefs.fuse.abi.MAX_READ``): the native loop reads
#: an object up to this size in one READ, which reaches its end (see reads_itself).
LOOP_ONE_READ = 1 << 20
#: Only objects up to this size are verified ahead: a wrong prediction costs one read
#: of the file.
PREPARE_MAX_BYTES = 8 << 20
#: Objects waiting for the read-back thread (see the module docstring); beyond this,
#: further ones are dropped (counted): their next open queues them again.
READ_BACK_QUEUE = 64
#: The read-back reads one block at a time and, after each this many bytes, rests for
#: READ_BACK_REST times as long as they took to read: with 1.0, readers find the disk
#: (and a core, for the checksums) free of it at least half the time.
READ_BACK_CHUNK = 64 << 20
READ_BACK_REST = 1.0
#: A file closed while some of its blocks were still being written to the cache
#: (reads are answered before their blocks are on disk) is looked at again every
#: LANDING_DELAY seconds for as long as a block of it is still being loaded or written
#: (a load ends: its GET has a deadline, its write-back an outcome), however slow the
#: disk; LANDING_LIMIT only bounds a load that never ends (a bug), after which its
#: registration is given up. (A count of tries was a bound on the disk's speed: on a
#: busy machine the writes outlasted it and the file was never registered.)
LANDING_DELAY = 0.05
LANDING_LIMIT = 300.0
#: The native loop's releases reach Python only as batched bookkeeping events, drained
#: on whichever thread comes first (the trio thread while no request reaches Python),
#: where a close -- this class's lock, then file I/O to free the bytes -- must not run. So
#: an evicted idle registration the loop still had a handle of is looked at again this
#: often, from a worker thread (and at every release here): its bytes, above the cache's
#: size, are freed within this after the handle's close even on a mount where nothing
#: else happens.
EVICTED_RECHECK_SECONDS = 1.0
#: Refusals of a backing that mean the mount cannot use passthrough at all.
_UNSUPPORTED = frozenset({errno.EPERM, errno.EACCES, errno.EOPNOTSUPP, errno.ENOTTY,
                          errno.ENOSYS, errno.EINVAL})
#: The process is out of descriptors (cachefs.descriptors).
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})
#: The first kernel with FUSE passthrough.
_KERNEL = (6, 9)


#: cachefs_passthrough_prepared_total by outcome (an S3 thread counts each file it registers:
#: the label looked up once)
_PREPARED = {outcome: metrics.PASSTHROUGH_PREPARED.labels(outcome)
             for outcome in metrics.PASSTHROUGH_PREPARE_OUTCOMES}

#: The event of every settled registration (see _Backing.ready).
_SETTLED = threading.Event()
_SETTLED.set()


def supported() -> bool:
    """Whether this kernel can let a FUSE file system hand files to it (Linux >= 6.9;
    whether it does is settled at INIT, and the daemon needs CAP_SYS_ADMIN)."""
    try:
        parts = os.uname().release.split(".")
        return (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)) >= _KERNEL
    except (ValueError, IndexError):
        return False


class OpenLoop(Protocol):
    """The request workers' native loop (:class:`cachefs.fuse.native.NativeReads`), which
    answers the opens of inodes it has a template for."""

    def add_template(self, ino: int, *, token: int, prefix: str, kernel_backing: int = 0,
                     native_backing: int = 0, size: int = 0, path: str | None = None,
                     stamp: FileStamp | None = None) -> bool:
        ...

    def stamp_file(self, backing_id: int, stamp: FileStamp) -> bool:
        ...

    def drop_template(self, ino: int) -> bool:
        ...


class BackingDevice(Protocol):
    """Registers backing files with the kernel (:class:`cachefs.fuse.device.Device`)."""

    def backing_open(self, fd: int) -> int:
        ...

    def backing_close(self, backing_id: int) -> None:
        ...


@dataclasses.dataclass(slots=True)
class _Backing:
    """One object's cache file registered with the kernel."""

    oid: bytes
    size: int
    ready: threading.Event  # set once verified (or failed); then the shared _SETTLED
    backing_id: int = 0
    opens: int = 0  # open handles using it, over all inodes (Python's; see templates)
    # The cache evicted its blocks (a yielding pin kept their bytes): closed as soon as
    # no handle uses it instead of being left idle.
    evicted: bool = False
    # Inodes whose opens the native loop answers with this backing (open templates;
    # None until the first: most registrations have one or none, and an empty set is
    # 216 bytes, times up to --registered-files).
    templates: set[int] | None = None
    # The file's stamp when it was verified (None: not taken); see _still_intact.
    stamp: FileStamp | None = None
    # Found changed by someone else while handles used it: its opens are refused (EIO)
    # and it is closed once they are gone, never left idle.
    changed: bool = False


class Passthrough:
    """Decides per open whether the kernel reads the cache file itself, and keeps the
    registered backing files (in use, and recently used idle ones)."""

    def __init__(self, fetcher: Fetcher, cache: BlockCache, ledger: PrefetchLedger, *,
                 enabled: bool, max_idle: int = MAX_IDLE_BACKINGS,
                 max_native_idle: int | None = None) -> None:
        self.fetcher = fetcher
        self.cache = cache
        self.ledger = ledger
        # Until the device is attached (after INIT granted passthrough) nothing is passed.
        self.wanted = enabled and supported()
        self.enabled = False  # files are registered (with the kernel or the native loop)
        self.native = False  # ... with the native loop (attach_device)
        self._device: BackingDevice | None = None
        # The native loop, when the workers run it: it answers the opens of inodes with a
        # template (add_template), without Python.
        self._loop: OpenLoop | None = None
        # Inodes with a template -> their object id, oldest first (bounded: max_templates).
        self._templates: OrderedDict[int, bytes] = OrderedDict()
        self.max_templates = max_idle
        self._lock = threading.Lock()
        self._backings: dict[bytes, _Backing] = {}  # by object id
        self._active: dict[int, tuple[bytes, int]] = {}  # inode -> (object id, handles)
        self._direct: dict[int, int] = {}  # handles served by the daemon, per inode
        # With the kernel's passthrough: inodes whose handles served by the daemon read its
        # registered file through the native loop since (upgrade) -> (object id, the file's
        # id with the loop, 0 while it is being registered; those handles). Still counted
        # in _direct: the kernel set their mode.
        self._beside: dict[int, tuple[bytes, int, int]] = {}
        # The native loop as a second place to register files, beside the kernel (None
        # without the kernel's passthrough, or without the loop).
        self._loop_files: BackingDevice | None = None
        # Inodes among those whose object was not fully cached when opened (registered
        # ahead of the next open once their handles are closed; see release)
        self._fetched: dict[int, ObjectVersion] = {}
        # Backings with no open handle, least recently used first. They stay registered
        # so the next open of the object needs no verification and no thread hop, their
        # objects pinned with a yielding pin (eviction may take them: see yielded);
        # bounded in number.
        self._idle: OrderedDict[bytes, None] = OrderedDict()
        self.max_idle = max_idle
        # Idle backings the cache evicted that could not be closed yet (the native loop
        # had handles open with their template): tried again at every trim.
        self._evicted_idle: set[bytes] = set()
        self._bound_told = False  # (the log said the number bound binds)
        # Registrations being made ahead that may only take free room among the idle ones
        # (spare: see prepare, predicted), counted in that room until they are idle.
        self._spare_taken = 0
        # Registered with the native loop, each file holds open descriptors: the open-file
        # limit bounds them too (cachefs.descriptors; applied in attach_device).
        self.max_native_idle = max_native_idle
        self._descriptors_warned = False
        self._unknown_told = False  # (the log said a release was of an unknown id)
        # Predicted opens waiting for the preparing threads (bounded: PREPARE_QUEUE)
        # (object, whether it may only take free room among the idle backings, inode or 0)
        self._queue: deque[tuple[ObjectVersion, bool, int]] = deque()
        # Predicted objects being fetched (their inode, 0 if unknown, and whether they
        # may only take free room among the idle backings: see predicted), by the id of a
        # block still loading (bounded: AWAITING_LOADS): added on the trio thread, taken
        # by the S3 thread that writes the block of a small one (write_checked) or, when
        # that load settles, queued (see settled); under _awaiting_lock
        self._awaiting: dict[bytes, tuple[ObjectVersion, int, bool]] = {}
        self._awaiting_lock = threading.Lock()
        # Objects to look at again once their blocks have landed on disk: (when, object,
        # spare, tries so far, inode); one fixed delay, so in order of when. Counted in the
        # bound.
        # (due, object, spare, first found landing, inode), in order of due time
        self._landing: deque[tuple[float, ObjectVersion, bool, float, int]] = deque()
        # Told (a preparing thread) of each object registered ahead whose inode is known:
        # (inode, object). The file system offers the native loop a template for it
        # (cachefs.fs.FileSystem.offer_template_ahead), so even the first open of a file a
        # cold walk fetched ahead is answered without Python.
        self.on_prepared: Callable[[int, ObjectVersion], None] | None = None
        self._queue_cond = threading.Condition(threading.Lock())
        self._stopping = False
        # Objects to read back in the background, by object id, oldest first (bounded:
        # READ_BACK_QUEUE), and the one being read back (see read_back_later).
        self._read_backs: OrderedDict[bytes, ObjectVersion] = OrderedDict()
        self._reading_back: bytes | None = None
        self._read_back_cond = threading.Condition(threading.Lock())
        self._read_back_stop = threading.Event()
        metrics.PASSTHROUGH_ENABLED.set(0)

    def attach_device(self, device: BackingDevice | None,
                      native: BackingDevice | None = None,
                      loop: OpenLoop | None = None) -> None:
        """The mount's device, once INIT settled whether the kernel passes files through
        (None: it does not); before this, every open is served by the daemon. Without the
        kernel, ``native`` (:class:`cachefs.fuse.native.NativeReads`), when given, takes
        its place: files are registered with it under the same rules, and the request
        workers' native loop answers the reads of their handles (:attr:`native`). ``loop``,
        when given, answers the opens of inodes given a template (:meth:`add_template`)."""
        kernel = self.wanted and device is not None
        self._device = device if kernel else native
        self._loop_files = native if kernel else None
        self._loop = loop
        self.native = not kernel and native is not None
        if self.native and self.max_native_idle is not None:
            bound = self.max_native_idle
            if bound < self.max_idle:
                log.info("the open-file limit leaves room for %d cache files registered for "
                         "reads without the daemon's Python (raise LimitNOFILE for more)",
                         bound)
            self.max_idle = min(self.max_idle, bound)
        self.enabled = self._device is not None
        metrics.PASSTHROUGH_ENABLED.set(1 if kernel else 0)
        metrics.NATIVE_READS_ENABLED.set(1 if self.native else 0)

    async def run(self, *, threads: int = PREPARE_THREADS,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the threads that verify predicted files ahead of their open (see
        :meth:`predicted`), the thread that reads back large files in the background (see
        :meth:`read_back_later`), and the task that closes evicted registrations once the
        native loop's handles of them are closed (:meth:`close_evicted`), until
        cancelled; the threads are stopped and joined before this returns (each finishes
        the file it is verifying first; a read-back gives up at its next block), so none
        touches the cache index after its owner's nursery ends."""
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(
                own_threads, self._prepare_loop, threads, "cachefs-verify",
                stop=self._stop_preparing))
            await nursery.start(functools.partial(
                own_threads, self._read_back_loop, 1, "cachefs-readback",
                stop=self._stop_reading_back))
            nursery.start_soon(self._recheck_evicted)
            task_status.started()

    async def _recheck_evicted(self) -> None:
        while True:
            await trio.sleep(EVICTED_RECHECK_SECONDS)
            if self._evicted_idle:  # (read without the lock: a hint; usually empty)
                await trio.to_thread.run_sync(self.close_evicted)

    def close_evicted(self) -> None:
        """Close the evicted idle registrations no handle uses any more, and free their
        bytes (a worker thread: the release takes the objects' locks and punches or
        removes their files; the lock is held for the template drops and close ioctls
        only). One the native loop still has a handle of stays until a later call."""
        with self._lock:
            if not self._evicted_idle:
                return
            self._trim_idle()
        # (now, not at the next put or maintenance pass: nothing else may happen soon)
        self.cache.release_deferred()

    def _stop_preparing(self) -> None:
        with self._queue_cond:
            self._stopping = True
            self._queue.clear()
            self._landing.clear()
            self._queue_cond.notify_all()
        with self._awaiting_lock:
            self._awaiting.clear()

    def _stop_reading_back(self) -> None:
        self._read_back_stop.set()
        with self._read_back_cond:
            self._read_backs.clear()
            self._read_back_cond.notify_all()

    # -- read-back in the background ---------------------------------------------------
    def read_back_later(self, obj: ObjectVersion) -> None:
        """Queue ``obj`` for the read-back thread (any thread; never waits): it is cached
        whole, but its file cannot be registered without reading it back, which an open
        (or a bind) does not do for it. Dropped (counted) when the queue is full; a no-op
        for an object queued or being read back already."""
        oid = self.fetcher.object_id(obj)
        with self._read_back_cond:
            if (self._read_back_stop.is_set() or oid == self._reading_back
                    or oid in self._read_backs):
                return
            if len(self._read_backs) >= READ_BACK_QUEUE:
                metrics.PASSTHROUGH_READ_BACKS.labels("dropped").inc()
                return
            self._read_backs[oid] = obj
            self._read_back_cond.notify()

    def _read_back_loop(self) -> None:
        while True:
            with self._read_back_cond:
                while not self._read_backs and not self._read_back_stop.is_set():
                    self._read_back_cond.wait()
                if self._read_back_stop.is_set():
                    return
                oid, obj = self._read_backs.popitem(last=False)
                self._reading_back = oid
            try:
                outcome = self.read_back(obj)
                if outcome != "stopped":
                    metrics.PASSTHROUGH_READ_BACKS.labels(outcome).inc()
                if outcome == "verified":
                    log.info("%s read back and verified: its opens are registered for "
                             "reads without the daemon from now on", obj.key)
            except Exception:  # a bug must not end the thread: the objects stay served
                log.exception("reading back %s failed", obj.key)
            finally:
                with self._read_back_cond:
                    self._reading_back = None

    def read_back(self, obj: ObjectVersion) -> str:
        """Read ``obj``'s file back and check every block (the read-back thread; waits on
        the disk, paced: see the module docstring), so that its next registration trusts
        it (written marks) instead of reading it. Returns "verified", "failed" (a block
        failed its check and was dropped as corrupt, or the file verified was replaced),
        "gone" (not cached whole, or a block evicted or stored anew meanwhile) or "stopped"
        (the daemon is stopping)."""
        bids = self.fetcher.block_ids(obj)
        if self._decline_reason(obj, bids) is not None:
            return "gone"  # (or passthrough was switched off: nothing to register)
        oid = self.fetcher.object_id(obj)
        gave_up = ""
        rested_at = 0  # bytes checked at the last rest
        since = time.monotonic()

        def keep_going(bid: bytes, entry: tuple[int, int], done: int) -> bool:
            nonlocal gave_up, rested_at, since
            failpoints.hit("readback.block")  # (a test holds the read-back here)
            if self._read_back_stop.is_set():
                gave_up = "stopped"
                return False
            if not self.cache.indexed_as(bid, entry):
                gave_up = "gone"
                return False
            if done - rested_at >= READ_BACK_CHUNK:
                if self._read_back_stop.wait((time.monotonic() - since) * READ_BACK_REST):
                    gave_up = "stopped"
                    return False
                rested_at, since = done, time.monotonic()
            return True

        # Pinned first, as for a registration (a punch after this waits for the unpin, so
        # the marks the check leaves are true), but yielding: eviction may still choose the
        # object's blocks (the check then gives up at the next block).
        self.cache.pin(oid, yielding=True)
        try:
            try:
                fd = os.open(self.cache.object_path(oid), os.O_RDONLY)
            except OSError:
                return "gone"  # evicted since the index said it was cached
            try:
                verified = self.cache.verify_object(bids, fd, keep_going=keep_going)
            finally:
                os.close(fd)
        finally:
            self.cache.unpin(oid, yielding=True)
        if verified is not None:
            return "verified"
        if gave_up == "gone":
            self.cache.release_deferred()  # (bytes an eviction left for our pin)
        return gave_up or "failed"

    def reads_itself(self, obj: ObjectVersion) -> bool:
        """Whether ``obj``'s cache file is registered (or being verified for it), so its
        next opens are read from local disk without the daemon's Python: by the kernel, or
        by the native loop. Nothing needs doing ahead of them (any thread; read without
        ``_lock``: a stale answer costs a look, or one skipped ahead of an open that Python
        then answers as before). A registration pins its blocks, so they are on disk while
        this holds. The native loop too: it reads an object's bytes O_DIRECT when none is
        in the page cache (``_native.c`` ``read_file``), so filling the page cache ahead
        (the directory walk's disk readahead) would only turn its direct reads into
        copies out of the cache file's pages and cost the readahead threads their own
        reads of the file. That holds for an object the loop reads in one READ
        (:data:`LOOP_ONE_READ`); the READs of a larger one short of its end are plain reads,
        which a page cache filled ahead may serve sooner, so such objects are read ahead as
        before."""
        return (self.enabled and (not self.native or obj.size <= LOOP_ONE_READ)
                and self.fetcher.object_id(obj) in self._backings)

    def predicted(self, obj: ObjectVersion, ino: int = 0, *, spare: bool = False) -> None:
        """``obj`` (inode ``ino``; 0 if unknown) is expected to be opened soon (trio
        thread: the directory lookahead, the read-order hint, the sweep; never waits, it
        only queues). When it is fully cached and not registered yet, a preparing thread
        verifies and registers its file, leaving the backing idle for the open to use (and,
        with ``ino``, tells :attr:`on_prepared`); a small file still being fetched is
        registered by the S3 thread that writes it (:meth:`write_checked`). ``spare``: only
        while the idle backings have room for it without closing one (see :meth:`prepare`):
        a sweep's files are each read once in the epoch, at no time anyone can tell, so
        one registered ahead must not close a registration made for another."""
        if not self.enabled or not 0 < obj.size <= PREPARE_MAX_BYTES or self.max_idle == 0:
            return  # (with no idle registration kept, one made ahead would be closed at once)
        # (read without _lock: a stale answer only costs the preparing thread a look)
        if self.fetcher.object_id(obj) in self._backings:
            return  # registered already (the previous epoch's open) or being verified
        for bid in self.fetcher.block_ids(obj):
            if self.fetcher.is_loading(bid):
                # Being fetched (a cold pass's lookahead): not on disk yet. Queued when
                # that load settles, so the open finds it registered.
                with self._awaiting_lock:
                    room = len(self._awaiting) < AWAITING_LOADS
                    if room:
                        self._awaiting[bid] = (obj, ino, spare)
                if not room:
                    metrics.PASSTHROUGH_PREPARED.labels("dropped").inc()
                return
        self._enqueue(obj, spare, ino)

    def settled(self, bid: bytes) -> None:
        """The load of block ``bid`` settled (trio thread; :attr:`Fetcher.on_settled`): a
        predicted object waiting for it is queued for a preparing thread (which looks
        again later while other blocks of it are still landing)."""
        if self._awaiting:  # (read without the lock: a hint; usually empty)
            with self._awaiting_lock:
                found = self._awaiting.pop(bid, None)
            if found is not None:
                self._enqueue(found[0], found[2], found[1])

    def write_checked(self, obj: ObjectVersion, bid: bytes, data: bytes) -> bool:
        """The bytes of ``obj``, a whole object of one block ``bid``, were just checked
        against S3 by the S3 thread calling this (:attr:`Fetcher.write_checked`, inside
        the fetcher's sink gate). If a prediction waits for that block, write it to the
        cache here and register the file from the descriptor it was written through, as a
        preparing thread would once the load settled (same pin, same bounds, the same
        template ahead) -- without the hand-over to a preparing thread, a second open of
        the file, the index reads and the comparison with the written marks: see
        :meth:`_register_written`. Returns whether it wrote the block (False: the caller
        writes it, as for any file no prediction waits for). Waits on the disk."""
        if not self._awaiting:  # (read without the lock: a hint; empty in a warm pass)
            return False
        with self._awaiting_lock:
            found = self._awaiting.pop(bid, None)
        if found is None:
            return False
        _, ino, spare = found
        oid = split_block_id(bid)[0]
        if not self.enabled:
            return False
        if oid in self._backings:  # (read without _lock: an open registered it meanwhile)
            self._enqueue(obj, False, ino)  # (its template, once the write has landed)
            return False
        if spare:
            with self._lock:  # (S3 threads land many at once: room is taken, then used)
                room = self._idle_room()
                if room:
                    self._spare_taken += 1
            if not room:
                _PREPARED["full"].inc()
                return False
        try:
            outcome = self._register_written(obj, oid, bid, data)
        finally:
            if spare:
                with self._lock:
                    self._spare_taken -= 1
        _PREPARED[outcome].inc()
        on_prepared = self.on_prepared
        if ino and on_prepared is not None and outcome in ("written", "known"):
            on_prepared(ino, obj)
        return True

    def _register_written(self, obj: ObjectVersion, oid: bytes, bid: bytes,
                          data: bytes) -> str:
        """Write the checked block ``bid`` (the whole of ``obj``) to the cache and register
        the file with the descriptor it was written through (an S3 thread; waits on the
        disk). Left idle like a registration made ahead. Returns "written" (registered),
        "known" (an open registered the object meanwhile: ours is closed), "declined" (the
        block was not admitted to the cache) or "refused".

        Why no check is needed: the pin is taken before the block is written, so no
        eviction chooses it and no release of the object's bytes runs from then on
        (:meth:`~cachefs.cache.blocks.BlockCache.put_kept`); the bytes are the ones this
        thread checked against S3 for this version, written into the file of the
        descriptor handed over, and indexed with their checksum in the same critical
        section. That is what :meth:`~cachefs.cache.blocks.BlockCache.verify_object`
        concludes from the written marks when a preparing thread registers the file, after
        reading the index and opening the file again. Published in ``_backings`` only once
        registered (nothing waits on it meanwhile): an open that registered the object
        first keeps its own registration."""
        self.cache.pin(oid)
        backing_id = 0
        refused: str | OSError = "refused"
        try:
            kept = self.cache.put_kept(bid, data)
            if kept is None:
                return "declined"
            fd, stamp = kept
            try:
                failpoints.hit("written.kept")  # (a test holds the S3 thread here)
                backing_id, refused = self._backing_open(fd, stamp)
            finally:
                os.close(fd)  # the kernel (or the native loop) holds its own reference
        finally:
            if not backing_id:
                self.cache.unpin(oid)
        if not backing_id:
            if isinstance(refused, OSError):
                self._switch_off(refused)
            return "refused"
        with self._lock:
            known = oid in self._backings or not self.enabled
            if not known:
                backing = _Backing(oid, obj.size, _SETTLED, backing_id)
                backing.stamp = stamp
                self._backings[oid] = backing
                metrics.PASSTHROUGH_BACKINGS.inc()
                self._idle_or_keep(backing)  # (its pin yields from now on)
        if known:
            try:
                assert self._device is not None
                self._device.backing_close(backing_id)
            except OSError as exc:
                log.warning("cannot close passthrough backing %d: %s", backing_id,
                            exc.strerror)
            finally:
                self.cache.unpin(oid)
            return "known" if self.enabled else "refused"
        metrics.CACHE_OBJECTS_TRUSTED.inc()
        metrics.PASSTHROUGH_VERIFIED_BYTES.inc(len(data))
        return "written"

    def _enqueue(self, obj: ObjectVersion, spare: bool, ino: int = 0) -> None:
        """Queue ``obj`` (inode ``ino``, 0 if unknown) for a preparing thread (any thread;
        never waits); ``spare``: see :meth:`prepare`."""
        if not self.enabled or not 0 < obj.size <= PREPARE_MAX_BYTES:
            return
        with self._queue_cond:
            if self._stopping or len(self._queue) + len(self._landing) >= PREPARE_QUEUE:
                metrics.PASSTHROUGH_PREPARED.labels("dropped").inc()
                return
            self._queue.append((obj, spare, ino))
            if len(self._queue) == 1:
                # (predictions come in batches: one wake-up per batch, not per file)
                self._queue_cond.notify()

    def _prepare_loop(self) -> None:
        while True:
            with self._queue_cond:
                while True:
                    if self._stopping:
                        return
                    wait: float | None = None
                    if self._landing:
                        wait = self._landing[0][0] - time.monotonic()
                        if wait <= 0:
                            _, obj, spare, since, ino = self._landing.popleft()
                            break
                    if self._queue:
                        obj, spare, ino = self._queue.popleft()
                        since = 0.0
                        break
                    self._queue_cond.wait(wait)
                if self._queue:
                    self._queue_cond.notify()  # another thread takes the next one meanwhile
            try:
                outcome = self.prepare(obj, spare=spare)
                if outcome == "landing":
                    now = time.monotonic()
                    since = since or now
                    if now - since < LANDING_LIMIT:
                        with self._queue_cond:
                            self._landing.append((now + LANDING_DELAY, obj, spare, since, ino))
                        continue
                    outcome = "declined"
                metrics.PASSTHROUGH_PREPARED.labels(outcome).inc()
                on_prepared = self.on_prepared
                if ino and on_prepared is not None and outcome in ("registered", "known"):
                    on_prepared(ino, obj)
            except Exception:  # a bug must not end the thread: the opens verify themselves
                log.exception("verifying %s ahead of its open failed", obj.key)

    def prepare(self, obj: ObjectVersion, *, spare: bool = False) -> str:
        """Verify and register ``obj``'s file now, before any open of it (a preparing
        thread; waits on the disk). The backing is left idle: the next open of the object
        uses it, and it is closed like any idle backing if none comes. ``spare``: only if
        the idle backings have room for it without closing one (a file read in this epoch
        is wanted again only in the next one: with more files than the idle bounds hold,
        registering each would close the earlier ones, each verified for nothing).
        Returns the outcome: "registered", "known" (registered or being verified
        already), "landing" (some blocks are still being written to the cache: the
        preparing thread looks again later), "declined" (not fully cached, too large,
        passthrough off), "full" (no
        spare room) or why the attempt failed ("not_cached", "unverified", "refused")."""
        oid = self.fetcher.object_id(obj)
        with self._lock:
            if oid in self._backings:
                return "known"
            if spare and not self._idle_room():
                return "full"
        bids = self.fetcher.block_ids(obj)
        reason = self._decline_reason(obj, bids)
        if reason is not None:
            if reason == "not_cached" and any(self.fetcher.is_loading(b) for b in bids):
                return "landing"  # being written to the cache: look again soon
            return "declined"
        with self._lock:
            if oid in self._backings:
                return "known"
            if spare and not self._idle_room():
                return "full"
            backing = _Backing(oid, obj.size, threading.Event())
            self._backings[oid] = backing
            if spare:
                self._spare_taken += 1
        try:
            return self._register(backing, bids, idle=True)
        finally:
            if spare:
                with self._lock:
                    self._spare_taken -= 1

    def open(self, ino: int, obj: ObjectVersion, *, o_direct: bool = False) -> int:
        """A backing id for a new handle of ``ino`` (the kernel reads it), or 0 (the
        daemon serves its reads). Every open must be matched by :meth:`release` with
        the same answer. Any thread; may wait on the disk (verification) or for another
        open's verification of the same object. An ``o_direct`` open is served by the
        daemon unless the inode is passed through already: the kernel would open the
        cache file O_DIRECT too, and unaligned reads would fail EINVAL. (If it is, the
        kernel refuses the inode a handle without the backing; the FUSE layer then marks
        the passed-through handle direct I/O, which brings its reads to the daemon.)"""
        oid = self.fetcher.object_id(obj)
        known = self._backings.get(oid)  # (a peek: a dict read; what it finds is used
        # under the lock below, and a change after this check is one after the open)
        if known is not None and known.stamp is not None and not self._still_intact(known, obj):
            self._found_changed(known)
        shared = False
        while True:
            with self._lock:
                active = self._active.get(ino)
                if active is None and ino in self._templates:
                    # The native loop may have handles of it open, passed through to the
                    # template's backing: the same rule as for handles opened here.
                    active = (self._templates[ino], 0)
                if active is not None:
                    # Handles of this inode are passed through: the new one must be too,
                    # on the same file (the kernel refuses two modes or two files per inode).
                    if active[0] != oid:  # an inode is one version (cachefs.fs): never true
                        raise ObjectChanged(f"{obj.key}: inode {ino} is passed through to "
                                            "another version's file")
                    in_use = self._backings[active[0]]
                    if in_use.changed:
                        if self._close_changed(in_use):
                            continue  # its last handle is gone: verified afresh below
                        raise self._changed_error(obj)
                    backing_id = self._use(ino, in_use)
                    shared = True
                    break
                if self._direct.get(ino):
                    return self._direct_open(ino, "open_direct")
                if o_direct:
                    return self._direct_open(ino, "o_direct")
                backing = self._backings.get(oid)
                if backing is not None and backing.ready.is_set() and backing.backing_id:
                    if backing.changed:
                        if self._close_changed(backing):
                            continue
                        raise self._changed_error(obj)
                    backing_id = self._use(ino, backing)
                    shared = False
                    break
            if backing is None:
                break
            backing.ready.wait()  # another open verifies this object: use its outcome
            # (failed, closed or the inode changed mode meanwhile: decide afresh)
        if shared or backing is not None:
            # Registered ahead (a prediction, or the previous epoch's open), or shared with
            # handles (or a template: its first open may be this one, which the loop left
            # to Python) using the file: if its blocks were fetched ahead, the kernel's
            # reads of them are their use.
            self._used(obj)
            return backing_id
        bids = self.fetcher.block_ids(obj)
        reason = self._decline_reason(obj, bids)
        if reason is not None:
            with self._lock:
                return self._direct_open(ino, reason, obj)
        with self._lock:
            if oid in self._backings or ino in self._active or self._direct.get(ino):
                pass  # another open got here first: decide afresh below
            else:
                backing = _Backing(oid, obj.size, threading.Event())
                self._backings[oid] = backing
        if backing is None:
            return self.open(ino, obj)
        outcome = self._register(backing, bids, idle=False)
        if backing.backing_id:
            self.ledger.mark_used(bids)
            with self._lock:
                if self._active.get(ino) is None and not self._direct.get(ino):
                    return self._use(ino, backing)
                self._idle_or_keep(backing)  # the inode changed mode while we verified
            return self.open(ino, obj)
        if outcome == "size":
            # Too large to read back at its open (cached by an earlier daemon): read back
            # in the background, so that its later opens are registered.
            self.read_back_later(obj)
        with self._lock:
            return self._direct_open(ino, outcome, obj)

    def _still_intact(self, backing: _Backing, obj: ObjectVersion) -> bool:
        """Whether ``backing``'s file is as it was verified (any thread, no lock of this
        class held: a stat, and on a change an index read under the object's lock): the
        same stamp (:data:`~cachefs.cache.objectfiles.FileStamp`), or a change that was the
        cache's own writes of checked blocks (a block the index dropped while the pin kept
        its bytes, fetched and written again: its written marks carry the file's stamp
        now), after which the backing takes the new stamp. A file no longer at its path
        (replaced by another inode, or gone) is not the one registered, which the kernel
        and the loop still read: that is no change to it."""
        verified = backing.stamp
        now = path_stamp(self.cache.object_path(backing.oid))
        if verified is None or now is None or now[0] != verified[0] or now == verified:
            return True
        # The cache's own write of the object may be landing this moment (it moves the
        # backing's stamp in :meth:`written`, under the object's lock): look again once
        # none is under way.
        now = self.cache.settled_stamp(backing.oid)
        verified = backing.stamp
        if verified is None or now is None or now[0] != verified[0] or now == verified:
            return True
        if self.cache.marked_intact(self.fetcher.block_ids(obj), now):
            backing.stamp = now
            if self.native and self._loop is not None:
                self._loop.stamp_file(backing.backing_id, now)
            # (a kernel backing's template takes the new stamp when the open it lets
            # through renews it: add_template)
            return True
        return False

    def written(self, oid: bytes, written: tuple[int, int, int]) -> None:
        """The cache wrote a checked block into the object's file (any thread, under the
        object's lock, in the order of its writes: :attr:`BlockCache.on_written`), which
        was (inode, change time before the write, after it): a registration whose stamp
        was the file's just before takes the new one -- the cache's own writes (a block
        the index dropped while the pin kept its bytes, fetched and written again with
        the same bytes) are no change. A peek without ``_lock``: the stamp is one
        attribute, and the object's lock orders the writes that move it."""
        backing = self._backings.get(oid)
        if backing is None or backing.stamp is None:
            return
        inode, before, after = written
        if backing.stamp == (inode, before):
            backing.stamp = (inode, after)
            loop = self._loop
            if self.native and loop is not None and backing.backing_id:
                loop.stamp_file(backing.backing_id, (inode, after))

    def _found_changed(self, backing: _Backing) -> None:
        """Someone changed ``backing``'s file since it was verified (any thread, without
        ``_lock``): an idle registration is closed, so the open that found it verifies the
        file again (reading it back: the damaged block is dropped and fetched again); one
        in use is marked ``changed`` (its opens fail with EIO until its handles are gone,
        then it is closed)."""
        with self._lock:
            if self._backings.get(backing.oid) is not backing or backing.changed:
                return
            metrics.PASSTHROUGH_CHANGED.inc()
            backing.changed = True
            if self._close_changed(backing):
                log.warning("a registered cache file was changed by another writer since "
                            "it was verified: verifying it again")
                return
            if backing.oid in self._idle:
                # Idle here, but the native loop has handles open with its template (the
                # close above was refused): closed at a trim once the loop let it go.
                self._evicted_idle.add(backing.oid)
            log.warning("a registered cache file was changed by another writer while "
                        "handles read it: its opens fail (EIO) until they are closed")

    def _close_changed(self, backing: _Backing) -> bool:
        """Close ``backing``, changed under its registration, if no handle uses it (under
        ``_lock``): no handle of Python's, none of the native loop's through its template.
        True if closed (the open that found it then verifies the file afresh)."""
        return backing.opens == 0 and backing.oid in self._idle and self._close(backing.oid)

    @staticmethod
    def _changed_error(obj: ObjectVersion) -> CacheError:
        return CacheError(f"{obj.key}: its cache file was changed by another writer while "
                          "open (closed once its handles are)")

    def upgrade_due(self, obj: ObjectVersion) -> bool:
        """Whether :meth:`upgrade` of a handle of ``obj`` may succeed now: the object is
        registered, or every block of it carries written marks (any thread; no index
        lookups: cheap enough to ask at every READ of a handle served by the daemon)."""
        if not (self.enabled and (self.native or self._loop_files is not None)):
            return False
        oid = self.fetcher.object_id(obj)
        backing = self._backings.get(oid)  # (a dictionary read: a stale answer only delays)
        if backing is not None:
            return backing.ready.is_set() and bool(backing.backing_id)
        return self.cache.written_blocks(oid) >= self.fetcher.block_count(obj)

    def upgrade(self, ino: int, obj: ObjectVersion) -> int:
        """A handle of ``ino`` that was opened while ``obj`` was not cached whole, and so is
        served by the daemon, takes a registration now that the object is cached whole --
        when its file needs no reading back (written marks: this daemon fetched it, as it
        did for this very handle) -- so that the native loop answers its reads. Returns
        the id the caller binds the handle to the loop with, or 0 (nothing changed). With
        the native loop's reads (:attr:`native`) that is the registration's own id, and
        the handle's release must give it (:meth:`release`). With the kernel's
        passthrough, which set the handle's mode at its open, the file is registered with
        the loop too, beside the kernel, once per inode for all such handles of it
        (``_beside``): each keeps counting as served by the daemon (the one-mode rule),
        uses the registration (pinned) until its release, which must give the id to
        :meth:`release_beside`. Readers that keep a handle for a whole run (a memory-mapped
        Arrow or token file opened once, by each of a node's training processes) would
        otherwise have every READ of it answered in Python, each reading and verifying a
        whole block. Any thread, at a READ of the handle (no release of it runs
        meanwhile; one try per handle at a time, the caller's rule: each call that returns
        an id takes a use); reads no file (LMDB lookups; an open of the verified file
        beside the kernel)."""
        bound = self._upgrade(ino, obj)
        if bound:
            failpoints.hit("upgrade.bound")  # (a test holds the handle's bind here)
        return bound

    def _upgrade(self, ino: int, obj: ObjectVersion) -> int:
        if not (self.enabled and (self.native or self._loop_files is not None)):
            return 0
        oid = self.fetcher.object_id(obj)

        def served() -> bool:  # (under _lock) the inode has handles served by the daemon
            if not self._direct.get(ino):
                return False
            if self.native:  # (its other handles may use the registration already)
                active = self._active.get(ino)
                return active is None or active[0] == oid
            return ino not in self._active and ino not in self._templates

        with self._lock:
            if not served():
                return 0
            backing = self._backings.get(oid)
            if backing is not None:  # registered already (or being verified: not now)
                if not (backing.ready.is_set() and backing.backing_id):
                    return 0
                if self.native:
                    return self._upgraded(ino, backing)
        if backing is None:
            bids = self.fetcher.block_ids(obj)
            if self._decline_reason(obj, bids) is not None:
                return 0
            with self._lock:
                if oid in self._backings or not served():
                    return 0
                backing = _Backing(oid, obj.size, threading.Event())
                self._backings[oid] = backing
            if self._register(backing, bids, idle=True, read_back=False) == "size":
                self.read_back_later(obj)  # (marks not all true: bound once read back)
            with self._lock:
                if not backing.backing_id or backing.oid not in self._backings or not served():
                    return 0  # (left idle: the next open takes it)
                if self.native:
                    return self._upgraded(ino, backing)
        return self._beside_kernel(ino, backing, served)

    def _upgraded(self, ino: int, backing: _Backing) -> int:
        """(Under _lock; the native loop's reads.) One of the inode's handles served by the
        daemon uses ``backing`` now."""
        n = self._direct[ino] - 1
        if n:
            self._direct[ino] = n
        else:
            del self._direct[ino]
            self._fetched.pop(ino, None)
        metrics.PASSTHROUGH_UPGRADED.inc()
        return self._use(ino, backing)

    def _take_use(self, backing: _Backing) -> None:
        """(Under _lock.) A use of ``backing`` (a handle's): no longer idle, and its pin no
        longer yields, since eviction must not choose blocks that are being read."""
        if backing.opens == 0 and backing.oid in self._idle:
            del self._idle[backing.oid]
            self._evicted_idle.discard(backing.oid)
            self.cache.convert_pin(backing.oid, yielding=False)
        backing.opens += 1

    def _beside_kernel(self, ino: int, backing: _Backing, served: Callable[[], bool]) -> int:
        """(With the kernel's passthrough; holding no lock.) The loop's id of ``backing``'s
        file registered beside the kernel for the inode's handles served by the daemon
        (``served()`` says, under _lock, that it still has them), registered now if it is
        not yet; 0 if it cannot be (or is being registered for another handle: tried
        again later). Each handle's use is taken first, as an open of the registration
        (pinned, not yielding), so the file opened again by its path holds the bytes that
        were verified; the loop keeps its own descriptor of it (the one opened here is
        closed). ``_beside`` holds the inode meanwhile (loop id 0), so no other try
        registers it twice. Whatever ends the try short of the handle being bound (an
        error, or any exception: a MemoryError in the loop's table) undoes it: the
        placeholder and the use are let go of, and the loop's registration, if made, is
        closed (the exception then goes on to the caller, which tries again later)."""
        files = self._loop_files
        if files is None:
            return 0
        with self._lock:
            if (not served() or backing.evicted or not backing.backing_id
                    or self._backings.get(backing.oid) is not backing):
                return 0
            shared = self._beside.get(ino)
            if shared is not None:
                if shared[0] != backing.oid or not shared[1]:
                    return 0  # (being registered: this handle tries again later)
                self._take_use(backing)
                self._beside[ino] = (shared[0], shared[1], shared[2] + 1)
                metrics.PASSTHROUGH_UPGRADED.inc()
                return shared[1]
            self._take_use(backing)
            self._beside[ino] = (backing.oid, 0, 1)
        loop_id = 0
        bound = False
        try:
            try:
                fd = os.open(self.cache.object_path(backing.oid), os.O_RDONLY)
                try:
                    loop_id = files.backing_open(fd)
                finally:
                    os.close(fd)
                if loop_id and backing.stamp is not None and self._loop is not None:
                    self._loop.stamp_file(loop_id, backing.stamp)
            except OSError as exc:
                if exc.errno in _OUT_OF_DESCRIPTORS:
                    self.out_of_descriptors()
            if loop_id:
                failpoints.hit("beside.registered")  # (a test raises here)
                metrics.PASSTHROUGH_UPGRADED.inc()
                with self._lock:
                    self._fetched.pop(ino, None)
                    self._beside[ino] = (backing.oid, loop_id, 1)
                    bound = True
        finally:
            if not bound:
                self._unbeside(ino, backing, loop_id)
        return loop_id if bound else 0

    def _unbeside(self, ino: int, backing: _Backing, loop_id: int) -> None:
        """(Holding no lock.) Undo a try of :meth:`_beside_kernel` that bound no handle:
        the inode's placeholder and the handle's use of ``backing`` are let go of, and the
        loop's registration ``loop_id`` (0: none was made) is closed."""
        with self._lock:
            entry = self._beside.get(ino)
            if entry is not None and entry[0] == backing.oid and entry[1] in (0, loop_id):
                del self._beside[ino]
            backing.opens -= 1
            self._idle_or_keep(backing)
        files = self._loop_files
        if loop_id and files is not None:
            try:
                files.backing_close(loop_id)
            except Exception:  # (nothing else holds it: at worst one descriptor leaks)
                log.exception("cannot close the native loop's registration %d", loop_id)

    def release_beside(self, ino: int, loop_id: int) -> None:
        """A handle :meth:`upgrade` bound to the file registered beside the kernel, with the
        loop's id ``loop_id``, is closed (any thread; after the loop unbound it): its use
        of the kernel's registration is let go of (idle once none is left), and the loop's
        registration is closed with the inode's last such handle."""
        last = False
        with self._lock:
            entry = self._beside.get(ino)
            if entry is None or entry[1] != loop_id:
                # (cannot happen: each bound handle's release gives the id it was bound
                # with, once. The entry, which other handles may use, is left alone.)
                self._unknown_release(f"release of unknown registration {loop_id} beside "
                                      f"the kernel (inode {ino}, registered: {entry})")
            else:
                backing = self._backings.get(entry[0])
                if backing is not None:
                    backing.opens -= 1
                    self._idle_or_keep(backing)
                if entry[2] > 1:
                    self._beside[ino] = (entry[0], entry[1], entry[2] - 1)
                else:
                    del self._beside[ino]
                    last = True
        files = self._loop_files
        if last and files is not None:
            files.backing_close(loop_id)

    def release(self, ino: int, backing_id: int) -> None:
        """The handle opened with answer ``backing_id`` is closed (any thread)."""
        with self._lock:
            if not backing_id:
                n = self._direct.get(ino, 0) - 1
                if n > 0:
                    self._direct[ino] = n
                    return
                self._direct.pop(ino, None)
                fetched = self._fetched.pop(ino, None)
            else:
                fetched = None
                self._release_backing(ino, backing_id)
        if fetched is not None:
            # The object was not fully cached when opened and its readers are gone:
            # register its file now (if it is cached by now), so that the next open, the
            # next epoch's, needs neither verification nor the daemon's reads. Its
            # inode gets an open template too (on_prepared), so that open is the loop's,
            # without Python: a cold pass's reader that caught up with the walk's fetches
            # opens its file before it is cached, and those files (5-7% of a warm pass
            # over 6,000 files with the native loop, 12.5% of one over 1,200 with the
            # kernel's passthrough) were each opened and released in Python again in the
            # next pass. (The loop answers no O_DIRECT open: those still come to Python.)
            self._enqueue(fetched, True, ino)

    # -- opens answered by the native loop ------------------------------------------------
    def add_template(self, ino: int, obj: ObjectVersion, backing_id: int, *, token: int,
                     prefix: str) -> bool:
        """Let the native loop answer the next opens of ``ino`` itself, as this open with
        answer ``backing_id`` (> 0) was answered (any thread; a handle of it is open now),
        while the epoch ``token`` of its directory ``prefix`` lasts (see
        :meth:`cachefs.fuse.native.NativeReads.add_template`; an inode with a template has
        its epoch renewed). The template lasts while the registration does: a
        registration closed for the idle bounds drops its templates first, and stays while
        the loop has handles open with one (they use its pin, and the kernel's backing).
        Returns whether the loop answers its opens now (not when the loop is absent, the
        epoch moved on, or the bound on templates, :attr:`max_templates`, is reached and
        the oldest cannot be dropped)."""
        return self._template(ino, obj, token, prefix, backing_id)

    def add_template_ahead(self, ino: int, obj: ObjectVersion, *, token: int,
                           prefix: str) -> bool:
        """:meth:`add_template` for an object registered ahead of its first open (any
        thread; :attr:`on_prepared`): the loop answers even that open. The same rules: the
        object's registration must be done, and the inode must have no handle served by
        the daemon (one I/O mode per inode) nor one passed through to another file."""
        return self._template(ino, obj, token, prefix, None)

    def _template(self, ino: int, obj: ObjectVersion, token: int, prefix: str,
                  backing_id: int | None) -> bool:
        """:meth:`add_template` (a handle answered ``backing_id`` is open) or, with None,
        :meth:`add_template_ahead`."""
        loop = self._loop
        if loop is None or not self.enabled:
            return False
        oid = self.fetcher.object_id(obj)
        with self._lock:
            backing = self._backings.get(oid)
            active = self._active.get(ino)
            if backing is None or (active is not None and active[0] != oid):
                return False
            if backing_id is not None:
                if backing.backing_id != backing_id or active is None:
                    return False
            elif not backing.ready.is_set() or not backing.backing_id or self._direct.get(ino):
                return False
            known = ino in self._templates
            if (not known and len(self._templates) >= self.max_templates
                    and not self._drop_oldest_template()):
                return False
            if self.native:
                added = loop.add_template(ino, token=token, prefix=prefix,
                                          native_backing=backing.backing_id, size=obj.size)
            else:
                added = loop.add_template(ino, token=token, prefix=prefix,
                                          kernel_backing=backing.backing_id,
                                          path=self.cache.object_path(oid), stamp=backing.stamp)
            if added and not known:
                self._templates[ino] = oid
                if backing.templates is None:
                    backing.templates = set()
                backing.templates.add(ino)
        return added

    def adopted(self, objs: list[ObjectVersion]) -> None:
        """The native loop opened a handle of each of ``objs`` with its template (any
        thread; told in batches, after the fact): counted as opens of registered files,
        once per batch."""
        metrics.PASSTHROUGH_OPENS.inc(len(objs))
        metrics.CACHE_HIT_BYTES.inc(sum(obj.size for obj in objs))
        if self.ledger.pending or self.cache.policy == "lru":
            for obj in objs:
                self._used(obj)

    def _used(self, obj: ObjectVersion) -> None:
        """An open of a registered file: its prefetched blocks are used, and under the
        ``lru`` policy it is recently used (the daemon sees none of its reads; an idle
        registration's pin yields to eviction, which would otherwise take the hottest
        files first)."""
        lru = self.cache.policy == "lru"
        if self.ledger.pending or lru:
            bids = self.fetcher.block_ids(obj)
            if self.ledger.pending:
                self.ledger.mark_used(bids)
            if lru:
                self.cache.touch(bids)

    @property
    def templates(self) -> int:
        """Inodes whose opens the native loop answers."""
        return len(self._templates)

    # -- under _lock ------------------------------------------------------------------------
    def _drop_templates(self, backing: _Backing) -> bool:
        """Drop the templates of ``backing``'s inodes; False if the loop still has handles
        open with one (that one and those not tried yet are kept)."""
        loop = self._loop
        templates = backing.templates or set()
        for ino in list(templates):
            if loop is not None and not loop.drop_template(ino):
                return False
            templates.discard(ino)
            self._templates.pop(ino, None)
        return True

    def _drop_oldest_template(self) -> bool:
        """Make room for a template: drop the oldest that has no handle open (of the first
        few tried)."""
        loop = self._loop
        for ino in list(itertools.islice(self._templates, 8)):
            if loop is None or loop.drop_template(ino):
                oid = self._templates.pop(ino)
                backing = self._backings.get(oid)
                if backing is not None and backing.templates:
                    backing.templates.discard(ino)
                return True
        return False

    def _release_backing(self, ino: int, backing_id: int) -> None:
        active = self._active.get(ino)
        backing = self._backings.get(active[0]) if active else None
        if active is None or backing is None or backing.backing_id != backing_id:
            self._unknown_release(f"release of unknown passthrough backing {backing_id} "
                                  f"(inode {ino})")
            return
        if active[1] > 1:
            self._active[ino] = (active[0], active[1] - 1)
        else:
            del self._active[ino]
        backing.opens -= 1
        self._idle_or_keep(backing)

    def _unknown_release(self, what: str) -> None:
        """(Under _lock.) A release the bookkeeping does not know (a bug): counted, logged
        once (a bug repeated at every release would flood the log)."""
        metrics.PASSTHROUGH_UNKNOWN_RELEASES.inc()
        if not self._unknown_told:
            self._unknown_told = True
            log.warning("%s: left as it is (cachefs_passthrough_unknown_releases_total "
                        "counts them all; this is logged once)", what)

    def _use(self, ino: int, backing: _Backing) -> int:
        """(Under _lock.) A handle of ``ino`` opened on ``backing``; its answer."""
        self._take_use(backing)
        oid, n = self._active.get(ino, (backing.oid, 0))
        self._active[ino] = (oid, n + 1)
        metrics.PASSTHROUGH_OPENS.inc()
        # (the daemon sees none of its reads: the whole object counts as read from the cache)
        metrics.CACHE_HIT_BYTES.inc(backing.size)
        return backing.backing_id

    def _idle_room(self) -> bool:
        """(Under _lock.) Whether one more idle registration fits without closing one,
        counting those being made in that room (``_spare_taken``)."""
        return len(self._idle) + self._spare_taken < self.max_idle

    def _idle_or_keep(self, backing: _Backing) -> None:
        if backing.opens > 0 or backing.oid in self._idle:
            return
        self._idle[backing.oid] = None
        # Idle: its pin yields to eviction (room for new blocks is worth more).
        self.cache.convert_pin(backing.oid, yielding=True)
        if backing.changed and self._close(backing.oid):
            return  # (changed under its handles: verified afresh at the next open)
        if backing.evicted or backing.changed:
            self._evicted_idle.add(backing.oid)
        self._trim_idle()

    def _trim_idle(self) -> None:
        """Close the idle backings the cache evicted, and the least recently used beyond
        the bound (under the lock)."""
        if self._evicted_idle:  # (rare: not a set copy at every release)
            for oid in list(self._evicted_idle):
                if self._close(oid):
                    metrics.PASSTHROUGH_YIELDED.inc()
        tries = len(self._idle)  # (a backing the loop still uses goes to the end, once)
        while self._idle and tries > 0 and len(self._idle) > self.max_idle:
            tries -= 1
            oid = next(iter(self._idle))
            if not self._close(oid):
                self._idle.move_to_end(oid)
            elif not self._bound_told:
                self._bound_told = True
                log.info("%d cache files are registered for reads without the daemon, the "
                         "most kept (--registered-files): files read beyond them are "
                         "registered again at their next open (raise it for datasets of "
                         "more files per node)", self.max_idle)

    def evicted(self, oids: list[bytes]) -> None:
        """The cache evicted blocks of these objects while a pin kept their bytes (any
        thread, holding none of the cache's locks: :attr:`BlockCache.on_evicted_while_pinned`):
        the yielding pin of an idle registration, or the plain pin of a registration whose
        verification raced the eviction. An idle registration among them is closed now,
        which unpins its bytes; one in use is closed once no handle uses it (its bytes
        stay right until then). New opens may still use it meanwhile: the bytes the
        kernel reads are kept."""
        with self._lock:
            for oid in oids:
                backing = self._backings.get(oid)
                if backing is None:
                    continue  # closed meanwhile
                backing.evicted = True
                if oid in self._idle:
                    self._evicted_idle.add(oid)
            if self._evicted_idle:
                self._trim_idle()

    def out_of_descriptors(self) -> None:
        """A registration failed with EMFILE/ENFILE (any thread, without the lock): with
        the native loop, keep at most three quarters of the idle backings there are now
        and close the rest, so registered files give back the descriptor each holds (the
        kernel's backings hold none of ours: nothing to give back). The open that failed
        is served by the daemon; the bound stays lowered for the mount's life.

        Registrations with the loop beside the kernel's (``_beside``, :meth:`upgrade`)
        are not trimmed, on purpose: each exists only while a handle bound to it is open
        (it is closed with the inode's last such handle, :meth:`release_beside`), and a
        bound handle keeps the file's descriptor in the loop after its registration is
        closed (:meth:`cachefs.fuse.native.NativeReads.backing_close`), so closing one
        would give back no descriptor until its handles close anyway -- while their
        reads would go back to Python. Their number is bounded by the inodes with such
        handles open; a bind that meets EMFILE leaves its handle served by the daemon
        (and calls this)."""
        if not self.native:
            return
        with self._lock:
            bound = len(self._idle) * 3 // 4
            self.max_idle = min(self.max_idle, bound)
            self._trim_idle()  # (closing a backing drops its templates first)
            warn, self._descriptors_warned = not self._descriptors_warned, True
        if warn:
            log.warning("out of open files: keeping at most %d cache files registered for "
                        "reads (raise the open-file limit, LimitNOFILE, for more)", bound)

    def _close(self, oid: bytes) -> bool:
        """Drop an idle backing: an ioctl that only drops the kernel's reference to the
        file (no I/O, no wait), so it runs under the lock. False (nothing done) while the
        native loop has handles open with it (see :meth:`add_template`)."""
        backing = self._backings[oid]
        if backing.templates and not self._drop_templates(backing):
            return False
        del self._backings[oid]
        del self._idle[oid]
        self._evicted_idle.discard(oid)
        metrics.PASSTHROUGH_BACKINGS.dec()
        try:
            assert self._device is not None
            self._device.backing_close(backing.backing_id)
        except OSError as exc:
            log.warning("cannot close passthrough backing %d: %s", backing.backing_id,
                        exc.strerror)
        self.cache.unpin(oid, yielding=True)  # (an idle backing's pin yields)
        return True

    # -- internals -------------------------------------------------------------------------
    def _direct_open(self, ino: int, reason: str, obj: ObjectVersion | None = None) -> int:
        self._direct[ino] = self._direct.get(ino, 0) + 1
        if reason == "not_cached" and obj is not None:
            # Its blocks are being fetched for this handle: once its handles are closed,
            # the file is verified and registered ahead of the next open (see release).
            self._fetched[ino] = obj
        if reason != "off":
            metrics.PASSTHROUGH_DECLINED.labels(reason).inc()
        return 0

    # -- without the lock -----------------------------------------------------------------
    def _decline_reason(self, obj: ObjectVersion, bids: list[bytes]) -> str | None:
        if not self.enabled:
            return "off"
        if obj.size == 0:
            return "size"  # (nothing to read: the daemon answers at once)
        if not self.cache.contains_all(bids):
            return "not_cached"
        return None

    def _register(self, backing: _Backing, bids: list[bytes], *, idle: bool,
                  read_back: bool = True) -> str:
        """Verify and register ``backing``'s file (this thread; waits on the disk; the
        caller has put ``backing`` in ``_backings``), then publish the outcome to the opens
        waiting on ``backing.ready``: registered (counted, and left idle when ``idle``
        unless a waiting open took it) or removed from ``_backings``. Returns
        "registered" or why not ("not_cached", "unverified", "size", or "refused" once
        passthrough is switched off for the mount). Without ``read_back`` only a file that
        needs no reading back is registered (written marks)."""
        outcome: str | OSError = "unverified"
        try:
            backing.backing_id, outcome, backing.stamp = self._attach(
                backing.oid, bids, read_back=read_back and backing.size <= MAX_OBJECT_BYTES)
        finally:
            with self._lock:
                if backing.backing_id:
                    metrics.PASSTHROUGH_BACKINGS.inc()
                    if idle:
                        self._idle_or_keep(backing)
                else:
                    del self._backings[backing.oid]
                backing.ready.set()
                # (settled: its waiters are woken; later ones need no event of their own,
                # and one is ~1 KiB, times up to --registered-files)
                backing.ready = _SETTLED
        if backing.backing_id:
            return "registered"
        if isinstance(outcome, OSError):
            self._switch_off(outcome)
            return "refused"
        return outcome

    def _attach(self, oid: bytes, bids: list[bytes], *,
                read_back: bool = True) -> tuple[int, str | OSError, FileStamp | None]:
        """Pin, open, verify and register the object's file with the kernel (the
        opening worker's thread). Returns (backing id, "", the file's stamp taken before
        it was verified) or (0, why the open is served by the daemon:
        "not_cached", "unverified", "size" (without ``read_back``, a file that would
        have to be read to be verified), "refused", or the kernel's error when it cannot
        pass files through at all, None)."""
        failpoints.hit("attach.start")
        # Pinned first: from here no eviction punches the bytes verified below.
        self.cache.pin(oid)
        backing_id = 0
        try:
            try:
                fd = os.open(self.cache.object_path(oid), os.O_RDONLY)
            except OSError as exc:
                if exc.errno in _OUT_OF_DESCRIPTORS:
                    self.out_of_descriptors()
                    return 0, "refused", None
                return 0, "not_cached", None  # evicted since the index said it was cached
            try:
                stamp = file_stamp(fd)
                verified = self.cache.verify_object(bids, fd, read_back=read_back, stamp=stamp)
                if verified is None:
                    return 0, "unverified" if read_back else "size", None
                failpoints.hit("attach.verified")
                backing_id, refused = self._backing_open(fd, stamp)
                if not backing_id:
                    return 0, refused, None
            finally:
                os.close(fd)  # the kernel (or the native loop) holds its own reference
        finally:
            if not backing_id:
                self.cache.unpin(oid)
        metrics.PASSTHROUGH_VERIFIED_BYTES.inc(verified)
        return backing_id, "", stamp

    def _backing_open(self, fd: int, stamp: FileStamp | None) -> tuple[int, str | OSError]:
        """Register the verified file ``fd`` with the kernel (or the native loop): (its
        backing id, "") or (0, "refused", or the kernel's error when it cannot pass files
        through at all). Out of descriptors, the idle registrations are trimmed. The
        native loop's reads and opens of it check it keeps ``stamp``, the file's as
        verified (when known)."""
        device = self._device
        if device is None:
            return 0, "refused"
        try:
            backing_id = device.backing_open(fd)
            if self.native and stamp is not None and self._loop is not None:
                self._loop.stamp_file(backing_id, stamp)
            return backing_id, ""
        except OSError as exc:
            if exc.errno in _UNSUPPORTED and not self.native:
                return 0, exc
            if exc.errno in _OUT_OF_DESCRIPTORS:
                self.out_of_descriptors()
                return 0, "refused"
            log.warning("cannot register a cache file for reads without the daemon's "
                        "Python (%s); serving it", exc.strerror or exc)
            return 0, "refused"

    def _switch_off(self, error: OSError) -> None:
        with self._lock:
            was, self.enabled = self.enabled, False
        if was:
            metrics.PASSTHROUGH_ENABLED.set(0)
            log.warning("FUSE passthrough unavailable (%s): cachefs serves reads itself",
                        error.strerror or error)


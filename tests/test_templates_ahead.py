"""Open templates for files registered ahead of their first open (unit tests of
:class:`cachefs.passthrough.Passthrough` with a fake cache, device and loop; the real
mounts are in ``tests/test_passthrough.py``).

A file the directory lookahead fetched is registered once it lands and given an open
template, so the native loop answers even its first open. What is checked: a template
ahead needs a finished registration and an inode with no handle served by the daemon
(one I/O mode per inode); an open the loop left to Python (it raced the template) still
counts the file's prefetched blocks as used, as the loop's own open would."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from cachefs.passthrough import Passthrough
from cachefs.read.fetcher import ObjectVersion
from cachefs.read.prefetcher import DIRECTORY, PrefetchLedger

OBJ = ObjectVersion("d/a.bin", "etag", 1000)
INO = 42


class _Fetcher:
    def object_id(self, obj: ObjectVersion) -> bytes:
        return b"oid-" + obj.key.encode()

    def block_ids(self, obj: ObjectVersion) -> list[bytes]:
        return [self.object_id(obj) + b"/0"]

    def is_loading(self, bid: bytes) -> bool:
        return False


class _Cache:
    capacity = 1 << 30

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_bytes(b"x" * OBJ.size)
        self.pins = 0
        self.policy = "keep"
        self.read_back: list[bool] = []  # what each verification was allowed
        self.trusted = False  # the written marks hold (see BlockCache.verify_object)

    def object_path(self, oid: bytes) -> str:
        return str(self.path)

    def contains_all(self, bids: list[bytes]) -> bool:
        return True

    def verify_object(self, bids: list[bytes], fd: int | None = None, *,
                      read_back: bool = True, stamp: Any = None) -> int | None:
        self.read_back.append(read_back)
        return OBJ.size if read_back or self.trusted else None

    def pin(self, oid: bytes, *, yielding: bool = False) -> None:
        self.pins += 1

    def unpin(self, oid: bytes, *, yielding: bool = False) -> None:
        self.pins -= 1

    def convert_pin(self, oid: bytes, *, yielding: bool) -> None:
        pass


class _Device:
    def backing_open(self, fd: int) -> int:
        return 7

    def backing_close(self, backing_id: int) -> None:
        pass


class _Loop:
    def __init__(self) -> None:
        self.templates: dict[int, dict[str, Any]] = {}

    def add_template(self, ino: int, **how: Any) -> bool:
        self.templates[ino] = how
        return True

    def drop_template(self, ino: int) -> bool:
        self.templates.pop(ino, None)
        return True


def _passthrough(tmp_path: Path) -> tuple[Passthrough, _Loop, PrefetchLedger]:
    ledger = PrefetchLedger()
    p = Passthrough(_Fetcher(), _Cache(tmp_path / "a"), ledger,  # type: ignore[arg-type]
                    enabled=True)
    loop = _Loop()
    p.wanted = True
    p.attach_device(_Device(), loop=loop)
    return p, loop, ledger


def test_a_file_registered_ahead_gets_a_template_and_python_opens_count_as_used(
        tmp_path: Path) -> None:
    p, loop, ledger = _passthrough(tmp_path)
    told: list[tuple[int, ObjectVersion]] = []
    p.on_prepared = lambda ino, obj: told.append((ino, obj))
    assert not p.add_template_ahead(INO, OBJ, token=1, prefix="d/"), "not registered yet"
    assert p.prepare(OBJ) == "registered"
    assert p.add_template_ahead(INO, OBJ, token=1, prefix="d/")
    template = loop.templates[INO]
    stamp = os.stat(template["path"])  # (the file as verified: the loop checks it at opens)
    assert template == {"token": 1, "prefix": "d/", "kernel_backing": 7,
                        "path": str(tmp_path / "a"), "stamp": (stamp.st_ino, stamp.st_ctime_ns)}
    assert p.templates == 1
    # The loop left the first open to Python (it raced the template): the file's
    # prefetched block is counted as used all the same.
    bid = _Fetcher().block_ids(OBJ)[0]
    ledger.issued(bid, OBJ.size, DIRECTORY)
    assert p.open(INO, OBJ) == 7
    assert ledger.used(DIRECTORY) == OBJ.size
    assert ledger.unread(DIRECTORY) == 0
    p.release(INO, 7)


def test_no_template_ahead_for_an_inode_with_a_handle_the_daemon_serves(tmp_path: Path) -> None:
    p, loop, _ = _passthrough(tmp_path)
    p._direct[INO] = 1  # (an open before the file was cached: served by the daemon)
    assert p.prepare(OBJ) == "registered"
    assert not p.add_template_ahead(INO, OBJ, token=1, prefix="d/")
    assert loop.templates == {}


def test_predicted_files_tell_their_inode_once_registered(tmp_path: Path) -> None:
    p, _, _ = _passthrough(tmp_path)
    told: list[tuple[int, ObjectVersion]] = []
    p.on_prepared = lambda ino, obj: told.append((ino, obj))
    worker = threading.Thread(target=p._prepare_loop)  # one preparing thread
    worker.start()
    try:
        p.predicted(OBJ, INO)
        deadline = time.monotonic() + 10
        while not told:
            assert time.monotonic() < deadline, "a predicted file was not registered"
            time.sleep(0.01)
    finally:
        p._stop_preparing()
        worker.join()
    assert told == [(INO, OBJ)]


def test_an_object_larger_than_the_read_back_bound_passes_through_only_if_trusted(
        tmp_path: Path, monkeypatch: Any) -> None:
    """An object larger than MAX_OBJECT_BYTES is verified without reading its file back:
    passed through when this daemon wrote (or checked) every block of it (a first epoch
    fetched it), served by the daemon otherwise. One at most that size is read back."""
    import cachefs.passthrough as passthrough_module

    p, _, _ = _passthrough(tmp_path)
    cache = p.cache
    monkeypatch.setattr(passthrough_module, "MAX_OBJECT_BYTES", OBJ.size - 1)
    assert p.open(INO, OBJ) == 0  # no marks: not read, served by the daemon
    assert cache.read_back == [False]
    p.release(INO, 0)
    cache.trusted = True
    assert p.open(INO, OBJ) == 7  # the marks hold: passed through, nothing read
    assert cache.read_back == [False, False]
    p.release(INO, 7)
    monkeypatch.setattr(passthrough_module, "MAX_OBJECT_BYTES", OBJ.size)
    (tmp_path / "b").mkdir()
    p2, _, _ = _passthrough(tmp_path / "b")
    assert p2.open(INO, OBJ) == 7 and p2.cache.read_back == [True]

"""Handles bound to the native loop beside the kernel's passthrough (unit tests of
:class:`cachefs.passthrough.Passthrough` with a fake cache, device and loop; the real
mounts are in ``tests/test_bind_stress.py``).

With the kernel's passthrough, a handle opened before its object was cached whole is
served by the daemon, and once the object is registered it is bound to the native loop
through a second registration of the file, with the loop, beside the kernel's
(:meth:`Passthrough.upgrade`, ``_beside``). What is checked: a failure of any kind while
that registration is made (an exception other than OSError, a MemoryError in the loop's
table) undoes what the try took -- the inode's placeholder in ``_beside`` and the handle's
use of the kernel's registration -- so the handle is bound at a later READ and the
registration goes idle (its pin yielding) once it is closed; and a release of an id the
bookkeeping does not know is counted and logged, not silently dropped.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from cachefs import failpoints, metrics
from cachefs.passthrough import Passthrough
from cachefs.read.fetcher import ObjectVersion
from cachefs.read.prefetcher import PrefetchLedger
from tests.test_templates_ahead import _Cache, _Device, _Fetcher

OBJ = ObjectVersion("d/a.bin", "etag", 1000)
INO = 42
OID = _Fetcher().object_id(OBJ)


class _LoopFiles:
    """The native loop's table of registered files (NativeReads.backing_open/close)."""

    def __init__(self) -> None:
        self.open: set[int] = set()
        self.next_id = 100
        self.fail: BaseException | None = None  # raised by the next backing_open

    def backing_open(self, fd: int) -> int:
        if self.fail is not None:
            fail, self.fail = self.fail, None
            raise fail
        self.next_id += 1
        self.open.add(self.next_id)
        return self.next_id

    def backing_close(self, backing_id: int) -> None:
        self.open.remove(backing_id)


def _beside(tmp_path: Path) -> tuple[Passthrough, _LoopFiles]:
    """A Passthrough with the kernel's passthrough and the native loop beside it, and one
    handle of INO served by the daemon (opened before the object was cached whole)."""
    cache = _Cache(tmp_path / "a")
    cache.trusted = True  # (written marks: a bind registers without reading the file)
    p = Passthrough(_Fetcher(), cache, PrefetchLedger(),  # type: ignore[arg-type]
                    enabled=True)
    files = _LoopFiles()
    p.wanted = True
    p.attach_device(_Device(), native=files)  # type: ignore[arg-type]
    assert not p.native and p._loop_files is files
    p._direct[INO] = 1
    return p, files


def _nothing_held(p: Passthrough, files: _LoopFiles) -> None:
    assert p._beside == {}, "the inode's registration beside the kernel was left behind"
    backing = p._backings[OID]
    assert backing.opens == 0, "a use of the registration was left behind"
    assert OID in p._idle, "the registration is not idle (its pin does not yield)"
    assert files.open == set(), "a registration with the loop was left behind"


@pytest.mark.parametrize("where", ["loop table", "after registering"])
def test_a_failure_while_registering_beside_the_kernel_undoes_the_try(
        tmp_path: Path, where: str) -> None:
    """Before: only an OSError was handled; any other exception (a MemoryError in the
    loop's table) left the inode's placeholder in ``_beside`` (loop id 0: "being
    registered") and the handle's use of the kernel's registration behind, so no handle
    of the inode was ever bound again and the file stayed pinned for good."""
    p, files = _beside(tmp_path)

    def fail() -> None:
        raise MemoryError("injected")

    if where == "loop table":
        files.fail = MemoryError("injected")
    else:
        failpoints.arm("beside.registered", fail)
    try:
        with pytest.raises(MemoryError):
            p.upgrade(INO, OBJ)
    finally:
        failpoints.disarm("beside.registered")
    _nothing_held(p, files)
    # The handle's next READ binds it.
    loop_id = p.upgrade(INO, OBJ)
    assert loop_id and files.open == {loop_id}
    assert p._beside == {INO: (OID, loop_id, 1)} and p._backings[OID].opens == 1
    p.release_beside(INO, loop_id)
    p.release(INO, 0)
    _nothing_held(p, files)
    assert p._direct == {}


def _unknown() -> float:
    return metrics.REGISTRY.get_sample_value(
        "cachefs_passthrough_unknown_releases_total") or 0.0


def test_a_release_beside_the_kernel_of_an_unknown_id_is_counted_and_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: a release whose loop id did not match the inode's entry did nothing, with
    not a word (a bookkeeping bug would leak the registration unseen). Now it is counted
    every time and logged once; the entry, which other handles may use, is left alone."""
    p, files = _beside(tmp_path)
    p._direct[INO] = 2  # (two handles served by the daemon)
    loop_id = p.upgrade(INO, OBJ)
    assert loop_id
    unknown = _unknown()
    with caplog.at_level(logging.WARNING, logger="cachefs.passthrough"):
        p.release_beside(INO, loop_id + 1)  # not the inode's id
        p.release_beside(INO + 1, loop_id)  # not an inode bound beside the kernel
    assert _unknown() == unknown + 2
    warnings = [r for r in caplog.records if "unknown" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert p._beside == {INO: (OID, loop_id, 1)} and files.open == {loop_id}
    p.release_beside(INO, loop_id)
    p.release(INO, 0)
    p.release(INO, 0)
    _nothing_held(p, files)

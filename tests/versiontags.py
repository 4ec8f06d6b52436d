"""Object bodies that say which version and file they are, unit by unit, for tests that
replace objects while readers read them: a read is told "ok" (one version's bytes, whole,
at that version's length), "wrong_length" (one version's bytes at another length) or
"mixed" (bytes of more than one version, of another file, or not a body at all)."""

from __future__ import annotations

import struct
from collections.abc import Callable

UNIT = 64
_TAG = struct.Struct("<III")  # version, file, unit number; the rest of the unit is zeros


class VersionTags:
    """Bodies whose length in units is ``units_of(version)``: make it differ between
    versions, so that a length from another version cannot pass as this one's."""

    def __init__(self, units_of: Callable[[int], int]) -> None:
        self.units_of = units_of

    def tagged(self, version: int, file: int) -> bytes:
        return b"".join(_TAG.pack(version, file, i) + bytes(UNIT - _TAG.size)
                        for i in range(self.units_of(version)))

    def classify(self, data: bytes, file: int) -> str:
        if not data or len(data) % UNIT:
            return "mixed" if data else "wrong_length"
        versions: set[int] = set()
        pad = UNIT - _TAG.size
        for i in range(0, len(data), UNIT):
            v, f, n = _TAG.unpack_from(data, i)
            if f != file or n != i // UNIT or data[i + _TAG.size:i + UNIT].count(0) != pad:
                return "mixed"
            versions.add(v)
        if len(versions) != 1:
            return "mixed"
        (v,) = versions
        return "ok" if len(data) == self.units_of(v) * UNIT else "wrong_length"

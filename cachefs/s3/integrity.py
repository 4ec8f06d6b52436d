"""What S3 says an object is, and checking received bytes against it.

S3 states an object's content in two ways:

* the **ETag**: the MD5 of the content for a single-part upload without
  SSE-KMS or SSE-C (32 hex digits, no ``-``). Multipart ETags (``md5-N``) and
  the ETags of SSE-KMS/SSE-C objects are not digests of the content;
* a **full-object checksum**, returned on a whole-object GET or a HEAD that
  sends ``x-amz-checksum-mode: ENABLED``: CRC64NVME (what S3 computes for every
  new object since December 2024), CRC32, CRC32C, SHA-1 or SHA-256. A
  multipart upload may instead carry a COMPOSITE checksum (a checksum of the
  parts' checksums, its value suffixed ``-N``), which cannot be checked
  without the part boundaries: it is ignored here.

CRCs combine: CRC(A || B) follows from CRC(A), CRC(B) and len(B), so the
blocks of a large object, fetched by separate ranged GETs, are checked
against the full-object CRC without reading any of them twice
(:func:`combine`).

The CRCs come from awscrt (the AWS Common Runtime's checksums, in C with
hardware CRC instructions: ~40 GB/s for CRC64NVME and CRC32C on this
project's machines, against ~0.75 GB/s for MD5). It is preferred to the
crc32c package because it covers all three CRCs S3 uses, CRC64NVME first,
and their combination.

Everything here is pure computation, safe in any thread.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import re
from collections.abc import Callable, Mapping

from awscrt import checksums as _crt

from cachefs.errors import IntegrityError

#: Full-object checksums S3 may state, in the order they are preferred for a check.
CHECKS = ("crc64nvme", "crc32c", "crc32", "sha256", "sha1")
#: Checksums that combine across blocks (:func:`combine`).
COMBINABLE = ("crc64nvme", "crc32c", "crc32")

_WIDTH = {"crc64nvme": 8, "crc32c": 4, "crc32": 4}
_CRC: dict[str, Callable[[bytes], int]] = {
    "crc64nvme": _crt.crc64nvme, "crc32c": _crt.crc32c, "crc32": _crt.crc32}
_COMBINE: dict[str, Callable[[int, int, int], int]] = {
    "crc64nvme": _crt.combine_crc64nvme, "crc32c": _crt.combine_crc32c,
    "crc32": _crt.combine_crc32}
_HASH = {"sha256": hashlib.sha256, "sha1": hashlib.sha1, "etag_md5": hashlib.md5}
_MD5_ETAG = re.compile(r"[0-9a-fA-F]{32}")


@dataclasses.dataclass(frozen=True, slots=True)
class Checksum:
    """A full-object checksum S3 stated: its algorithm and raw digest bytes."""

    kind: str
    digest: bytes

    @property
    def combinable(self) -> bool:
        return self.kind in COMBINABLE

    @property
    def crc(self) -> int:
        """The digest as the integer :func:`crc` returns (CRC kinds only)."""
        return int.from_bytes(self.digest, "big")


def stated_checksum(headers: Mapping[str, str]) -> Checksum | None:
    """The full-object checksum in an S3 answer's headers (keys lower-case), or None
    when there is none or only a composite one."""
    kind_of_checksum = headers.get("x-amz-checksum-type", "FULL_OBJECT").upper()
    if kind_of_checksum != "FULL_OBJECT":
        return None
    for kind in CHECKS:
        value = headers.get(f"x-amz-checksum-{kind}")
        if not value or "-" in value:  # "xxxx-3": a composite over 3 parts
            continue
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            continue
        expected = _WIDTH.get(kind) or _HASH[kind]().digest_size
        if len(raw) == expected:
            return Checksum(kind, raw)
    return None


def crc(kind: str, data: bytes) -> int:
    """The CRC ``kind`` (one of :data:`COMBINABLE`) of ``data``."""
    return _CRC[kind](data)


def combine(kind: str, crc1: int, crc2: int, len2: int) -> int:
    """CRC of A || B from CRC(A), CRC(B) and len(B)."""
    return _COMBINE[kind](crc1, crc2, len2)


def digest(kind: str, data: bytes) -> bytes:
    """The digest ``kind`` (a :data:`CHECKS` name or ``etag_md5``) of ``data``, as bytes."""
    if kind in _CRC:
        return _CRC[kind](data).to_bytes(_WIDTH[kind], "big")
    return _HASH[kind](data).digest()


def etag_is_md5(etag: str, headers: Mapping[str, str]) -> bool:
    """Whether ``etag`` is the MD5 of the content: 32 hex digits (single-part) and the
    answer names no SSE-KMS or SSE-C encryption (whose ETags are not content digests)."""
    if not _MD5_ETAG.fullmatch(etag):
        return False
    if headers.get("x-amz-server-side-encryption", "").lower().startswith("aws:kms"):
        return False
    return "x-amz-server-side-encryption-customer-algorithm" not in headers


def check_whole(data: bytes, *, where: str, stated: Checksum | None, etag: str,
                etag_md5: bool, md5: bytes | None = None) -> str:
    """Check the bytes of a whole object against what S3 stated; return the check made
    (a :data:`CHECKS` name, ``etag_md5`` or ``none``). A full-object checksum is preferred
    (the CRCs are ~50 times cheaper than MD5). ``md5``: the MD5 of ``data`` if computed
    already (as the answer was received: :func:`cachefs.s3.http1.exchange_plain`), used
    for the ETag's check instead of computing it again. Raises IntegrityError on a
    mismatch."""
    if stated is not None:
        kind, expected = stated.kind, stated.digest
    elif etag_md5:
        kind, expected = "etag_md5", bytes.fromhex(etag)
    else:
        return "none"
    got = md5 if kind == "etag_md5" and md5 is not None else digest(kind, data)
    if got != expected:
        raise IntegrityError(
            f"{where}: {len(data)} bytes received disagree with the object's {kind} "
            f"({got.hex()} != {expected.hex()}): altered in transit", check=kind,
            computed=got, data=data)
    return kind

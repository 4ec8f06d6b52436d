"""Names of cached blocks: object ids, block ids, checksums.

An object version's id is ``xxh3_128(bucket, key, etag, block_size)``; a
block's id is that object id followed by the block's byte offset (8 bytes,
big-endian), so a new version of an object never meets the old one's blocks,
and sorted ids keep the blocks of one object together, in offset order.
"""

from __future__ import annotations

import functools
import struct

import xxhash

OID_LEN = 16
_OFFSET = struct.Struct(">Q")  # big-endian so the blocks of one object sort by offset


#: Object ids remembered, the least recently asked dropped first: a cold small file's id
#: was computed ~7.6 times on the trio thread (the directory lookahead's look at its cache
#: file, its request and its prediction; the load's start, landing and settle; the
#: passthrough preparer's look), each a format, an encode and a hash.
OID_CACHE = 8192


@functools.lru_cache(maxsize=OID_CACHE)
def object_id(bucket: str, key: str, etag: str, block_size: int) -> bytes:
    """The 16-byte id of one object version cut into ``block_size`` blocks (any thread; a
    pure function, remembered for the last :data:`OID_CACHE` versions asked)."""
    return xxhash.xxh3_128_digest(f"{bucket}\0{key}\0{etag}\0{block_size}".encode())


def block_id(bucket: str, key: str, etag: str, block_size: int, index: int) -> bytes:
    """The 24-byte id of block ``index``: its object id, then its byte offset."""
    return block_id_at(object_id(bucket, key, etag, block_size), index * block_size)


def block_id_at(oid: bytes, offset: int) -> bytes:
    """The id of the block at byte ``offset`` of object ``oid``."""
    return oid + _OFFSET.pack(offset)


def split_block_id(bid: bytes) -> tuple[bytes, int]:
    """(object id, byte offset in the object) of a block id."""
    return bid[:OID_LEN], _OFFSET.unpack_from(bid, OID_LEN)[0]


def checksum(data: bytes) -> int:
    """The xxh3-64 checksum every cached block is verified against."""
    return xxhash.xxh3_64_intdigest(data)

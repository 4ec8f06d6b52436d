"""Types of the C extension built from _wire.c (see cachefs/s3/http1.py, exchange_plain)."""

from collections.abc import Callable

def exchange(fd: int, request: bytes, expect: int, idle: float, progress_at: float,
             wanted: tuple[str, ...], md5: bool, report: Callable[[float, float], None],
             pooled: bool) -> tuple[int, dict[str, str], bytes, bool, bytes | None] | tuple[bytes] | tuple[()]: ...
def md5(data: bytes | bytearray | memoryview) -> bytes: ...

"""The cachefs exception hierarchy (the only place it is drawn).

::

    CachefsError                  base of everything cachefs raises on purpose
    +-- ConfigError               bad user input: URL, flag, config file, size...
    +-- StoreError                the object store failed (raised by cachefs.s3.store)
    |   +-- NoSuchBucket
    |   +-- NoSuchKey
    |   +-- ObjectChanged         If-Match failed: the object is not the version we pinned
    |   +-- AccessDenied
    |   +-- CredentialsError      no credentials, or the store rejected them
    |   +-- TransientStoreError   worth retrying: 5xx, throttling, resets, timeouts
    |       +-- EndpointUnreachable   connection refused / DNS / connect timeout
    |       +-- IntegrityError        the bytes disagree with what S3 says the object is
    +-- CacheError                local cache directory unusable (not writable, corrupt env)

Lower layers raise these typed errors; only the FUSE adapter (cachefs.fuse_ops)
turns them into errno values, and only the CLI turns them into one-line
messages and exit codes. Third-party exceptions (botocore, lmdb, OSError) are
translated at the module that owns the library, with ``raise ... from exc``.
"""

from __future__ import annotations


class CachefsError(Exception):
    """Base class; ``str(exc)`` is a complete one-line message for users."""


class ConfigError(CachefsError):
    """Invalid user input (command line, config file, environment)."""


class CacheError(CachefsError):
    """The local cache directory cannot be used."""


class StoreError(CachefsError):
    """The object store failed to answer a request."""


class NoSuchBucket(StoreError):
    pass


class NoSuchKey(StoreError):
    pass


class ObjectChanged(StoreError):
    """The object's ETag no longer matches the version a reader pinned."""


class AccessDenied(StoreError):
    pass


class CredentialsError(StoreError):
    pass


class TransientStoreError(StoreError):
    """A failure that may succeed when retried (5xx, throttling, timeouts).

    ``reason`` names the kind of failure for metrics and logs, from a small fixed set:
    ``throttled``, ``server_error``, ``timeout``, ``connection``, ``unreachable``,
    ``short_body``, ``integrity``, ``stopping``.
    """

    def __init__(self, message: str, *, throttled: bool = False,
                 reason: str | None = None) -> None:
        super().__init__(message)
        self.throttled = throttled
        self.reason = reason or ("throttled" if throttled else "server_error")


class EndpointUnreachable(TransientStoreError):
    """The endpoint did not accept a connection (refused, DNS, connect timeout)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="unreachable")


class IntegrityError(TransientStoreError):
    """Bytes received disagree with the checksum S3 states for the object (altered in
    transit): dropped, counted and fetched again. ``check`` names the checksum that
    failed; ``computed`` is what the received bytes gave (two answers giving the same
    wrong value mean the stated checksum, not the transfer, is wrong); ``data`` holds
    those bytes."""

    def __init__(self, message: str, *, check: str, computed: object, data: bytes) -> None:
        super().__init__(message, reason="integrity")
        self.check = check
        self.computed = computed
        self.data = data

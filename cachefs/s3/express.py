"""S3 Express One Zone: directory buckets, their zonal endpoints and session credentials.

A directory bucket (name ``base--ZONE-ID--x-s3``) is read and written on its
zonal endpoint, ``https://BUCKET.s3express-ZONE-ID.REGION.amazonaws.com``,
with *session* credentials: ``CreateSession`` (``GET /?session``, signed with
SigV4 for service ``s3express`` with the caller's IAM credentials) returns an
access key, secret key, session token and expiration (5 minutes). Object
requests are then signed with SigV4 (service ``s3express``) with the session's
keys and carry the token in ``x-amz-s3session-token`` (never
``X-Amz-Security-Token``): botocore's ``S3ExpressAuth`` does exactly that and
is what :mod:`cachefs.s3.objects` signs with.

IAM: the caller needs ``s3express:CreateSession`` on the bucket (deploy/ shows
the policy); a ``ReadOnly`` session may only GET and HEAD.

:class:`ExpressSessions` keeps one session per bucket and renews it a minute
before it expires (botocore renews 45 s ahead); a renewal that fails while the
old session still has more than ``MANDATORY_REFRESH`` seconds to live keeps
the old one. Thread-safe: worker threads share it; one renews while the others
keep using the valid session (or wait for the first one when there is none).
``AWS_S3_DISABLE_EXPRESS_SESSION_AUTH=true`` (as for the AWS SDKs) turns
session auth off: plain SigV4 with the IAM credentials.
"""

from __future__ import annotations

import calendar
import dataclasses
import logging
import os
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable

from cachefs.errors import StoreError, TransientStoreError

log = logging.getLogger(__name__)

SUFFIX = "--x-s3"
SIGNING_NAME = "s3express"
ADVISORY_REFRESH = 60.0  # renew this long before expiry
MANDATORY_REFRESH = 10.0  # never sign with a session closer than this to its expiry


def is_directory_bucket(bucket: str) -> bool:
    """Directory buckets (S3 Express One Zone) are named ``base--zone-id--x-s3``."""
    return bucket.endswith(SUFFIX) and "--" in bucket[:-len(SUFFIX)]


def zone_id(bucket: str) -> str:
    """The availability-zone id in a directory bucket's name (``usw2-az1``)."""
    return bucket[:-len(SUFFIX)].rsplit("--", 1)[1]


def zonal_endpoint(bucket: str, region: str) -> str:
    """The zonal endpoint of a directory bucket (the bucket goes in front as a host label)."""
    return f"https://s3express-{zone_id(bucket)}.{region}.amazonaws.com"


def session_auth_disabled(environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get("AWS_S3_DISABLE_EXPRESS_SESSION_AUTH", "").strip().lower() in ("1", "true")


@dataclasses.dataclass(frozen=True)
class SessionCredentials:
    """One CreateSession answer; ``expiration`` in seconds since the epoch."""

    access_key: str
    secret_key: str
    token: str
    expiration: float


def _text(root: ET.Element, name: str) -> str:
    for el in root.iter():
        if el.tag.rsplit("}", 1)[-1] == name and el.text:
            return el.text.strip()
    raise StoreError(f"CreateSession answer has no {name}")


def _parse_time(text: str) -> float:
    """ISO 8601 UTC (``2026-01-02T03:04:05Z``, optionally with fractions) -> epoch seconds."""
    base = text.strip().rstrip("Z").split(".")[0].split("+")[0]
    try:
        return float(calendar.timegm(time.strptime(base, "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        raise StoreError(f"CreateSession answer has a bad Expiration {text!r}") from None


def parse_create_session(body: bytes) -> SessionCredentials:
    """The credentials in a CreateSession answer (``CreateSessionResult/Credentials``)."""
    try:
        root = ET.fromstring(body)
    except ET.ParseError as exc:
        raise TransientStoreError(f"CreateSession answer is not XML: {exc}") from None
    return SessionCredentials(_text(root, "AccessKeyId"), _text(root, "SecretAccessKey"),
                              _text(root, "SessionToken"), _parse_time(_text(root, "Expiration")))


class ExpressSessions:
    """Session credentials of one directory bucket, created and renewed on demand.

    ``create`` performs one CreateSession request and returns its answer (it is
    :meth:`cachefs.s3.objects.ObjectClient.create_session`); it raises cachefs
    StoreErrors. ``clock`` is wall-clock time (expirations are absolute).
    """

    def __init__(self, create: Callable[[], SessionCredentials], *,
                 clock: Callable[[], float] = time.time) -> None:
        self._create = create
        self._clock = clock
        self._lock = threading.Lock()  # held by the one thread renewing
        self._current: SessionCredentials | None = None
        self.created = 0  # sessions created (for tests and status)

    def get(self) -> SessionCredentials:
        """Valid session credentials; renews ahead of expiry. Raises StoreError when none
        can be had."""
        cur = self._current
        now = self._clock()
        if cur is not None and cur.expiration - now > ADVISORY_REFRESH:
            return cur
        if cur is not None and cur.expiration - now > MANDATORY_REFRESH:
            # Renew if nobody else is; meanwhile the current session is still good.
            if not self._lock.acquire(blocking=False):
                return cur
            try:
                return self._renew(keep=cur)
            finally:
                self._lock.release()
        with self._lock:
            cur = self._current
            if cur is not None and cur.expiration - self._clock() > MANDATORY_REFRESH:
                return cur  # another thread renewed it while this one waited
            return self._renew(keep=None)

    def _renew(self, keep: SessionCredentials | None) -> SessionCredentials:
        try:
            fresh = self._create()
        except StoreError as exc:
            if keep is not None:
                log.warning("S3 Express session renewal failed (%s); the current session is "
                            "valid for %.0fs more", exc, keep.expiration - self._clock())
                return keep
            raise
        self._current = fresh
        self.created += 1
        return fresh

    def invalidate(self, creds: SessionCredentials) -> None:
        """The store rejected ``creds`` (expired or revoked): create a new session next time."""
        with self._lock:
            if self._current is creds:
                self._current = None

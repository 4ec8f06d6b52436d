"""Credentials from the shared credentials (or config) file, read again when it changes.

botocore reads static credentials from ``~/.aws/credentials`` (or ``~/.aws/config``)
once and never again: only its own refreshable kinds (instance and container roles,
SSO, ``credential_process``) renew themselves. Yet temporary credentials are often
renewed by writing the file in place (a cron job running ``aws sts``, saml2aws, a
cluster's own tool), and a daemon that runs for weeks would sign with the expired ones
until it is restarted. :class:`FileCredentials` stands in for the credentials object the
signers hold (both clients call ``get_frozen_credentials`` for every request): when the
credentials came from one of those files and the file has changed since (size, inode,
mtime), the chain is resolved again from a fresh session before the request is signed.

What is looked at: the file the credentials in use were read from, before every request
(one stat, a few microseconds against a request's milliseconds: the request after a
rotation written there signs with the new key). The credentials file comes first in
botocore's chain, so with credentials read from the config file it could take over once
credentials are written into it: it is looked at too, at most every
:data:`OTHER_FILE_INTERVAL`. With credentials read from the credentials file, a change of
the config file changes nothing (the credentials file's profile wins; removing it is a
change of that file), and it is not looked at.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

#: botocore's ``method`` of credentials read from the shared credentials or config file.
FILE_METHODS = ("shared-credentials-file", "config-file")
#: The session's variable naming each file, in the chain's order (the first wins).
_FILES = (("shared-credentials-file", "credentials_file"), ("config-file", "config_file"))
#: Files the credentials in use were not read from, but which come before it in the chain
#: (the credentials file, when they came from the config file), are looked at no more
#: often than this (seconds).
OTHER_FILE_INTERVAL = 1.0

Signature = tuple[int, int, int] | None


def _signature(path: str) -> Signature:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class FileCredentials:
    """Credentials that follow changes of the files they were read from (see above).

    Any thread (each request's); a reload runs under ``_lock``, and what a request reads
    without it (``_own``, ``_others``, ``_credentials``) is replaced whole, never changed in
    place."""

    def __init__(self, session: Any, credentials: Any) -> None:
        self._session = session  # a botocore session: its profile and file locations
        self._credentials = credentials
        self._lock = threading.Lock()
        self._paths = self._files(session)  # (method, path), in the chain's order
        self._watch(self._signatures())

    def _signatures(self) -> dict[str, Signature]:
        return {path: _signature(path) for _, path in self._paths}

    def _watch(self, signatures: dict[str, Signature]) -> None:
        """(Under ``_lock``, or at init.) What is looked at from now on: the file the
        credentials in use were read from (its path and signature, as in ``signatures``,
        taken before they were read; None if they were not read from a file), and the
        files before it in the chain."""
        method = getattr(self._credentials, "method", None)
        own: tuple[str, Signature] | None = None
        others: list[tuple[str, Signature]] = []
        for file_method, path in self._paths:
            if own is not None:
                break
            if file_method == method:
                own = (path, signatures[path])
            else:
                others.append((path, signatures[path]))
        self._own = own
        self._others = tuple(others) if own is not None else ()
        self._others_at = time.monotonic() + OTHER_FILE_INTERVAL

    @staticmethod
    def _files(session: Any) -> list[tuple[str, str]]:
        paths = []
        for method, name in _FILES:
            try:
                value = session.get_config_variable(name)
            except Exception:
                continue
            if value:
                paths.append((method, os.path.expanduser(str(value))))
        return paths

    @property
    def method(self) -> str:
        return str(getattr(self._credentials, "method", ""))

    def get_frozen_credentials(self) -> Any:
        own = self._own
        if own is not None:
            changed = _signature(own[0]) != own[1]
            if not changed and self._others and time.monotonic() >= self._others_at:
                self._others_at = time.monotonic() + OTHER_FILE_INTERVAL
                changed = any(_signature(path) != seen for path, seen in self._others)
            if changed:
                self._reload()
        return self._credentials.get_frozen_credentials()

    def _reload(self) -> None:
        with self._lock:
            own = self._own
            if own is None or (_signature(own[0]) == own[1] and all(
                    _signature(path) == seen for path, seen in self._others)):
                return  # (another thread has read it)
            signatures = self._signatures()  # (before reading: a later change is seen)
            try:
                import botocore.session

                fresh = botocore.session.Session(profile=self._session.profile)
                credentials = fresh.get_credentials()
            except Exception as exc:  # a file caught half-written: the next change retries
                log.warning("the AWS credentials file changed but cannot be read (%s); "
                            "keeping the credentials in use", exc)
                self._watch(signatures)  # (looked at again once it changes again)
                return
            if credentials is None:
                log.warning("the AWS credentials file changed and holds no credentials now; "
                            "keeping the credentials in use")
                self._watch(signatures)
                return
            old = self._credentials.get_frozen_credentials().access_key
            self._credentials = credentials
            self._watch(signatures)  # (the file they came from now)
            log.info("the AWS credentials file changed: signing with the credentials it holds "
                     "now (access key ...%s, was ...%s)",
                     credentials.get_frozen_credentials().access_key[-4:], old[-4:])

    def __getattr__(self, name: str) -> Any:
        # Anything else a signer asks of credentials (access_key, token...) is today's.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._credentials, name)

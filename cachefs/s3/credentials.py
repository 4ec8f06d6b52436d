"""Credentials from the shared credentials (or config) file, read again when it changes.

botocore reads static credentials from ``~/.aws/credentials`` (or ``~/.aws/config``)
once and never again: only its own refreshable kinds (instance and container roles,
SSO, ``credential_process``) renew themselves. Yet temporary credentials are often
renewed by writing the file in place (a cron job running ``aws sts``, saml2aws, a
cluster's own tool), and a daemon that runs for weeks would sign with the expired ones
until it is restarted. :class:`FileCredentials` stands in for the credentials object the
signers hold (both clients call ``get_frozen_credentials`` for every request): when the
credentials came from one of those files and the file has changed since (size, inode,
mtime; two stats per request, a few microseconds against a request's milliseconds), the
chain is resolved again from a fresh session before the request is signed.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger(__name__)

#: botocore's ``method`` of credentials read from the shared credentials or config file.
FILE_METHODS = ("shared-credentials-file", "config-file")

def _signature(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class FileCredentials:
    """Credentials that follow changes of the files they were read from (see above)."""

    def __init__(self, session: Any, credentials: Any) -> None:
        self._session = session  # a botocore session: its profile and file locations
        self._credentials = credentials
        self._lock = threading.Lock()
        self._paths = self._files(session)
        self._seen = [_signature(p) for p in self._paths]

    @staticmethod
    def _files(session: Any) -> list[str]:
        paths = []
        for name in ("credentials_file", "config_file"):
            try:
                value = session.get_config_variable(name)
            except Exception:
                continue
            if value:
                paths.append(os.path.expanduser(str(value)))
        return paths

    @property
    def method(self) -> str:
        return str(getattr(self._credentials, "method", ""))

    def get_frozen_credentials(self) -> Any:
        if (getattr(self._credentials, "method", None) in FILE_METHODS
                and [_signature(p) for p in self._paths] != self._seen):
            self._reload()
        return self._credentials.get_frozen_credentials()

    def _reload(self) -> None:
        with self._lock:
            seen = [_signature(p) for p in self._paths]
            if seen == self._seen:
                return  # (another thread has read it)
            self._seen = seen
            try:
                import botocore.session

                fresh = botocore.session.Session(profile=self._session.profile)
                credentials = fresh.get_credentials()
            except Exception as exc:  # a file caught half-written: the next change retries
                log.warning("the AWS credentials file changed but cannot be read (%s); "
                            "keeping the credentials in use", exc)
                return
            if credentials is None:
                log.warning("the AWS credentials file changed and holds no credentials now; "
                            "keeping the credentials in use")
                return
            old = self._credentials.get_frozen_credentials().access_key
            self._credentials = credentials
            log.info("the AWS credentials file changed: signing with the credentials it holds "
                     "now (access key ...%s, was ...%s)",
                     credentials.get_frozen_credentials().access_key[-4:], old[-4:])

    def __getattr__(self, name: str) -> Any:
        # Anything else a signer asks of credentials (access_key, token...) is today's.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._credentials, name)

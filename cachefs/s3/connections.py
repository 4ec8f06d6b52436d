"""Opening HTTP(S) connections to one S3 endpoint, the way the AWS SDKs do.

* **Proxies** come from the environment, as in botocore and curl:
  ``HTTPS_PROXY`` for an https endpoint, ``HTTP_PROXY`` for an http one
  (lower-case names too), unless ``NO_PROXY`` names the host. An https
  endpoint is reached through an HTTP CONNECT tunnel (TLS end to end); a
  plain-http endpoint gets absolute-form requests sent to the proxy. Proxy
  credentials in the proxy URL (``http://user:pass@proxy:3128``) are sent as
  ``Proxy-Authorization: Basic``. Only ``http://`` proxy URLs are supported
  (as with most proxies); anything else is a ConfigError at mount.
* **TLS** is verified against the system's CA store, or against the bundle
  named by ``AWS_CA_BUNDLE`` (or the AWS config's ``ca_bundle``) when set.

This stays on ``http.client`` rather than urllib3's pool because it is
cheaper per request on the small-file path that bounds the daemon's CPU
(measured by ``benchmarks/getcpu.py``; numbers in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import base64
import http.client
import os
import ssl
import urllib.parse
import urllib.request
from collections.abc import Mapping

from cachefs.errors import ConfigError


class Connector:
    """Makes connections to ``host:port`` (thread-safe: holds only settings)."""

    def __init__(self, host: str, port: int, *, https: bool, connect_timeout: float,
                 ca_bundle: str | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.host = host
        self.port = port
        self.https = https
        self.connect_timeout = connect_timeout
        self.proxy: tuple[str, int] | None = None
        self.proxy_headers: dict[str, str] = {}
        env = os.environ if environ is None else environ
        proxy_url = _proxy_for(host, https, env)
        if proxy_url:
            url = urllib.parse.urlsplit(proxy_url if "//" in proxy_url else "http://" + proxy_url)
            if url.scheme != "http" or not url.hostname:
                raise ConfigError(f"proxy {_redact(proxy_url)!r}: only http:// proxies are "
                                  "supported")
            self.proxy = (url.hostname, url.port or 80)
            if url.username is not None:
                user = urllib.parse.unquote(url.username)
                password = urllib.parse.unquote(url.password or "")
                token = base64.b64encode(f"{user}:{password}".encode()).decode()
                self.proxy_headers["Proxy-Authorization"] = f"Basic {token}"
        self._ssl: ssl.SSLContext | None = None
        if https:
            bundle = ca_bundle or env.get("AWS_CA_BUNDLE") or None
            try:
                self._ssl = ssl.create_default_context(cafile=bundle)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"CA bundle {bundle!r} cannot be used: {exc}") from None

    @property
    def via_proxy(self) -> str | None:
        """``host:port`` of the proxy in use, or None (for logs)."""
        return f"{self.proxy[0]}:{self.proxy[1]}" if self.proxy else None

    def target(self, path: str) -> str:
        """The request target for ``path``: absolute-form through a plain-http proxy."""
        if self.proxy and not self.https:
            netloc = self.host if self.port == 80 else f"{self.host}:{self.port}"
            return f"http://{netloc}{path}"
        return path

    def request_headers(self) -> dict[str, str]:
        """Headers every request carries on top of the signed ones."""
        if self.proxy and not self.https:
            return dict(self.proxy_headers)
        return {}

    def new(self) -> http.client.HTTPConnection:
        """A new, not yet connected connection (``connect()`` may raise OSError)."""
        conn: http.client.HTTPConnection
        if self.proxy is None:
            if self.https:
                conn = http.client.HTTPSConnection(self.host, self.port,
                                                   timeout=self.connect_timeout,
                                                   context=self._ssl)
            else:
                conn = http.client.HTTPConnection(self.host, self.port,
                                                  timeout=self.connect_timeout)
            return conn
        phost, pport = self.proxy
        if self.https:
            conn = http.client.HTTPSConnection(phost, pport, timeout=self.connect_timeout,
                                               context=self._ssl)
            # CONNECT host:port; TLS (with SNI and certificate check for the S3 host)
            # runs inside the tunnel.
            conn.set_tunnel(self.host, self.port, headers=self.proxy_headers or None)
        else:
            conn = http.client.HTTPConnection(phost, pport, timeout=self.connect_timeout)
        return conn


def _proxy_for(host: str, https: bool, env: Mapping[str, str]) -> str | None:
    """The proxy URL the environment names for ``host``, or None (NO_PROXY honoured)."""
    proxies = {k.lower(): v for k, v in env.items()
               if k.lower() in ("https_proxy", "http_proxy", "no_proxy") and v}
    url = proxies.get("https_proxy" if https else "http_proxy")
    if not url:
        return None
    no_proxy = proxies.get("no_proxy")
    if no_proxy and urllib.request.proxy_bypass_environment(  # type: ignore[attr-defined]
            host, {"no": no_proxy}):
        return None
    return url


def _redact(url: str) -> str:
    """A proxy URL without its password (for error messages)."""
    parts = urllib.parse.urlsplit(url if "//" in url else "http://" + url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))

"""Credentials read from the shared credentials or config file, followed when the file
changes (:class:`cachefs.s3.credentials.FileCredentials`; unit tests with botocore's own
session; the mounts are in ``tests/test_faults.py``).

What is checked: each request asks for the credentials (``get_frozen_credentials``) and
costs at most one stat of a file (it cost two: both files at every request, the S3 GET
path's only system calls besides the request's own), yet the request after a rotation
written into the file the credentials came from signs with the new key, never the old."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import botocore.session
import pytest

from cachefs.s3 import credentials as credentials_module
from cachefs.s3.credentials import FileCredentials


def _profile(key: str) -> str:
    return f"[default]\naws_access_key_id = {key}\naws_secret_access_key = secret-of-{key}\n"


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(credentials file, config file), empty; the environment names no credentials."""
    creds, config = tmp_path / "credentials", tmp_path / "config"
    creds.write_text("")
    config.write_text("")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    return creds, config


def _counting_stats(monkeypatch: pytest.MonkeyPatch, paths: tuple[Path, Path]) -> list[str]:
    """Every stat of one of ``paths`` from now on."""
    watched = {str(p) for p in paths}
    stats: list[str] = []
    real = os.stat

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if str(path) in watched:
            stats.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    return stats


def _credentials() -> FileCredentials:
    session = botocore.session.Session()
    found = session.get_credentials()
    assert found is not None
    return FileCredentials(session, found)


@pytest.mark.parametrize("source", ["credentials file", "config file"])
def test_each_request_stats_one_file_and_a_rotation_is_used_by_the_next(
        files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    creds, config = files
    path = creds if source == "credentials file" else config
    path.write_text(_profile("OLDKEY"))
    c = _credentials()
    assert c.method == ("shared-credentials-file" if path is creds else "config-file")
    stats = _counting_stats(monkeypatch, files)
    for _ in range(20):
        assert c.get_frozen_credentials().access_key == "OLDKEY"
    assert len(stats) <= 20, f"{len(stats)} stats for 20 requests"
    path.write_text(_profile("NEWKEY-ROTATED"))  # (a refresher rewrites it in place)
    assert c.get_frozen_credentials().access_key == "NEWKEY-ROTATED", \
        "the request after the rotation signed with the old key"
    stats.clear()
    for _ in range(20):
        assert c.get_frozen_credentials().access_key == "NEWKEY-ROTATED"
    assert len(stats) <= 20, f"{len(stats)} stats for 20 requests"


def test_credentials_written_into_the_credentials_file_take_over_from_the_config_file(
        files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The credentials file comes first in botocore's chain: credentials written there
    replace those read from the config file (looked at every OTHER_FILE_INTERVAL)."""
    creds, config = files
    config.write_text(_profile("CONFIGKEY"))
    monkeypatch.setattr(credentials_module, "OTHER_FILE_INTERVAL", 0.0)
    c = _credentials()
    assert c.get_frozen_credentials().access_key == "CONFIGKEY"
    creds.write_text(_profile("CREDSKEY"))
    assert c.get_frozen_credentials().access_key == "CREDSKEY"
    assert c.method == "shared-credentials-file"
    # (now read from the credentials file: a change of the config file changes nothing)
    stats = _counting_stats(monkeypatch, files)
    for _ in range(5):
        assert c.get_frozen_credentials().access_key == "CREDSKEY"
    assert stats == [str(creds)] * 5

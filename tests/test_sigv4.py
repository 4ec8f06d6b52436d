"""cachefs's SigV4 signer against botocore's, header for header, for the requests
cachefs sends (whole and ranged GETs, checksum HEADs, listings, HeadBucket)."""

from __future__ import annotations

import datetime
import itertools
import urllib.parse

import botocore.auth
import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials, RefreshableCredentials

from cachefs.s3.sigv4 import SigV4Signer

NOW = datetime.datetime(2026, 12, 3, 9, 30, 15, tzinfo=datetime.UTC)
ETAG = '"0123456789abcdef0123456789abcdef"'


def botocore_headers(monkeypatch: pytest.MonkeyPatch, base: str, method: str, target: str,
                     extra: dict[str, str], creds: Credentials, region: str,
                     when: datetime.datetime = NOW) -> dict[str, str]:
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: when)
    request = AWSRequest(method, base + target, headers=extra)
    S3SigV4Auth(creds.get_frozen_credentials(), "s3", region).add_auth(request)
    return dict(request.headers.items())


def ours(host: str, method: str, target: str, extra: dict[str, str], creds: Credentials,
         region: str, when: datetime.datetime = NOW,
         signer: SigV4Signer | None = None) -> dict[str, str]:
    signer = signer or SigV4Signer(host, region)
    return signer.sign(method, target, extra, creds.get_frozen_credentials(),
                       now=when.timestamp())


def object_path(prefix: str, key: str) -> str:
    return prefix + "/" + urllib.parse.quote(key, safe="/~")  # as RangeClient sends it


KEYS = ["ds/c000/img000001.jpg", "a b/ü+é=%/x~y*z(1)!'.jpg", "odd/../dots/./x//y", "日本/ファイル",
        "semi;colon,comma&amp?q=1#frag"]

REQUESTS = [
    ("GET", {"If-Match": ETAG, "x-amz-checksum-mode": "ENABLED"}),  # whole-object GET
    ("GET", {"If-Match": ETAG, "Range": "bytes=4194304-8388607"}),  # ranged GET
    ("GET", {"If-Match": "*", "Range": "bytes=0-0"}),
    ("HEAD", {"If-Match": ETAG, "x-amz-checksum-mode": "ENABLED"}),  # checksum HEAD
]

ENDPOINTS = [
    # (endpoint base as sent, Host header, path prefix)
    ("http://127.0.0.1:8333", "127.0.0.1:8333", "/bucket"),
    ("https://bkt.s3.eu-west-1.amazonaws.com", "bkt.s3.eu-west-1.amazonaws.com", ""),
    ("https://minio.example.org:9443", "minio.example.org:9443", "/my.bucket"),
]

CREDS = [
    Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"),
    Credentials("ASIATEMP", "secret/with+chars", token="FwoGZXIvYXdzE//token+with/odd=chars=="),
]


@pytest.mark.parametrize("base,host,prefix", ENDPOINTS)
@pytest.mark.parametrize("creds", CREDS, ids=["long-term", "session-token"])
@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("method,extra", REQUESTS)
def test_object_requests_are_signed_as_botocore_signs_them(
        monkeypatch: pytest.MonkeyPatch, base: str, host: str, prefix: str, creds: Credentials,
        key: str, method: str, extra: dict[str, str]) -> None:
    target = object_path(prefix, key)
    expected = botocore_headers(monkeypatch, base, method, target, extra, creds, "eu-west-1")
    got = ours(host, method, target, extra, creds, "eu-west-1")
    assert got.pop("Host") == host
    assert got == expected


@pytest.mark.parametrize("query", [
    "continuation-token=1%2Fabc%2B%3D%3D&delimiter=%2F&encoding-type=url&list-type=2&max-keys=1000"
    "&prefix=ds%2Fc%20001%2F",
    "delimiter=%2F&encoding-type=url&list-type=2&max-keys=1000&prefix=&start-after=ds%2Fimg%2B9",
    "list-type=2&max-keys=1",
    "max-keys=1&list-type=2",  # not sorted as sent: signed sorted
])
def test_listings_are_signed_as_botocore_signs_them(monkeypatch: pytest.MonkeyPatch,
                                                    query: str) -> None:
    for creds in CREDS:
        target = "/bucket/?" + query
        expected = botocore_headers(monkeypatch, "http://127.0.0.1:8333", "GET", target, {},
                                    creds, "us-east-1")
        got = ours("127.0.0.1:8333", "GET", target, {}, creds, "us-east-1")
        got.pop("Host")
        assert got == expected


def test_head_bucket_is_signed_as_botocore_signs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = botocore_headers(monkeypatch, "https://s3.amazonaws.com", "HEAD", "/bucket", {},
                                CREDS[1], "us-east-1")
    got = ours("s3.amazonaws.com", "HEAD", "/bucket", {}, CREDS[1], "us-east-1")
    got.pop("Host")
    assert got == expected


def test_the_cached_signing_key_follows_the_date_and_a_rotated_secret(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One signer across midnight and a credential rotation signs each request with the
    key of its own date and secret (the cache never serves a stale key)."""
    signer = SigV4Signer("127.0.0.1:8333", "us-east-1")
    extra = {"If-Match": ETAG, "Range": "bytes=0-99"}
    target = "/bucket/k"
    times = [NOW, NOW + datetime.timedelta(seconds=1), NOW + datetime.timedelta(days=1),
             NOW + datetime.timedelta(days=1, seconds=5)]
    for creds in (CREDS[0], Credentials("AKIDEXAMPLE", "rotated-secret"), CREDS[0]):
        for when in times:
            expected = botocore_headers(monkeypatch, "http://127.0.0.1:8333", "GET", target,
                                        extra, creds, "us-east-1", when)
            got = ours("127.0.0.1:8333", "GET", target, extra, creds, "us-east-1", when, signer)
            got.pop("Host")
            assert got == expected


def test_refreshed_credentials_are_used_for_the_next_request() -> None:
    """Instance-role credentials refresh: each request signs with the credentials
    get_frozen_credentials() gives at that moment."""
    issued = itertools.count()

    def refresh() -> dict[str, str]:
        expiry = (datetime.datetime.now(datetime.UTC)
                  + datetime.timedelta(minutes=1)).isoformat()  # always due for a refresh
        return {"access_key": "ASIAROLE", "secret_key": f"secret-{next(issued)}",
                "token": "tok", "expiry_time": expiry}

    creds = RefreshableCredentials.create_from_metadata(refresh(), refresh, "test")
    signer = SigV4Signer("127.0.0.1:8333", "us-east-1")
    signatures = []
    for _ in range(2):
        frozen = creds.get_frozen_credentials()
        got = signer.sign("GET", "/b/k", {}, frozen, now=NOW.timestamp())["Authorization"]
        fresh = SigV4Signer("127.0.0.1:8333", "us-east-1").sign(
            "GET", "/b/k", {}, Credentials("ASIAROLE", frozen.secret_key, "tok"),
            now=NOW.timestamp())["Authorization"]
        assert got == fresh
        signatures.append(got)
    assert signatures[0] != signatures[1]


def test_the_aws_documented_example_signature() -> None:
    """AWS's published example (S3 GET Object with a Range header, SigV4 docs, "Example:
    GET Object"): the payload there is empty, so its hash is the one signed here."""
    signer = SigV4Signer("examplebucket.s3.amazonaws.com", "us-east-1")
    creds = Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    when = datetime.datetime(2013, 5, 24, tzinfo=datetime.UTC).timestamp()
    headers = signer.sign("GET", "/test.txt", {"Range": "bytes=0-9"},
                          creds.get_frozen_credentials(), now=when)
    assert headers["Authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")

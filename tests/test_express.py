"""S3 Express One Zone session auth, offline: the client against a stub zonal endpoint
that answers CreateSession and verifies every signature (tests/express_stub.py), the
session cache's renewal rules with a fake clock, and a real mount whose shared tier is
the stub (blocks published and read back with session-signed requests only)."""

from __future__ import annotations

import random
import threading
import time

import pytest
from botocore.credentials import Credentials

from cachefs.errors import AccessDenied, StoreError, TransientStoreError
from cachefs.s3 import express
from cachefs.s3.express import ExpressSessions, SessionCredentials
from cachefs.s3.objects import ObjectClient
from tests.conftest import ACCESS_KEY, SECRET_KEY
from tests.express_stub import REGION, ExpressStub

BUCKET = "cachefs-cache--usw2-az1--x-s3"


def test_directory_bucket_names_and_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    assert express.is_directory_bucket(BUCKET)
    assert not express.is_directory_bucket("plain-bucket")
    assert not express.is_directory_bucket("--x-s3")
    assert express.zone_id(BUCKET) == "usw2-az1"
    assert express.zonal_endpoint(BUCKET, "us-west-2") == (
        "https://s3express-usw2-az1.us-west-2.amazonaws.com")
    client = ObjectClient(BUCKET, endpoint_url=express.zonal_endpoint(BUCKET, "us-west-2"),
                          region="us-west-2", credentials=None, anonymous=False)
    assert client.endpoint == f"https://{BUCKET}.s3express-usw2-az1.us-west-2.amazonaws.com"
    assert client.sessions is not None  # session auth by default for directory buckets
    monkeypatch.setenv("AWS_S3_DISABLE_EXPRESS_SESSION_AUTH", "true")
    client = ObjectClient(BUCKET, endpoint_url="https://s3express-usw2-az1.us-west-2."
                          "amazonaws.com", region="us-west-2", credentials=None)
    assert client.sessions is None


def test_parse_create_session_answer() -> None:
    body = (b'<?xml version="1.0"?><CreateSessionResult xmlns="http://s3.amazonaws.com/doc/'
            b'2006-03-01/"><Credentials><SessionToken>tok</SessionToken><SecretAccessKey>sk'
            b'</SecretAccessKey><AccessKeyId>ak</AccessKeyId><Expiration>2026-01-02T03:04:05Z'
            b'</Expiration></Credentials></CreateSessionResult>')
    creds = express.parse_create_session(body)
    assert (creds.access_key, creds.secret_key, creds.token) == ("ak", "sk", "tok")
    assert creds.expiration == 1767323045.0
    with pytest.raises(StoreError, match="CreateSession answer has no AccessKeyId"):
        express.parse_create_session(b"<CreateSessionResult><Credentials/></CreateSessionResult>")
    with pytest.raises(TransientStoreError):
        express.parse_create_session(b"<not xml")


def _session(n: int, expires: float) -> SessionCredentials:
    return SessionCredentials(f"ak{n}", f"sk{n}", f"tok{n}", expires)


def test_sessions_are_reused_then_renewed_ahead_of_expiry() -> None:
    now = [1000.0]
    made: list[SessionCredentials] = []

    def create() -> SessionCredentials:
        made.append(_session(len(made), now[0] + 300))
        return made[-1]

    sessions = ExpressSessions(create, clock=lambda: now[0])
    first = sessions.get()
    assert sessions.get() is first and len(made) == 1
    now[0] += 300 - 61  # outside the advisory window still
    assert sessions.get() is first
    now[0] += 2  # inside it: renewed
    second = sessions.get()
    assert second is not first and len(made) == 2
    sessions.invalidate(second)  # the store said it expired
    assert sessions.get() is not second and len(made) == 3


def test_a_failed_renewal_keeps_a_still_valid_session() -> None:
    now = [0.0]
    fail = [False]

    def create() -> SessionCredentials:
        if fail[0]:
            raise TransientStoreError("CreateSession: 503")
        return _session(0, now[0] + 300)

    sessions = ExpressSessions(create, clock=lambda: now[0])
    first = sessions.get()
    fail[0] = True
    now[0] = 250  # 50 s left: renewal due, fails, the old session is still good
    assert sessions.get() is first
    now[0] = 295  # 5 s left: too close to expiry to sign with
    with pytest.raises(TransientStoreError):
        sessions.get()


def test_concurrent_first_use_creates_one_session() -> None:
    calls = []

    def create() -> SessionCredentials:
        calls.append(1)
        time.sleep(0.05)
        return _session(len(calls), time.time() + 300)

    sessions = ExpressSessions(create)
    threads = [threading.Thread(target=sessions.get) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1


def _client(stub: ExpressStub, **kw: object) -> ObjectClient:
    return ObjectClient(BUCKET, endpoint_url=stub.url, region=REGION,
                        credentials=Credentials(ACCESS_KEY, SECRET_KEY), **kw)  # type: ignore[arg-type]


def test_object_requests_are_signed_with_the_session() -> None:
    with ExpressStub(ACCESS_KEY, SECRET_KEY) as stub:
        client = _client(stub)
        assert client.sessions is not None
        assert client.get("k") is None
        assert client.put("k", b"data", metadata={"cachefs-block": "v1:x"}, if_none_match=True)
        assert not client.put("k", b"other", if_none_match=True)  # 412: kept
        resp = client.get("k")
        assert resp is not None and resp.body == b"data"
        assert resp.headers["x-amz-meta-cachefs-block"] == "v1:x"
        head = client.head("k")
        assert head is not None and head["content-length"] == "4"
        client.delete("k")
        assert client.head("k") is None
        assert stub.counts["CreateSession"] == 1  # one session for all of them
        assert stub.rejected == []


def test_an_expired_session_is_replaced_and_the_request_sent_again() -> None:
    with ExpressStub(ACCESS_KEY, SECRET_KEY) as stub:
        client = _client(stub)
        client.put("k", b"v")
        stub.revoke()
        resp = client.get("k")
        assert resp is not None and resp.body == b"v"
        assert stub.counts["CreateSession"] == 2
        assert stub.rejected == [f"GET /{BUCKET}/k: session expired"]


def test_create_session_denied_and_wrong_keys_are_errors() -> None:
    with ExpressStub(ACCESS_KEY, SECRET_KEY) as stub:
        stub.deny_sessions = True
        with pytest.raises(AccessDenied):
            _client(stub).get("k")
    with ExpressStub(ACCESS_KEY, "another-secret") as stub:
        with pytest.raises(StoreError):
            _client(stub).get("k")
        assert "signature does not match" in stub.rejected[0]


def test_read_only_session_mode_cannot_write() -> None:
    with ExpressStub(ACCESS_KEY, SECRET_KEY) as stub:
        client = _client(stub, session_mode="ReadOnly")
        assert client.get("k") is None
        with pytest.raises(AccessDenied):
            client.put("k", b"v")


@pytest.mark.fuse
def test_a_mount_publishes_to_and_reads_from_an_express_bucket(bucket, mount_factory) -> None:
    client, name = bucket
    rnd = random.Random(9)
    data = {f"d/f{i}.bin": rnd.randbytes(100_000 + 30_000 * i) for i in range(4)}
    for k, v in data.items():
        client.put_object(Bucket=name, Key=k, Body=v)
    blocks = sum((len(v) + 65535) // 65536 for v in data.values())
    with ExpressStub(ACCESS_KEY, SECRET_KEY) as stub:
        args = ["--block-size", "64K", "--shared-cache", f"s3://{BUCKET}/ds",
                "--shared-cache-endpoint-url", stub.url, "--shared-cache-region", REGION,
                "--shared-cache-timeout", "10s"]
        a = mount_factory(f"s3://{name}", *args)
        for k, v in data.items():
            assert (a.path / k).read_bytes() == v
        deadline = time.monotonic() + 30
        while (a.metric('cachefs_shared_publishes_total{result="stored"}') < blocks
               and time.monotonic() < deadline):
            time.sleep(0.1)
        assert len([k for k in stub.objects if k[1].startswith("ds/v1/")]) == blocks
        b = mount_factory(f"s3://{name}", *args)
        for k, v in data.items():
            assert (b.path / k).read_bytes() == v
        assert b.gets() == 0
        assert b.metric('cachefs_shared_lookups_total{result="hit"}') == blocks
        assert stub.rejected == []
        assert stub.counts["CreateSession"] == 2  # one session per node
        assert "ready (conditional writes honoured, fetch leases on)" in b.log()

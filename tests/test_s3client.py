"""The lean S3 client against a real S3 server (moto) behind loopback proxies: the bucket's
region, HTTP(S) proxies and CA bundles, stale connections, stalls, truncated answers."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from cachefs import metrics
from cachefs.config import resolve
from cachefs.errors import StoreError, TransientStoreError
from cachefs.s3.boto import S3Store
from cachefs.s3.store import Exchange
from tests.faultproxy import FaultProxy, ForwardProxy, self_signed_cert


def put(bucket: tuple[Any, str], key: str, data: bytes) -> str:
    client, name = bucket
    client.put_object(Bucket=name, Key=key, Body=data)
    return str(client.head_object(Bucket=name, Key=key)["ETag"].strip('"'))


# -- any region ---------------------------------------------------------------------------
@pytest.mark.parametrize("redirect", [False, True], ids=["400-malformed", "301-redirect"])
def test_bucket_region_is_found_and_used(bucket, s3_endpoint, redirect: bool) -> None:
    etag = put(bucket, "r.bin", b"regional bytes")
    with FaultProxy(s3_endpoint) as proxy:
        proxy.bucket_region = "eu-west-1"
        proxy.redirect = redirect
        node_default = S3Store(bucket[1], endpoint_url=proxy.url)  # AWS config: us-east-1
        assert node_default.region == "us-east-1"
        with pytest.raises(StoreError):  # what every GET did before
            node_default.get_range("r.bin", etag, 0, 14)
        assert node_default.bucket_region() == "eu-west-1"
        store = node_default.for_region("eu-west-1")
        assert store.get_range("r.bin", etag, 0, 14) == b"regional bytes"
        assert store.list_page("", None).objects[0].key == "r.bin"
        assert proxy.faults["wrong_region"] >= 2


def test_daemon_store_signs_for_the_buckets_region_unless_overridden(bucket, s3_endpoint,
                                                                     tmp_path) -> None:
    from cachefs.daemon import make_store

    _, name = bucket
    with FaultProxy(s3_endpoint) as proxy:
        proxy.bucket_region = "eu-west-1"
        base = {"source": f"s3://{name}", "mountpoint": str(tmp_path / "m"),
                "cache_dir": str(tmp_path / "c"), "endpoint_url": proxy.url}
        assert make_store(resolve(base, environ={})).region == "eu-west-1"
        pinned = make_store(resolve({**base, "region": "ap-south-1"}, environ={}))
        assert pinned.region == "ap-south-1"  # --region stays an override


@pytest.mark.parametrize("command", ["probe", "manifest export"])
def test_cli_tools_sign_for_the_buckets_region(bucket, s3_endpoint, command: str) -> None:
    # cachefs probe and cachefs manifest export look the region up as the mount does.
    import json

    from tests.conftest import run_cachefs

    put(bucket, "d/r.bin", b"regional bytes")
    with FaultProxy(s3_endpoint) as proxy:
        proxy.bucket_region = "eu-west-1"
        url = f"s3://{bucket[1]}/d/"
        if command == "probe":
            args = ["probe", url, "--samples", "2", "--parallel", "1", "--seconds", "0.2",
                    "--json"]
        else:
            args = ["manifest", "export", url, "--format", "jsonl"]
        r = run_cachefs(*args, "--endpoint-url", proxy.url)
        assert r.returncode == 0, r.stderr
        if command == "probe":
            assert json.loads(r.stdout)["objects_seen"] == 1
        else:
            assert [json.loads(line)["key"] for line in r.stdout.splitlines()] == ["d/r.bin"]
        assert proxy.faults["wrong_region"] >= 1  # the first request was refused: looked up


def test_bucket_region_of_a_server_that_does_not_say_is_none(bucket, s3_endpoint) -> None:
    assert S3Store(bucket[1], endpoint_url=s3_endpoint).bucket_region() in (None, "us-east-1")


# -- proxies and CA bundles -------------------------------------------------------------------
def test_http_proxy_is_used_and_no_proxy_bypasses_it(bucket, s3_endpoint,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    etag = put(bucket, "p.bin", b"through a proxy")
    with ForwardProxy() as fwd:
        monkeypatch.setenv("HTTP_PROXY", fwd.url.replace("http://", "http://user:pa%3Ass@"))
        store = S3Store(bucket[1], endpoint_url=s3_endpoint)
        assert store.get_range("p.bin", etag, 0, 15) == b"through a proxy"
        host = s3_endpoint.removeprefix("http://")
        assert ("GET", f"http://{host}/{bucket[1]}/p.bin") in fwd.seen
        assert "Basic dXNlcjpwYTpzcw==" in fwd.auth  # user:pa:ss
        assert "via proxy" in store.endpoint
        seen = len(fwd.seen)
        monkeypatch.setenv("NO_PROXY", "localhost,127.0.0.1")
        direct = S3Store(bucket[1], endpoint_url=s3_endpoint)
        assert direct.get_range("p.bin", etag, 0, 7) == b"through"
        assert len(fwd.seen) == seen


def test_shared_tier_client_uses_the_same_proxy_settings(bucket, s3_endpoint,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from botocore.credentials import Credentials

    from cachefs.s3.objects import ObjectClient

    with ForwardProxy() as fwd:
        monkeypatch.setenv("HTTP_PROXY", fwd.url.replace("http://", "http://user:pa%3Ass@"))
        client = ObjectClient(bucket[1], endpoint_url=s3_endpoint, region="us-east-1",
                              credentials=Credentials("testing", "testing"))
        assert client.put("blk", b"shared bytes", metadata={"cachefs-block": "x"},
                          if_none_match=True)
        got = client.get("blk")
        assert got is not None and got.body == b"shared bytes"
        assert got.headers["x-amz-meta-cachefs-block"] == "x"
        client.delete("blk")
        assert client.head("blk") is None
        host = s3_endpoint.removeprefix("http://")
        assert [m for m, t in fwd.seen if t == f"http://{host}/{bucket[1]}/blk"] == [
            "PUT", "GET", "DELETE", "HEAD"]
        assert "Basic dXNlcjpwYTpzcw==" in fwd.auth
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        seen = len(fwd.seen)
        direct = ObjectClient(bucket[1], endpoint_url=s3_endpoint, region="us-east-1",
                              credentials=Credentials("testing", "testing"))
        assert direct.get("blk") is None and len(fwd.seen) == seen


def test_https_through_a_connect_proxy_with_a_private_ca(bucket, s3_endpoint, tmp_path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    etag = put(bucket, "t.bin", b"tls bytes")
    cert, key = self_signed_cert(str(tmp_path))
    with FaultProxy(s3_endpoint, tls=(cert, key)) as tls_front, ForwardProxy() as fwd:
        monkeypatch.setenv("HTTPS_PROXY", fwd.url)
        untrusted = S3Store(bucket[1], endpoint_url=tls_front.url)
        with pytest.raises(TransientStoreError, match="CERTIFICATE_VERIFY_FAILED"):
            untrusted.get_range("t.bin", etag, 0, 9)
        monkeypatch.setenv("AWS_CA_BUNDLE", cert)
        store = S3Store(bucket[1], endpoint_url=tls_front.url)
        assert store.get_range("t.bin", etag, 0, 9) == b"tls bytes"
        assert store.list_page("", None).objects[0].key == "t.bin"  # boto3 listings too
        port = tls_front.url.rsplit(":", 1)[1]
        assert ("CONNECT", f"127.0.0.1:{port}") in fwd.seen


def _abort_once_the_headers_came(exchange: Exchange) -> None:
    """Abort ``exchange`` from another thread once its answer's headers came and its body
    stalls (a fixed 0.5 s timer raced the headers on a busy machine: CI saw it fire first)."""
    def abort() -> None:
        deadline = time.monotonic() + 10
        while exchange.first_byte_at is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # in the stalled body by now
        exchange.abort()

    threading.Thread(target=abort, daemon=True).start()


def test_https_bodies_of_many_tls_records_and_an_abort(bucket, s3_endpoint, tmp_path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """TLS sockets cannot wait for a whole body in one recv: they take the record-by-record
    path, with Python's socket timeout as the idle timeout, and an abort still ends them."""
    data = bytes(range(256)) * 1200  # 307,200 bytes: ~19 TLS records
    etag = put(bucket, "big.bin", data)
    cert, key = self_signed_cert(str(tmp_path))
    monkeypatch.setenv("AWS_CA_BUNDLE", cert)
    with FaultProxy(s3_endpoint, tls=(cert, key)) as tls_front:
        store = S3Store(bucket[1], endpoint_url=tls_front.url)
        for _ in range(2):  # a new connection, then a kept-alive one
            body = store.get("big.bin", etag, 0, len(data), whole=True)
            assert body.data == data and body.etag_md5
        assert store.get_range("big.bin", etag, 1000, 200_000) == data[1000:200_000]
        tls_front.plan = lambda method, path, n: "stall_body"
        exchange = Exchange(idle_timeout=60)
        _abort_once_the_headers_came(exchange)
        t0 = time.monotonic()
        with pytest.raises(TransientStoreError) as info:
            store.get("big.bin", etag, 0, len(data), exchange=exchange)
        assert time.monotonic() - t0 < 10  # not the 60 s idle timeout
        assert info.value.reason == "stopping"


def test_unusable_proxy_url_is_one_clear_error(bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    from cachefs.errors import ConfigError

    monkeypatch.setenv("HTTPS_PROXY", "socks5://user:secret@proxy:1080")
    with pytest.raises(ConfigError, match="only http:// proxies") as info:
        S3Store(bucket[1], endpoint_url="https://s3.example.com")
    assert "secret" not in str(info.value)


# -- connections -----------------------------------------------------------------------------
def test_a_kept_alive_connection_the_server_closed_is_resent_at_once(bucket, s3_endpoint) -> None:
    etag = put(bucket, "k.bin", b"keep-alive")
    with FaultProxy(s3_endpoint) as proxy:
        store = S3Store(bucket[1], endpoint_url=proxy.url)
        assert store.get_range("k.bin", etag, 0, 10) == b"keep-alive"
        proxy.set_down(True)  # every open connection is reset...
        proxy.set_down(False)  # ...and the server is back
        errors = metrics.REGISTRY.get_sample_value(
            "cachefs_s3_errors_total", {"op": "get", "kind": "TransientStoreError"}) or 0
        assert store.get_range("k.bin", etag, 0, 10) == b"keep-alive"
        assert (metrics.REGISTRY.get_sample_value(
            "cachefs_s3_errors_total", {"op": "get", "kind": "TransientStoreError"}) or 0) == errors


def _gets() -> float:
    return metrics.REGISTRY.get_sample_value("cachefs_s3_requests_total", {"op": "get"}) or 0


def test_connections_opened_ahead_serve_the_first_requests(bucket, s3_endpoint) -> None:
    etag = put(bucket, "p.bin", b"prewarmed")
    with FaultProxy(s3_endpoint) as proxy:
        store = S3Store(bucket[1], endpoint_url=proxy.url)
        assert store.prewarm(3) == 3
        for _ in range(100):  # (the server side of each connection is set up in a thread)
            if len(proxy._conns) == 3:
                break
            time.sleep(0.02)
        assert len(proxy._conns) == 3
        assert store.get_range("p.bin", etag, 0, 9) == b"prewarmed"
        assert len(proxy._conns) == 3, "the first GET opened a connection of its own"


def test_pooled_connections_the_server_closed_are_dropped_not_sent_on(bucket, s3_endpoint) -> None:
    etag = put(bucket, "q.bin", b"idle-closed")
    with FaultProxy(s3_endpoint) as proxy:
        store = S3Store(bucket[1], endpoint_url=proxy.url)
        assert store.prewarm(4) == 4
        proxy.set_down(True)  # every pooled connection is reset (an idle timeout's close)...
        proxy.set_down(False)  # ...and the server is back
        before = _gets()
        assert store.get_range("q.bin", etag, 0, 11) == b"idle-closed"
        # One request sent: no attempt on a closed connection, no resend.
        assert _gets() == before + 1


def test_a_stalled_answer_is_aborted_from_another_thread(bucket, s3_endpoint) -> None:
    etag = put(bucket, "s.bin", b"x" * 1000)
    with FaultProxy(s3_endpoint) as proxy:
        proxy.plan = lambda method, path, n: "stall_body"
        store = S3Store(bucket[1], endpoint_url=proxy.url)
        exchange = Exchange(idle_timeout=60)
        _abort_once_the_headers_came(exchange)
        t0 = time.monotonic()
        with pytest.raises(TransientStoreError) as info:
            store.get("s.bin", etag, 0, 1000, exchange=exchange)
        assert time.monotonic() - t0 < 10
        assert info.value.reason == "stopping"
        assert exchange.first_byte_at is not None  # the headers had come


def test_idle_timeout_ends_a_silent_answer(bucket, s3_endpoint) -> None:
    etag = put(bucket, "i.bin", b"x" * 1000)
    with FaultProxy(s3_endpoint) as proxy:
        proxy.plan = lambda method, path, n: "stall"
        store = S3Store(bucket[1], endpoint_url=proxy.url)
        with pytest.raises(TransientStoreError) as info:
            store.get("i.bin", etag, 0, 1000, exchange=Exchange(idle_timeout=0.5))
        assert info.value.reason == "timeout"


@pytest.mark.parametrize("fault", ["truncate", "short"])
def test_cut_answers_are_transient_short_bodies(bucket, s3_endpoint, fault: str) -> None:
    etag = put(bucket, "c.bin", b"y" * 5000)
    with FaultProxy(s3_endpoint) as proxy:
        proxy.plan = lambda method, path, n: fault if method == "GET" else "pass"
        store = S3Store(bucket[1], endpoint_url=proxy.url)
        for whole in (False, True):
            with pytest.raises(TransientStoreError) as info:
                store.get("c.bin", etag, 0, 5000, whole=whole)
            assert info.value.reason == "short_body"
        with pytest.raises(TransientStoreError) as info:  # a listing cut short: retried too
            store.list_page("", None)
        assert info.value.reason == "short_body"


def test_whole_object_get_sends_no_range_and_reports_checksums(bucket, s3_endpoint) -> None:
    import boto3
    import botocore.config

    from tests.conftest import ACCESS_KEY, SECRET_KEY

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1",
                          aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                          config=botocore.config.Config(request_checksum_calculation="when_supported"))
    name = bucket[1]
    data = b"checked" * 1000
    client.put_object(Bucket=name, Key="crc.bin", Body=data, ChecksumAlgorithm="CRC64NVME")
    plain = put(bucket, "plain.bin", data)
    crc_etag = client.head_object(Bucket=name, Key="crc.bin")["ETag"].strip('"')
    seen: list[str] = []
    with FaultProxy(s3_endpoint) as proxy:
        proxy.plan = lambda method, path, n: seen.append(method) or "pass"
        store = S3Store(name, endpoint_url=proxy.url)
        body = store.get("crc.bin", crc_etag, 0, len(data), whole=True)
        assert body.data == data and body.checksum is not None
        assert body.checksum.kind == "crc64nvme"
        body = store.get("plain.bin", plain, 0, len(data), whole=True)
        assert body.checksum is None and body.etag_md5  # moto keeps no checksum unasked
        assert store.full_checksum("crc.bin", crc_etag).kind == "crc64nvme"  # type: ignore[union-attr]
        assert store.full_checksum("plain.bin", plain) is None


@pytest.mark.slow
def test_checksums_as_seaweedfs_keeps_them(tmp_path) -> None:
    """SeaweedFS (the throughput test server) states checksums as moto does: the ones the
    upload sent, on whole-object GETs and HEADs, none on ranged GETs; cachefs checks them."""
    import base64
    import os

    import boto3
    import botocore.config
    import trio

    from benchmarks.origin import ACCESS_KEY as WEED_KEY
    from benchmarks.origin import SECRET_KEY as WEED_SECRET
    from benchmarks.origin import SeaweedOrigin
    from cachefs.s3 import integrity
    from cachefs.s3.origin import Origin

    with SeaweedOrigin(tmp_path / "weed", bucket="sums") as weed:
        client = boto3.client(
            "s3", endpoint_url=weed.endpoint, region_name="us-east-1",
            aws_access_key_id=WEED_KEY, aws_secret_access_key=WEED_SECRET,
            config=botocore.config.Config(request_checksum_calculation="when_supported",
                                          s3={"addressing_style": "path"}))
        small = os.urandom(70_000)
        client.put_object(Bucket="sums", Key="plain", Body=small, ChecksumAlgorithm="CRC32")
        client.put_object(Bucket="sums", Key="c64", Body=small, ChecksumAlgorithm="CRC64NVME")
        big = os.urandom(11 << 20)
        mp = client.create_multipart_upload(Bucket="sums", Key="mp", ChecksumAlgorithm="CRC64NVME",
                                            ChecksumType="FULL_OBJECT")
        parts = []
        for n, (lo, hi) in enumerate([(0, 6 << 20), (6 << 20, 11 << 20)], start=1):
            p = client.upload_part(Bucket="sums", Key="mp", UploadId=mp["UploadId"], PartNumber=n,
                                   Body=big[lo:hi], ChecksumAlgorithm="CRC64NVME")
            parts.append({"PartNumber": n, "ETag": p["ETag"],
                          "ChecksumCRC64NVME": p["ChecksumCRC64NVME"]})
        full = integrity.digest("crc64nvme", big)
        client.complete_multipart_upload(
            Bucket="sums", Key="mp", UploadId=mp["UploadId"], ChecksumType="FULL_OBJECT",
            ChecksumCRC64NVME=base64.b64encode(full).decode(), MultipartUpload={"Parts": parts})
        etags = {k: client.head_object(Bucket="sums", Key=k)["ETag"].strip('"')
                 for k in ("plain", "c64", "mp")}
        store = S3Store("sums", endpoint_url=weed.endpoint)  # SeaweedFS takes any credentials
        assert store.get("plain", etags["plain"], 0, 70_000, whole=True).checksum.kind == "crc32"  # type: ignore[union-attr]
        assert store.get("c64", etags["c64"], 0, 70_000, whole=True).checksum.kind == "crc64nvme"  # type: ignore[union-attr]
        stated = store.full_checksum("mp", etags["mp"])
        assert stated is not None and stated.digest == full  # type: ignore[union-attr]
        origin = Origin(store, max_connections=4, deadline=5)

        async def main() -> int:
            got = await origin.get("c64", etags["c64"], 0, 70_000, whole=True)
            assert got.data == small and got.check == "crc64nvme"
            combined = None
            block = 4 << 20
            for start in range(0, len(big), block):
                end = min(len(big), start + block)
                part = await origin.get("mp", etags["mp"], start, end, crc_kind="crc64nvme")
                assert part.crc is not None
                combined = part.crc if combined is None else integrity.combine(
                    "crc64nvme", combined, part.crc, end - start)
            assert combined is not None
            return combined

        assert trio.run(main) == stated.crc  # the blocks' CRCs combine to SeaweedFS's


# -- the test proxies themselves ----------------------------------------------------------------
def test_the_test_proxies_answer_head_with_the_objects_length(bucket, s3_endpoint) -> None:
    """A HEAD through either proxy said Content-Length: 0 (the length of the body it
    forwarded, which a HEAD never has): a test through them saw every object as empty."""
    put(bucket, "h.bin", b"x" * 12_345)
    with FaultProxy(s3_endpoint) as proxy:
        assert S3Store(bucket[1], endpoint_url=proxy.url).head("h.bin").size == 12_345
    with ForwardProxy() as fwd:
        import boto3
        import botocore.config

        client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1",
                              config=botocore.config.Config(proxies={"http": fwd.url}))
        assert client.head_object(Bucket=bucket[1], Key="h.bin")["ContentLength"] == 12_345
        assert fwd.seen and fwd.seen[-1][0] == "HEAD"


def test_a_range_past_the_end_of_the_object_is_a_changed_object_not_a_short_read(
        bucket, s3_endpoint) -> None:  # type: ignore[no-untyped-def]
    """A mount that shows an object longer than it is (a manifest's wrong size) asks for
    a range past its end: S3 answers 206 with what there is and states the object's size
    in Content-Range. That is ObjectChanged at once (asking again will not make the bytes),
    not a short body retried until the deadline."""
    from cachefs.errors import ObjectChanged

    etag = put(bucket, "w.bin", b"z" * 1000)
    store = S3Store(bucket[1], endpoint_url=s3_endpoint)
    with pytest.raises(ObjectChanged, match="is 1000 bytes, not at least 2000"):
        store.get("w.bin", etag, 500, 2000)

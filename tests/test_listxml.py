"""The lean ListObjectsV2 client and parser against moto's real answers, compared with boto3."""

from __future__ import annotations

from typing import Any

import pytest

from cachefs.errors import NoSuchBucket, StoreError
from cachefs.s3.boto import S3Store
from cachefs.s3.listxml import parse_list_page
from cachefs.s3.store import list_dir

ODD_KEYS = [
    "d/plain.jpg", "d/with space.jpg", "d/plus+sign.jpg", "d/percent%41.jpg", "d/amp&lt;<>.txt",
    "d/ünïcödé 名前.bin", "d/tab\there", "d/quote\"'.txt", "d/sub/inner.txt", "d/sub dir/x",
    "d/~tilde", "d/a=b?c#d", "top.txt",
]


@pytest.fixture
def odd_bucket(bucket: tuple[Any, str]) -> tuple[Any, str]:
    client, name = bucket
    for i, key in enumerate(ODD_KEYS):
        client.put_object(Bucket=name, Key=key, Body=b"x" * i)
    return client, name


def store_for(name: str, endpoint: str) -> S3Store:
    return S3Store(name, endpoint_url=endpoint, region="us-east-1")


def boto_listing(client: Any, name: str, prefix: str) -> tuple[list[tuple[str, int, str]], list[str]]:
    objs: list[tuple[str, int, str]] = []
    prefixes: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=name, Prefix=prefix,
                                                                  Delimiter="/"):
        objs += [(o["Key"], o["Size"], o["ETag"].strip('"')) for o in page.get("Contents", [])]
        prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
    return objs, prefixes


@pytest.mark.parametrize("prefix", ["", "d/", "d/sub/", "nothing/"])
def test_lean_listing_matches_boto3(odd_bucket: tuple[Any, str], s3_endpoint: str, prefix: str) -> None:
    client, name = odd_bucket
    store = store_for(name, s3_endpoint)
    objs: list[tuple[str, int, str]] = []
    prefixes: list[str] = []
    for page in list_dir(store, prefix):
        objs += [(o.key, o.size, o.etag) for o in page.objects]
        prefixes += page.prefixes
        assert all(o.mtime > 1e9 for o in page.objects)
    assert (objs, prefixes) == boto_listing(client, name, prefix)
    if prefix == "nothing/":
        assert objs == [] and prefixes == []


def test_paging_with_small_pages_and_start_after(odd_bucket: tuple[Any, str], s3_endpoint: str) -> None:
    client, name = odd_bucket
    rc = store_for(name, s3_endpoint)._ranges
    seen: list[str] = []
    token = None
    pages = 0
    while True:
        page = rc.list_page("d/", token, max_keys=3)
        pages += 1
        assert len(page.objects) + len(page.prefixes) <= 3
        seen += [o.key for o in page.objects] + page.prefixes
        token = page.next_token
        if not token:
            break
    objs, prefixes = boto_listing(client, name, "d/")
    assert sorted(seen) == sorted([k for k, _, _ in objs] + prefixes)
    assert pages >= 4
    after = rc.list_page("d/", None, start_after="d/sub dir/x")
    assert sorted([o.key for o in after.objects] + after.prefixes) == \
        sorted(k for k in [k for k, _, _ in objs] + ["d/sub/"] if k > "d/sub dir/x")
    whole = rc.list_page("", None, delimiter="")
    assert sorted(o.key for o in whole.objects) == sorted(ODD_KEYS)


def test_missing_bucket_and_garbage(s3_endpoint: str) -> None:
    with pytest.raises(NoSuchBucket):
        store_for("no-such-bucket-here", s3_endpoint).list_page("", None)
    with pytest.raises(StoreError, match="malformed listing"):
        parse_list_page(b"<ListBucketResult><Contents>")
    with pytest.raises(StoreError, match="unexpected listing answer"):
        parse_list_page(b"<Error><Code>X</Code></Error>")


def test_parser_without_namespace_and_entities() -> None:
    body = (b'<?xml version="1.0"?><ListBucketResult><IsTruncated>true</IsTruncated>'
            b"<NextContinuationToken>tok</NextContinuationToken>"
            b"<Contents><Key>a&amp;b</Key><Size>5</Size><ETag>&quot;e1&quot;</ETag>"
            b"<LastModified>2024-05-01T12:00:00.000Z</LastModified></Contents>"
            b"<CommonPrefixes><Prefix>p/</Prefix></CommonPrefixes></ListBucketResult>")
    page = parse_list_page(body)
    assert [(o.key, o.size, o.etag, o.mtime) for o in page.objects] == [("a&b", 5, "e1", 1714564800.0)]
    assert page.prefixes == ["p/"] and page.next_token == "tok"

"""S3 error answers -> the cachefs error hierarchy (the one mapping for every client).

Both S3 clients (boto3 for listings in :mod:`cachefs.s3.boto`, the lean GET
client in :mod:`cachefs.s3.ranges`) translate what S3 answered here, so a
status code or an S3 error code means the same everywhere.
"""

from __future__ import annotations

from cachefs.errors import (
    AccessDenied,
    CredentialsError,
    EndpointUnreachable,
    NoSuchBucket,
    NoSuchKey,
    ObjectChanged,
    StoreError,
    TransientStoreError,
)

NO_CREDENTIALS = ("no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a "
                  "profile, or an instance role; or use --no-sign-request for a public bucket)")


def error_for_response(status: int, code: str, bucket: str, key: str | None,
                       message: str = "") -> StoreError:
    """The cachefs error for an S3 error response (HTTP status and S3 error code).
    The one mapping for both clients (boto3 here, the lean GET client in ranges)."""
    where = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
    if code == "NoSuchBucket":
        return NoSuchBucket(f"bucket {bucket!r} does not exist")
    if code in ("NoSuchKey", "404", "NotFound") or (status == 404 and key):
        return NoSuchKey(f"{where} does not exist")
    if status == 404:
        return NoSuchBucket(f"bucket {bucket!r} does not exist")
    if code in ("PreconditionFailed", "412") or status == 412:
        return ObjectChanged(f"{where} changed since it was opened")
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                "InvalidToken", "TokenRefreshRequired"):
        return CredentialsError(f"the S3 endpoint rejected the credentials ({code})")
    if code in ("AccessDenied", "AllAccessDisabled") or status == 403:
        return AccessDenied(f"access denied to {where}")
    if code in ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                "TooManyRequests") or status in (429, 503):
        return TransientStoreError(f"{where}: throttled ({code or status})", throttled=True)
    if status >= 500 or code in ("InternalError", "ServiceUnavailable", "RequestTimeout"):
        return TransientStoreError(f"{where}: server error {status} {code}")
    return StoreError(f"{where}: {code or status}: {message or 'request failed'}")


def translate_botocore(exc: Exception, bucket: str, key: str | None) -> StoreError:
    """Map a botocore exception to the cachefs error hierarchy."""
    from botocore import exceptions as bex

    where = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, bex.NoCredentialsError):
        return CredentialsError(NO_CREDENTIALS)
    if isinstance(exc, (bex.EndpointConnectionError, bex.ConnectTimeoutError)):
        return EndpointUnreachable(f"cannot connect to the S3 endpoint: {exc}")
    if isinstance(exc, bex.ReadTimeoutError):
        return TransientStoreError(f"{where}: timed out: {exc}", reason="timeout")
    if isinstance(exc, (bex.IncompleteReadError, bex.ResponseStreamingError)):
        return TransientStoreError(f"{where}: answer cut short: {exc}", reason="short_body")
    if isinstance(exc, (bex.ConnectionClosedError, bex.HTTPClientError)):
        return TransientStoreError(f"{where}: connection problem: {exc}", reason="connection")
    if isinstance(exc, bex.ClientError):
        err = exc.response.get("Error", {})
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return error_for_response(status, str(err.get("Code", "")), bucket, key,
                                  str(err.get("Message", exc)))
    if isinstance(exc, bex.BotoCoreError):
        return StoreError(f"{where}: {exc}")
    if isinstance(exc, TimeoutError):
        return TransientStoreError(f"{where}: {exc}", reason="timeout")
    if isinstance(exc, ConnectionError):
        return TransientStoreError(f"{where}: {exc}", reason="connection")
    return StoreError(f"{where}: unexpected {type(exc).__name__}: {exc}")

"""Signed requests to S3 over kept-alive connections, for what pyarrow's S3 client does not do.

Requests are signed as botocore signs for S3 (``S3SigV4Auth``: the ``X-Amz-Content-SHA256``
header AWS requires, S3's own canonical path, which is encoded once and never normalized) and
sent over a pool of kept-alive connections (urllib3). Against AWS the bucket is addressed
virtual-hosted (``https://<bucket>.s3.<region>.amazonaws.com/<key>``; path style for bucket names
with dots, which the wildcard certificate does not cover); custom endpoints get path style. Used
for single-GET downloads (:mod:`ray_resilient.data.s3_get`) and conditional writes
(:mod:`ray_resilient.storage.conditional`).
"""

from __future__ import annotations

import threading
from urllib.parse import quote

import pyarrow.fs as pafs
import urllib3
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.session import get_session

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # timeouts, throttling (503 SlowDown), server errors


class S3RequestError(OSError):
    """An S3 request answered with an error status; ``retryable`` for throttling and server errors."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status
        self.retryable = status in RETRYABLE_STATUS


class S3Requests:
    """SigV4-signed requests to one S3 endpoint, over kept-alive connections.

    Args:
        endpoint: an S3-compatible endpoint (``http://host:port``); path-style addressing. None:
            AWS, virtual-hosted addressing.
        region: the bucket's region (signed into every request).
        access_key, secret_key, session_token: credentials; None: botocore's default chain
            (environment, config files, instance or container roles), resolved once per process;
            role credentials refresh themselves before they expire.
        max_connections: kept-alive connections (about the number of threads sending).
    """

    def __init__(self, endpoint: str | None, region: str, access_key: str | None = None,
                 secret_key: str | None = None, session_token: str | None = None, max_connections: int = 32):
        self.region = region
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        self._static = Credentials(access_key, secret_key, session_token) if access_key and secret_key else None
        self.max_connections = max_connections
        self._pool: urllib3.PoolManager | None = None
        self._chain: Credentials | None = None  # the default chain's, once resolved in this process
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_pool=None, _chain=None, _lock=None)  # per process: rebuilt on first use
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _credentials(self) -> Credentials:
        if self._static is not None:
            return self._static
        with self._lock:
            if self._chain is None:  # resolving the chain costs milliseconds: once, not per request
                self._chain = get_session().get_credentials()
                if self._chain is None:
                    raise S3RequestError("no AWS credentials found (arguments, environment, config files or roles)",
                                         403)
        return self._chain.get_frozen_credentials()

    def _connections(self) -> urllib3.PoolManager:
        with self._lock:
            if self._pool is None:
                self._pool = urllib3.PoolManager(maxsize=self.max_connections, retries=False,
                                                 timeout=urllib3.Timeout(connect=10, read=60))
            return self._pool

    def signed(self, method: str, bucket_and_key: str, headers: dict[str, str] | None = None,
               body: bytes = b"") -> tuple[str, dict[str, str]]:
        """The URL and the signed headers of ``method`` on ``bucket/key`` (the key unencoded)."""
        bucket, _, key = bucket_and_key.partition("/")
        path = quote(key, safe="/~")  # S3's UriEncode: every byte but unreserved characters and '/'
        if self.endpoint is None and "." not in bucket:
            url = f"https://{bucket}.s3.{self.region}.amazonaws.com/{path}"
        else:
            url = f"{self.endpoint or f'https://s3.{self.region}.amazonaws.com'}/{quote(bucket)}/{path}"
        request = AWSRequest(method=method, url=url, headers=headers or {}, data=body)
        S3SigV4Auth(self._credentials(), "s3", self.region).add_auth(request)
        return url, dict(request.headers.items())

    def send(self, method: str, bucket_and_key: str, headers: dict[str, str] | None = None, body: bytes = b"",
             preload_content: bool = True) -> urllib3.BaseHTTPResponse:
        """``method`` on ``bucket/key``, signed; the response, whatever its status (urllib3's errors
        for connection failures). With ``preload_content=False`` the caller releases the connection."""
        url, signed_headers = self.signed(method, bucket_and_key, headers, body)
        return self._connections().request(method, url, headers=signed_headers, body=body or None,
                                           preload_content=preload_content)


def s3_requests_for(filesystem: pafs.FileSystem) -> S3Requests | None:
    """Requests to the endpoint of a pyarrow ``S3FileSystem``, with its credentials (or, without
    them, botocore's default chain, which pyarrow's mirrors); None for any other filesystem, and for
    an anonymous one or one that assumes a role (its credentials are not botocore's)."""
    if not isinstance(filesystem, pafs.S3FileSystem):
        return None
    settings = filesystem.__reduce__()[1][0]  # the options it was created with
    if settings.get("anonymous") or settings.get("role_arn"):
        return None
    endpoint = settings.get("endpoint_override") or None
    if endpoint and "://" not in endpoint:
        endpoint = f"{settings.get('scheme') or 'https'}://{endpoint}"
    return S3Requests(endpoint, filesystem.region or "us-east-1", settings.get("access_key") or None,
                      settings.get("secret_key") or None, settings.get("session_token") or None, max_connections=2)

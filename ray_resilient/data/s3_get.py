"""Downloading an S3 object with one signed GET.

pyarrow's S3 client opens every object with a HEAD (for its size) before the GET. For a dataset
of small files (a JPEG of tens of KB) that doubles the requests, the round trips and the server's
work per sample, and the client's CPU per file (``benchmarks/data_throughput.py``). The volume
already knows every size from its listing, so a file is one GET here: signed as botocore signs
for S3 (``S3SigV4Auth``: the ``X-Amz-Content-SHA256`` header AWS requires, S3's own canonical
path, which is encoded once and never normalized), sent over a pool of kept-alive connections
(urllib3), streamed to disk. Against AWS the bucket is addressed virtual-hosted
(``https://<bucket>.s3.<region>.amazonaws.com/<key>``; path style for bucket names with dots,
which the wildcard certificate does not cover); custom endpoints get path style.
"""

from __future__ import annotations

import threading
from urllib.parse import quote

import urllib3
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.session import get_session

from ray_resilient.storage.local_copy import COPY_CHUNK_BYTES, copy_to_local, open_local_copy

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # timeouts, throttling (503 SlowDown), server errors


class S3RequestError(OSError):
    """An S3 GET answered with an error status; ``retryable`` for throttling and server errors."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status
        self.retryable = status in RETRYABLE_STATUS


class SignedGetReader:
    """One SigV4-signed GET per object, over kept-alive connections.

    Args:
        endpoint: an S3-compatible endpoint (``http://host:port``); path-style addressing. None:
            AWS, virtual-hosted addressing.
        region: the bucket's region (signed into every request).
        access_key, secret_key, session_token: credentials; None: botocore's default chain
            (environment, config files, instance or container roles), resolved once per process;
            role credentials refresh themselves before they expire.
        max_connections: kept-alive connections (about the number of threads downloading).
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

    def signed_get(self, bucket_and_key: str) -> tuple[str, dict[str, str]]:
        """The URL and the signed headers of the GET of ``bucket/key`` (the key unencoded)."""
        bucket, _, key = bucket_and_key.partition("/")
        path = quote(key, safe="/~")  # S3's UriEncode: every byte but unreserved characters and '/'
        if self.endpoint is None and "." not in bucket:
            url = f"https://{bucket}.s3.{self.region}.amazonaws.com/{path}"
        else:
            url = f"{self.endpoint or f'https://s3.{self.region}.amazonaws.com'}/{quote(bucket)}/{path}"
        request = AWSRequest(method="GET", url=url)
        S3SigV4Auth(self._credentials(), "s3", self.region).add_auth(request)
        return url, dict(request.headers.items())

    def download(self, bucket_and_key: str, dest: str) -> int:
        """GET ``bucket/key`` into the local file ``dest``; returns the bytes written.

        Raises S3RequestError for an error status, urllib3's errors for connection failures.
        """
        url, headers = self.signed_get(bucket_and_key)
        response = self._connections().request("GET", url, headers=headers, preload_content=False)
        try:
            if response.status != 200:
                detail = response.read(2000).decode(errors="replace")
                raise S3RequestError(f"GET {url} answered {response.status}: {detail}", response.status)
            with open_local_copy(dest) as out:
                return copy_to_local(response.stream(COPY_CHUNK_BYTES), out)
        finally:
            response.release_conn()

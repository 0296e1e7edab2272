"""Downloading an S3 object with one signed GET.

pyarrow's S3 client opens every object with a HEAD (for its size) before the GET. For a dataset
of small files (a JPEG of tens of KB) that doubles the requests, the round trips and the server's
work per sample, and the client's CPU per file (``benchmarks/data_throughput.py``). The volume
already knows every size from its listing, so a file is one GET here
(:class:`~ray_resilient.storage.s3_requests.S3Requests`: signed as botocore signs for S3, over
kept-alive connections), streamed to disk.
"""

from __future__ import annotations

from ray_resilient.storage.local_copy import COPY_CHUNK_BYTES, copy_to_local, open_local_copy
from ray_resilient.storage.s3_requests import S3RequestError, S3Requests


class SignedGetReader(S3Requests):
    """One SigV4-signed GET per object, over kept-alive connections (arguments as :class:`S3Requests`)."""

    def signed_get(self, bucket_and_key: str) -> tuple[str, dict[str, str]]:
        """The URL and the signed headers of the GET of ``bucket/key`` (the key unencoded)."""
        return self.signed("GET", bucket_and_key)

    def download(self, bucket_and_key: str, dest: str) -> int:
        """GET ``bucket/key`` into the local file ``dest``; returns the bytes written.

        Raises S3RequestError for an error status, urllib3's errors for connection failures.
        """
        response = self.send("GET", bucket_and_key, preload_content=False)
        try:
            if response.status != 200:
                detail = response.read(2000).decode(errors="replace")
                raise S3RequestError(f"GET s3://{bucket_and_key} answered {response.status}: {detail}", response.status)
            with open_local_copy(dest) as out:
                return copy_to_local(response.stream(COPY_CHUNK_BYTES), out)
        finally:
            response.release_conn()

"""A small file on S3 that is written only if it is still the version its writer read.

S3 conditional writes (AWS since 2024, SeaweedFS, MinIO): a PUT with ``If-None-Match: *``
creates the object only if there is none, one with ``If-Match: <ETag>`` replaces only that
version; otherwise the store answers 412 and nothing is written. Two writers that read the same
version cannot both replace it, however close in time they write: what the run lease
(:mod:`ray_resilient.checkpoint.lease`) needs where storage offers it.
"""

from __future__ import annotations

import pyarrow.fs as pafs
import urllib3

from ray_resilient.storage.s3_requests import S3RequestError, S3Requests, s3_requests_for


class ChangedSinceRead(Exception):
    """The file is no longer the version the write expected (created, replaced or removed meanwhile)."""


class ConditionalFile:
    """The object ``bucket/key`` (``path``) read with its version (its ETag) and written conditionally."""

    def __init__(self, requests: S3Requests, path: str):
        self._requests, self.path = requests, path

    def read(self) -> tuple[bytes, str] | None:
        """Its content and version; None when there is none."""
        response = self._send("GET")
        if response.status == 404:
            return None
        self._check(response, "GET")
        return response.data, response.headers["ETag"]

    def write(self, data: bytes, version: str | None) -> None:
        """Write ``data`` if the file is still ``version`` (None: if there is none); else raise
        :class:`ChangedSinceRead`."""
        condition = {"If-None-Match": "*"} if version is None else {"If-Match": version}
        response = self._send("PUT", headers=condition, body=data)
        # 412: another version is there. 409: a write to the key raced this one (S3 answers either).
        # 404: If-Match on a file removed meanwhile.
        if response.status in (412, 409) or response.status == 404 and version is not None:
            raise ChangedSinceRead(f"{self.path} changed since it was read (PUT answered {response.status})")
        self._check(response, "PUT")

    def _send(self, method: str, **request) -> urllib3.BaseHTTPResponse:
        try:
            return self._requests.send(method, self.path, **request)
        except urllib3.exceptions.HTTPError as err:  # not an OSError: callers handle storage errors as OSError
            raise S3RequestError(f"{method} s3://{self.path} failed: {err}", 0) from err

    def _check(self, response: urllib3.BaseHTTPResponse, method: str) -> None:
        if response.status != 200:
            detail = response.data[:2000].decode(errors="replace")
            raise S3RequestError(f"{method} s3://{self.path} answered {response.status}: {detail}", response.status)


def conditional_file(filesystem: pafs.FileSystem, path: str) -> ConditionalFile | None:
    """``path`` on ``filesystem`` as a :class:`ConditionalFile`; None where it cannot be one (a
    filesystem other than pyarrow's S3, see :func:`~ray_resilient.storage.s3_requests.s3_requests_for`)."""
    requests = s3_requests_for(filesystem)
    return ConditionalFile(requests, path) if requests is not None else None

"""Create a small file on S3 only if there is none: a PUT with ``If-None-Match: *``.

S3 conditional writes (AWS since 2024, SeaweedFS, MinIO): the store creates the object only if
no object has the key, otherwise it answers 412 and writes nothing, so of two writers creating
one key however close in time, exactly one succeeds: what the run lease's generations
(:mod:`ray_resilient.checkpoint.lease`) need where storage offers it. A store or gateway that
does not implement the condition either ignores it (:meth:`ExclusiveCreate.enforced` finds out) or
rejects the request with 400 or 501 (:class:`ConditionsRejected`); either way the caller falls back.
"""

from __future__ import annotations

import uuid

import pyarrow.fs as pafs
import urllib3

from ray_resilient.storage.s3_requests import S3RequestError, S3Requests, s3_requests_for

REJECTED_STATUS = frozenset({400, 501})  # a store that does not implement the condition refuses the PUT


class AlreadyExists(Exception):
    """The file existed (or was created by another writer at the same moment): nothing was written."""


class ConditionsRejected(S3RequestError):
    """The store refused a conditional PUT (400 or 501): it does not implement ``If-None-Match``."""


class ExclusiveCreate:
    """Creates S3 objects only where there are none, with one endpoint's signed requests."""

    def __init__(self, requests: S3Requests):
        self._requests = requests

    def create(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``bucket/key`` (``path``) if no object has that key; else raise
        :class:`AlreadyExists`. :class:`ConditionsRejected` when the store refuses the condition."""
        try:
            response = self._requests.send("PUT", path, headers={"If-None-Match": "*"}, body=data)
        except urllib3.exceptions.HTTPError as err:  # not an OSError: callers handle storage errors as OSError
            raise S3RequestError(f"PUT s3://{path} failed: {err}", 0) from err
        # 412: an object is there. 409: a write to the key raced this one (S3 answers either).
        if response.status in (412, 409):
            raise AlreadyExists(f"{path} exists (PUT answered {response.status})")
        if response.status != 200:
            detail = response.data[:2000].decode(errors="replace")
            error = ConditionsRejected if response.status in REJECTED_STATUS else S3RequestError
            raise error(f"PUT s3://{path} with If-None-Match answered {response.status}: {detail}", response.status)


    def enforced(self, directory: str) -> bool:
        """Whether the store enforces the condition (some ignore it): a probe object under
        ``directory`` is created twice, then deleted. :class:`ConditionsRejected` when refused."""
        probe = f"{directory}/.probe-{uuid.uuid4().hex}"
        try:
            self.create(probe, b"")
            try:
                self.create(probe, b"")
            except AlreadyExists:
                return True
            return False
        finally:
            self._requests.send("DELETE", probe)


def exclusive_create_for(filesystem: pafs.FileSystem) -> ExclusiveCreate | None:
    """Exclusive creation on ``filesystem``; None where it cannot be offered (a filesystem other
    than pyarrow's S3, see :func:`~ray_resilient.storage.s3_requests.s3_requests_for`)."""
    requests = s3_requests_for(filesystem)
    return ExclusiveCreate(requests) if requests is not None else None

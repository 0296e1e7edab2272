"""A path or URI to a pyarrow filesystem: local paths, ``s3://`` (with its settings from the
environment), ``gs://`` and other pyarrow schemes, and fsspec URLs."""

from __future__ import annotations

import os
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs


def s3_settings(
    endpoint: str | None = None,
    region: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
    session_token: str | None = None,
) -> tuple[str | None, str, str | None, str | None, str | None]:
    """(endpoint URL, region, access key, secret key, session token) of an ``s3://`` volume.

    Each from the arguments, else the environment; the session token of temporary credentials
    comes from ``AWS_SESSION_TOKEN`` only with keys from the environment too.
    """
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "://" not in endpoint:
        endpoint = f"https://{endpoint}"
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    if access_key is None:
        access_key, secret_key = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
        session_token = session_token or os.environ.get("AWS_SESSION_TOKEN")
    return endpoint, region, access_key, secret_key, session_token


def open_filesystem(
    uri: str,
    *,
    endpoint: str | None = None,
    region: str | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
    session_token: str | None = None,
) -> tuple[pafs.FileSystem, str]:
    """(filesystem, root path on it) for ``uri``.

    For ``s3://`` the endpoint, region and credentials come from the arguments, else from
    ``AWS_ENDPOINT_URL``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY`` and ``AWS_SESSION_TOKEN`` (without keys: the AWS default chain).
    Schemes pyarrow does not know go through fsspec.
    """
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        endpoint, region, access_key, secret_key, session_token = s3_settings(
            endpoint, region, access_key, secret_key, session_token)
        options: dict = {"region": region, "access_key": access_key, "secret_key": secret_key,
                         "session_token": session_token}
        if endpoint:
            endpoint_url = urlparse(endpoint)
            options.update(endpoint_override=endpoint_url.netloc, scheme=endpoint_url.scheme)
        return pafs.S3FileSystem(**options), f"{parsed.netloc}{parsed.path}".rstrip("/")
    if parsed.scheme in ("", "file"):
        return pafs.LocalFileSystem(), os.path.abspath(parsed.path if parsed.scheme else uri)
    try:
        return pafs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, ValueError):
        import fsspec

        fs, path = fsspec.core.url_to_fs(uri)
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path

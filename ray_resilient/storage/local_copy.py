"""A local copy of remote bytes, whose local write errors are told apart from the read's.

A failed read of remote storage may be retried; a failed local write (a full disk, a quota, a
read-only directory) may not: retrying the read cannot help. Both the volume's file cache and the
checkpoints' node copies write through these.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import BinaryIO

COPY_CHUNK_BYTES = 1 << 20  # what a stream is read in


class LocalWriteError(OSError):
    """Writing the local copy failed (its ``__cause__`` says why): retrying the read cannot help."""


@contextlib.contextmanager
def open_local_copy(dest: str) -> Iterator[BinaryIO]:
    """``dest`` opened for writing; an OSError opening or closing (flushing) it becomes a
    :class:`LocalWriteError`."""
    try:
        out = open(dest, "wb")
    except OSError as err:
        raise LocalWriteError(str(err)) from err
    try:
        yield out
    finally:
        try:
            out.close()
        except OSError as err:
            raise LocalWriteError(str(err)) from err


def copy_to_local(chunks: Iterable[bytes] | BinaryIO, out: BinaryIO) -> int:
    """Write ``chunks`` (an iterable of bytes, or a readable stream) to ``out``; returns the bytes
    written. Read errors propagate as they are; write errors become :class:`LocalWriteError`."""
    if hasattr(chunks, "read"):
        stream = chunks
        chunks = iter(lambda: stream.read(COPY_CHUNK_BYTES), b"")
    written = 0
    for chunk in chunks:
        try:
            written += out.write(chunk)
        except OSError as err:
            raise LocalWriteError(str(err)) from err
    return written

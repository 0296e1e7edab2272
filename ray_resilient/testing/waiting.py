"""Polling until something is ready, with a deadline and an error that names what never came."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from pathlib import Path


def wait_until(condition: Callable[[], bool], timeout: float, what: str, *, poll_s: float = 0.1) -> None:
    """Poll ``condition`` until it is true; raise TimeoutError naming ``what`` after ``timeout`` seconds.

    ``condition`` may raise to give up early (e.g. when the process that should answer exited).
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll_s)


def http_ok(url: str, bearer_token_file: str | None = None) -> bool:
    """Whether ``url`` answers 200 (with the token in ``bearer_token_file``, ``~`` expanded, if given)."""
    request = urllib.request.Request(url)
    try:
        if bearer_token_file:
            token = Path(bearer_token_file).expanduser().read_text().strip()
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False

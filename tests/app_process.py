"""Helpers for tests that serve the app: a free loopback port, and waiting for an app process to serve its page."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_served(proc: subprocess.Popen, port: int, seconds: float, what: str) -> None:
    """Return once http://127.0.0.1:port/ answers 200; fail if `proc` exits first or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{what} exited early:\n{proc.stdout.read() if proc.stdout else ''}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    pytest.fail(f"{what} did not serve within {seconds:.0f} s")

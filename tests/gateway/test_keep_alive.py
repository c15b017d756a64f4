"""The gateway keeps an idle HTTP keep-alive connection longer than clients
pause between requests (server.keep_alive_s, 75 s): with uvicorn's default
of 5 s, a client reusing a pooled connection after a 5 s pause raced the
server's close and got a connection reset (seen by `tessera bench fleet`,
whose conversations pause 5 s between turns)."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

PAUSE_S = 6.0  # past uvicorn's default keep-alive, far below the gateway's


def _get(sock: socket.socket, host: str) -> bytes:
    sock.sendall(f"GET /health/live HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(4096)
        if not chunk:
            return data  # the server closed the connection
        data += chunk
    return data


def test_an_idle_connection_outlives_a_client_pause(platform):
    url = urlparse(platform.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        assert _get(sock, url.netloc).startswith(b"HTTP/1.1 200")
        time.sleep(PAUSE_S)
        assert _get(sock, url.netloc).startswith(b"HTTP/1.1 200"), "the gateway closed the idle connection"

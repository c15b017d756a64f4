"""The gateway's listen ports, checked before `tessera up` starts anything.

A port another process holds would make the gateway exit at start, again
after every restart; checked here, the user gets one line that names the
port and, where /proc tells, the process holding it.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column


def check_ports(host: str, ports: dict[str, int]) -> None:
    """Raise ValueError (one line) unless every port (by the flag that sets it,
    0: a free port is picked later) can be listened on at `host`."""
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if not port:
            continue
        if port in seen:
            raise ValueError(f"{flag} {port}: the same port as {seen[port]}; each needs its own")
        seen[port] = flag
        problem = cannot_listen(host, port)
        if problem is not None:
            raise ValueError(f"{flag} {port}: cannot listen on {host}:{port}: {problem}; pass another {flag}")


def cannot_listen(host: str, port: int) -> str | None:
    """Why nothing could listen on host:port now, or None if it could."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        return f"not an address of this machine ({e.strerror})"
    with socket.socket(family, kind, proto) as s:
        # As the servers do: a port whose last connections linger in TIME_WAIT is free to them.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"address already in use ({holder(port)})"
            return (e.strerror or str(e)).lower()
    return None


def holder(port: int) -> str:
    """Who listens on `port` (any address), as far as /proc shows this user."""
    inodes = _listening_inodes(port)
    if inodes:
        for pid_dir in Path("/proc").iterdir():
            if pid_dir.name.isdigit() and _holds_socket(pid_dir, inodes):
                return f"held by pid {pid_dir.name}: {_command_line(pid_dir)}"
    return "held by a process this user cannot see"


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def _holds_socket(pid_dir: Path, inodes: set[str]) -> bool:
    try:
        fds = os.listdir(pid_dir / "fd")
    except OSError:  # another user's process, or gone
        return False
    for fd in fds:
        try:
            target = os.readlink(pid_dir / "fd" / fd)
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


def _command_line(pid_dir: Path, limit: int = 80) -> str:
    try:
        line = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
    return line if len(line) <= limit else line[: limit - 3] + "..."

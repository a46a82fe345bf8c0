"""Stands in for `capyctl daemon` when a test checks units/capyctl.service itself.

It does what the unit promises the real daemon: takes the sockets systemd passes
(LISTEN_FDS/LISTEN_FDNAMES), tells systemd READY=1 (Type=notify), and on each
connection to a socket answers with that socket's name and the full name list.
"""

from __future__ import annotations

import os
import socket
import sys

SD_LISTEN_FDS_START = 3


def notify(message: str) -> None:
    path = os.environ["NOTIFY_SOCKET"]
    if path.startswith("@"):
        path = "\0" + path[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(message.encode(), path)


def main() -> None:
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        sys.exit("not socket-activated")
    count = int(os.environ["LISTEN_FDS"])
    names = os.environ.get("LISTEN_FDNAMES", "").split(":")
    listeners = {}
    for index, name in enumerate(names[:count]):
        fd = SD_LISTEN_FDS_START + index
        listeners[fd] = (name, socket.socket(fileno=fd))
    print(f"listening on {sorted(n for n, _ in listeners.values())}", flush=True)
    notify("READY=1")
    import selectors
    selector = selectors.DefaultSelector()
    for fd, (name, sock) in listeners.items():
        selector.register(sock, selectors.EVENT_READ, name)
    while True:
        for key, _ in selector.select():
            conn, _ = key.fileobj.accept()
            with conn:
                conn.sendall(f"{key.data} {':'.join(names)}\n".encode())


if __name__ == "__main__":
    main()

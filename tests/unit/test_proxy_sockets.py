"""Socket activation as systemd does it: LISTEN_* variables and fds from 3, in a child process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import urllib.request

import pytest

from capyctl.errors import CapyError
from capyctl.proxy import listen_sockets_from_systemd, serve, build_app

# The child puts the two inherited sockets on fds 3 and 4, sets the variables the way
# systemd does for its own PID, then serves /health on the socket named "openai".
CHILD = textwrap.dedent("""
    import asyncio, os, sys
    from capyctl.proxy import build_app, listen_sockets_from_systemd, serve
    a, b = int(sys.argv[1]), int(sys.argv[2])
    tmp_a, tmp_b = os.dup(a), os.dup(b)
    os.dup2(tmp_a, 3); os.dup2(tmp_b, 4)
    os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="2", LISTEN_FDNAMES="openai:api")
    sockets = listen_sockets_from_systemd()
    assert "LISTEN_FDS" not in os.environ
    print(",".join(f"{name}={sock.fileno()}" for name, sock in sorted(sockets.items())), flush=True)

    class NoModels:
        def models(self): return []
        def acquire(self, model): raise NotImplementedError
        def stats(self): return {}

    async def main():
        runner = await serve(build_app(NoModels(), None), sock=sockets["openai"])
        # The parent closes stdin when it is done; read it off the event loop's thread.
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await runner.cleanup()
    asyncio.run(main())
""")


def test_serves_on_the_socket_systemd_passed() -> None:
    with socket.create_server(("127.0.0.1", 0)) as openai_sock, socket.create_server(("127.0.0.1", 0)) as api_sock:
        port = openai_sock.getsockname()[1]
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(openai_sock.fileno()), str(api_sock.fileno())],
            pass_fds=(openai_sock.fileno(), api_sock.fileno()), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        try:
            assert child.stdout.readline().strip() == "api=4,openai=3"
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=15) as response:
                assert response.status == 200
        finally:
            child.stdin.close()
            assert child.wait(timeout=15) == 0


def test_variables_for_another_process_are_ignored() -> None:
    env = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1"}
    assert listen_sockets_from_systemd(env=env) == {}
    assert listen_sockets_from_systemd(env={}) == {}


def test_malformed_variables_raise() -> None:
    with pytest.raises(CapyError) as caught:
        listen_sockets_from_systemd(env={"LISTEN_PID": "abc", "LISTEN_FDS": "1"})
    assert caught.value.code == "bad_socket_activation"


async def test_serve_needs_exactly_one_place_to_listen() -> None:
    app = build_app(None, None)  # type: ignore[arg-type]  # never reached: serve refuses first
    with pytest.raises(CapyError):
        await serve(app)
    with pytest.raises(CapyError):
        await serve(app, host_port="no-port")

"""``capyctl ui``: the dashboard in a browser, through a loopback port forwarded to the management socket.

Whoever may open the socket is admin there without a credential, so the forward must not hand
that to every process and web page on the machine. It makes a session secret (256 random bits)
and prints ``http://127.0.0.1:PORT/ui/#session=SECRET``: the fragment never leaves the browser,
the page keeps it in sessionStorage and sends it as ``Authorization: Bearer``. The forward

* passes the dashboard's static files and /openapi.json without a credential (no data in them);
* replaces the session secret by nothing (the socket makes the request admin), and passes any
  other bearer (the admin token, the operator key) for the daemon to judge;
* refuses a request with no credential (401 ``ui_session_required``), a ``Host`` other than its
  own loopback address (403 ``host_not_allowed``: DNS rebinding) and an ``Origin`` other than its
  own (403 ``origin_not_allowed``: another site's page).

It listens on 127.0.0.1 only and stops with Ctrl-C.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import signal
import sys
import webbrowser

SESSION_PREFIX = "capyui-"
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-authorization",
               "proxy-connection", "trailer", "content-length", "host"}


def _public(path: str) -> bool:
    return path == "/ui" or path.startswith("/ui/") or path == "/openapi.json"


def build_forwarder(api_socket: str, session: str, port_holder: list[int]):
    """The aiohttp application that forwards to ``api_socket``; ``port_holder[0]`` is its port once bound."""
    import aiohttp
    from aiohttp import web

    http_key = web.AppKey("http", aiohttp.ClientSession)

    def refuse(status: int, code: str, message: str) -> web.Response:
        return web.json_response({"error": {"code": code, "message": message}}, status=status)

    async def forward(request: web.Request) -> web.StreamResponse:
        port = port_holder[0]
        if request.host not in (f"127.0.0.1:{port}", f"localhost:{port}"):
            return refuse(403, "host_not_allowed", f"this forward answers only http://127.0.0.1:{port}")
        origin = request.headers.get("Origin")
        if origin is not None and origin not in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
            return refuse(403, "origin_not_allowed", f"requests from {origin} are not accepted")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        auth = request.headers.get("Authorization", "")
        scheme, _, presented = auth.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), session.encode()):
            headers.pop("Authorization", None)  # the socket itself makes this request admin
        elif not auth and not _public(request.path):
            return refuse(401, "ui_session_required",
                          "open the URL capyctl ui printed (it carries the session), or send the admin token")
        body = await request.read() if request.can_read_body else None
        session_http = request.app[http_key]
        async with session_http.request(request.method, f"http://capyctl{request.rel_url}", headers=headers,
                                        data=body, allow_redirects=False) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():  # event streams and logs -f as they come
                await response.write(chunk)
            await response.write_eof()
            return response

    async def client(app: web.Application):
        connector = aiohttp.UnixConnector(path=api_socket)
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                         timeout=aiohttp.ClientTimeout(total=None)) as http:
            app[http_key] = http
            yield

    app = web.Application(client_max_size=4 << 20)
    app.cleanup_ctx.append(client)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


async def _serve(api_socket: str, port: int, open_browser: bool) -> None:
    from aiohttp import web
    session = SESSION_PREFIX + secrets.token_urlsafe(32)
    holder = [port]
    runner = web.AppRunner(build_forwarder(api_socket, session, holder), access_log=None,
                           handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    holder[0] = runner.addresses[0][1]
    url = f"http://127.0.0.1:{holder[0]}/ui/#session={session}"
    print(f"CapyCTL dashboard: {url}", flush=True)
    print("(anyone with this URL is admin while this runs; Ctrl-C stops it)", file=sys.stderr, flush=True)
    if open_browser:
        webbrowser.open(url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def run(api_socket: str, port: int, open_browser: bool) -> int:
    import os
    if not os.path.exists(api_socket):
        from ..errors import CapyError
        raise CapyError(f"no management socket at {api_socket}; is CapyCTL running?", code="daemon_unreachable")
    asyncio.run(_serve(api_socket, port, open_browser))
    return 0

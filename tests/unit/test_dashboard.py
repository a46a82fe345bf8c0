"""The dashboard's server side: its static files and their headers, the event stream, request rates
from the proxy's Prometheus text, and the ``capyctl ui`` forward's refusals. The page itself is
tested in chromium (tests/integration/test_dashboard_browser.py)."""

from __future__ import annotations

import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from capyctl.api import Credentials, build_api
from capyctl.api._dashboard import request_totals
from capyctl.cli._ui import build_forwarder
from capyctl.config import DaemonConfig, Paths
from capyctl.controller import Controller
from capyctl.store import Store

EXPOSITION = b"""# HELP capyctl_requests_total Requests answered by the proxy.
# TYPE capyctl_requests_total counter
capyctl_requests_total{deployment="a",route="/v1/chat/completions",status="200"} 3.0
capyctl_requests_total{deployment="a",route="/v1/embeddings",status="404"} 1.0
capyctl_requests_total{deployment="",route="unmatched",status="404"} 7.0
capyctl_requests_total_created{deployment="a",route="/v1/embeddings",status="404"} 1.7e9
capyctl_request_duration_seconds_sum{deployment="a",route="/v1/chat/completions"} 1.5
capyctl_request_duration_seconds_count{deployment="a",route="/v1/chat/completions"} 3.0
capyctl_request_duration_seconds_bucket{deployment="a",route="/v1/chat/completions",le="+Inf"} 3.0
"""


class NoSystemd:
    def __getattr__(self, name: str):
        raise AssertionError(f"systemd.{name} was used")


@pytest.fixture
async def parts(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    store = Store(state / "state.db")
    controller = Controller(DaemonConfig(paths=Paths(state_dir=state, runtime_dir=tmp_path / "run")), store,
                            NoSystemd())
    credentials = Credentials(state / "credentials")
    yield controller, store, credentials
    await controller.close()
    store.close()


def test_request_totals_sum_routes_per_deployment_and_skip_requests_without_one():
    assert request_totals(EXPOSITION) == {"a": [4.0, 1.5, 3.0]}


async def test_static_files_need_no_credential_and_carry_a_strict_policy(parts):
    controller, store, credentials = parts
    async with TestClient(TestServer(build_api(controller, store, credentials))) as client:
        page = await client.get("/ui/")
        assert page.status == 200 and page.content_type == "text/html"
        assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
        assert "script-src 'self'" in page.headers["Content-Security-Policy"]
        assert (await client.get("/ui/dashboard.js")).content_type == "text/javascript"
        redirect = await client.get("/ui", allow_redirects=False)
        assert redirect.status == 302 and redirect.headers["Location"] == "/ui/"
        missing = await client.get("/ui/secrets.txt")
        assert missing.status == 404 and (await missing.json())["error"]["code"] == "ui_file_not_found"
        # The data is not public: the event stream needs a credential over TCP.
        refused = await client.get("/v1/events")
        assert refused.status == 401


async def test_the_event_stream_sends_deployments_usage_and_request_rates(parts):
    controller, store, _ = parts
    app = build_api(controller, store, metrics_text=lambda: EXPOSITION)
    async with TestClient(TestServer(app)) as client:
        response = await client.get("/v1/events")
        assert response.status == 200 and response.content_type == "text/event-stream"
        seen: dict[str, object] = {}
        event = None
        while len(seen) < 3:
            line = (await response.content.readline()).decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                seen[event] = json.loads(line[len("data: "):])
        assert seen["deployments"] == []
        assert set(seen["usage"]) >= {"measured_at", "hosts", "deployments"}
        assert seen["requests"]["deployments"]["a"]["requests"] == 4.0
        response.close()


async def test_the_ui_forward_refuses_requests_without_its_session_or_from_elsewhere(parts, tmp_path):
    controller, store, credentials = parts
    api_runner = web.AppRunner(build_api(controller, store, credentials))
    await api_runner.setup()
    socket_path = str(tmp_path / "api.sock")
    await web.UnixSite(api_runner, socket_path).start()
    holder = [0]
    server = TestServer(build_forwarder(socket_path, "capyui-secret", holder), host="127.0.0.1")
    try:
        async with TestClient(server) as client:
            holder[0] = server.port
            own = {"Host": f"127.0.0.1:{server.port}"}
            assert (await client.get("/ui/", headers=own)).status == 200
            anonymous = await client.get("/v1/deployments", headers=own)
            assert anonymous.status == 401
            assert (await anonymous.json())["error"]["code"] == "ui_session_required"
            session = {**own, "Authorization": "Bearer capyui-secret"}
            allowed = await client.get("/v1/whoami", headers=session)
            assert allowed.status == 200 and (await allowed.json()) == {"role": "admin"}
            # Any other bearer goes to the daemon, which judges it.
            wrong = await client.get("/v1/whoami", headers={**own, "Authorization": "Bearer capyui-guess"})
            assert wrong.status == 401 and (await wrong.json())["error"]["code"] == "invalid_credential"
            rebound = await client.get("/v1/whoami", headers={**session, "Host": f"evil.example:{server.port}"})
            assert rebound.status == 403 and (await rebound.json())["error"]["code"] == "host_not_allowed"
            foreign = await client.post("/v1/deployments/x/park", headers={**session, "Origin": "https://evil.example"})
            assert foreign.status == 403 and (await foreign.json())["error"]["code"] == "origin_not_allowed"
    finally:
        await api_runner.cleanup()

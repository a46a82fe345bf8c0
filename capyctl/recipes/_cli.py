"""``capyctl recipe run|compare|check``: the recipe commands of the capyctl CLI."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..spec import ManifestError
from ._compare import compare, load_report, render_markdown as render_comparison, write_comparison
from ._points import append_rows, check_table
from ._recipe import load_recipe
from ._render import write_report
from ._runner import RunOptions, run_recipe
from ._steps import RecipeRunError, StepLog

EXIT_FAILED, EXIT_INVALID, EXIT_UNAVAILABLE = 1, 2, 3

RUN_DESCRIPTION = """\
Run a recipe through CapyCTL, from 'capyctl engine add' to a first answer and a benchmark:

  1. read the machine (CPU, cores, RAM; GPUs, driver and CUDA from NVML when present) and stop
     cleanly (exit 3) if it lacks the recipe's hardware;
  2. find the engine (--engine, the recipe's path, or its find command, which may build it once)
     and register it as recipe-<kind>; find the model and check its sha256 (or use its Hub commit);
  3. deploy it with --activate --wait (the cold ready time), ask it once (the first answer),
     read its memory (the unit's cgroup now and at its peak, the ledger's reservation);
  4. run capyctl bench (time to first token, decode and prompt tokens/s by prompt length and
     streams, wake against cold start, /v1/systemone latency and accuracy, or embeddings);
  5. park and wake it in each of the recipe's park tiers;
  6. with direct (the recipe's, or --direct), stop it and launch the engine with the unit's own
     command line on a loopback port, and measure that the same way into OUT/direct.

Every command and its time go into OUT/report.json and OUT/report.md (with PNG charts), and
every measured point is appended to the results table (--results, CSV; columns in
docs/recipes.md). The deployment, the API key it made and the direct engine are removed at the
end (--keep leaves the deployment). Needs a running CapyCTL on this machine.

Exit status: 0 done; 1 the run failed; 2 the recipe is invalid; 3 this machine cannot run it."""

COMPARE_DESCRIPTION = """\
Put recipe reports side by side: the same model and machine on two engines, on two versions of
one engine, or through CapyCTL against the engine launched directly (a run's OUT and
OUT/direct). The first report is the baseline; every point the reports share is shown with
each report's figure and its ratio to the baseline. What the reports differ in is stated
first. Writes compare.json, compare.md and compare.png into --out."""


def add_recipe_parser(subparsers: Any, formatter: type[argparse.HelpFormatter]) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("recipe", help="run measured recipes and compare their reports",
                                   description="Recipes (recipes/*.yaml) are deployment files with what their "
                                   "measurement needs; see docs/recipes.md.", formatter_class=formatter)
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    p = sub.add_parser("run", help="run a recipe and write its report", description=RUN_DESCRIPTION,
                       formatter_class=formatter)
    p.add_argument("file", metavar="FILE", help="the recipe (YAML)")
    p.add_argument("--out", metavar="DIR", help="report folder (default: capyctl-recipes/<recipe name>)")
    p.add_argument("--results", metavar="CSV", help="results table to append to (default: "
                   "capyctl-recipes/results.csv; 'none' appends nowhere)")
    p.add_argument("--quick", action="store_true", help="the recipe's quick settings: fewer, shorter runs")
    p.add_argument("--engine", metavar="PATH", help="the engine to use instead of finding or building it")
    p.add_argument("--direct", action=argparse.BooleanOptionalAction, default=None,
                   help="also measure the engine launched directly (default: as the recipe says)")
    p.add_argument("--keep", action="store_true", help="leave the deployment deployed afterwards")
    p.add_argument("--root", metavar="DIR", help="where the recipe's find and prepare commands run "
                   "(default: the folder above the recipe's folder, the repository for recipes/)")
    p.add_argument("--base-url", default=os.environ.get("CAPYCTL_BASE_URL", "http://127.0.0.1:8000"),
                   help="CapyCTL's OpenAI endpoint (default $CAPYCTL_BASE_URL or http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=os.environ.get("CAPYCTL_API_KEY"),
                   help="an API key (default $CAPYCTL_API_KEY; else one is made for the run and revoked)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one capyctl command or request may take "
                   "(a find command that builds the engine gets 4 hours, a prepare command 1 hour)")
    p.add_argument("--json", action="store_true", help="print the report paths and figures as JSON")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("compare", help="reports side by side, with ratios and the method",
                       description=COMPARE_DESCRIPTION, formatter_class=formatter)
    p.add_argument("reports", nargs="+", metavar="REPORT", help="report folders or report.json files, "
                   "the baseline first")
    p.add_argument("--out", metavar="DIR", default="capyctl-recipes/comparison", help="where compare.* go")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("check", help="validate recipes without running them",
                       description="Validate recipe files; each problem is printed as FILE:LINE: FIELD: "
                       "message. Exit status 2 if any is invalid.", formatter_class=formatter)
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_check)
    return parser


def cmd_check(args: argparse.Namespace) -> int:
    results, bad = [], 0
    for file in args.files:
        try:
            recipe = load_recipe(file)
            results.append({"file": file, "ok": True, "name": recipe.name, "status": recipe.status})
        except ManifestError as exc:
            bad += 1
            results.append({"file": file, "ok": False, **exc.to_dict()})
            if not args.json:
                print(exc, file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            if r["ok"]:
                print(f"{r['file']}: ok ({r['name']}, {r['status'].replace('_', ' ')})")
    return EXIT_INVALID if bad else 0


def cmd_run(args: argparse.Namespace) -> int:
    try:
        recipe = load_recipe(args.file)
    except ManifestError as exc:
        print(exc, file=sys.stderr)
        return EXIT_INVALID
    recipe_file = Path(args.file).resolve()
    out = Path(args.out or f"capyctl-recipes/{recipe.name}")
    results = None if args.results == "none" else Path(args.results or "capyctl-recipes/results.csv")
    options = RunOptions(out=out, results=results, root=Path(args.root) if args.root else recipe_file.parent.parent,
                         quick=args.quick, engine_path=args.engine, base_url=args.base_url, api_key=args.api_key,
                         api_socket=getattr(args, "api_socket", None), direct=args.direct, keep=args.keep,
                         timeout=args.timeout)
    if results is not None:
        try:
            check_table(results)  # before an hour of measuring, not after
        except ValueError as exc:
            print(f"capyctl recipe: {exc}", file=sys.stderr)
            return EXIT_INVALID
    log = StepLog()
    try:
        reports = run_recipe(recipe, recipe_file, options, log)
    except RecipeRunError as exc:
        print(f"capyctl recipe: {'cannot run here' if exc.unavailable else 'failed'}: {exc}", file=sys.stderr)
        if args.json:
            print(json.dumps({"ok": False, "code": exc.code, "message": exc.message,
                              "unavailable": exc.unavailable}))
        return EXIT_UNAVAILABLE if exc.unavailable else EXIT_FAILED
    written, rows = [], 0
    for report in reports:
        folder = out if report["via"] == "capyctl" else out / "direct"
        written += write_report(report, folder)
        if results is not None:
            rows += append_rows(report, results)
    if not any(str(p).endswith(".png") for p in written):
        log.say("no charts: matplotlib is not installed (pip install 'capyctl[charts]')")
    log.say(f"wrote {', '.join(str(p) for p in written)}"
            + (f"; {rows} points appended to {results}" if results is not None else ""))
    if args.json:
        print(json.dumps({"ok": True, "reports": [str(out / "report.json")]
                          + ([str(out / "direct" / "report.json")] if len(reports) > 1 else []),
                          "files": [str(p) for p in written], "results": str(results) if results else None,
                          "points": rows, "timings": reports[0].get("timings")}, indent=2))
    else:
        print((out / "report.md").read_text())
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    try:
        result = compare([load_report(p) for p in args.reports])
    except RecipeRunError as exc:
        print(f"capyctl recipe compare: {exc}", file=sys.stderr)
        return EXIT_INVALID
    written = write_comparison(result, Path(args.out))
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(render_comparison(result))
        print(f"capyctl recipe compare: wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
    return 0

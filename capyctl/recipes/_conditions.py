"""What else the machine did while a recipe's benchmark ran, and the check that the sides of a
comparison ran under the same conditions.

Why: a llama-server with as many threads as cores (``-t 2`` on two) decoded at about 120 tokens/s
on its own and at 2 to 22 beside a single busy process of someone else's (docs/benchmarks.md,
"Recipes", issue 47). A figure measured while other work ran says little, and two figures
measured at different times compare the two moments as much as the two sides. So each report
records, for the window its benchmark ran in: the load average before and after, the CPU the
machine spent (its engine, the runner, everything else, and the biggest other processes), and the
engine's own settings that decide how it uses the CPU (thread count, affinity, niceness, the
environment variables of its thread pools). ``check`` reads them from two or more reports.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any

# Other work that makes a CPU figure suspect: a fifth of one core, on average over the window.
BUSY_CORES = 0.2
# The flags the direct launch changes (capyctl/recipes/_runner.py direct_argv): where it listens,
# its key file and its scratch directory. Every other word of the command line must match.
_LAUNCH_FLAGS = ("--host", "--port", "--uds", "--api-key-file", "--slot-save-path")
# Environment variables that set a CPU engine's thread pools (OpenMP, llama.cpp's own flags,
# BLAS libraries).
_THREAD_ENV = ("OMP_", "GOMP_", "KMP_", "GGML_", "LLAMA_ARG_", "OPENBLAS_", "MKL_", "VLLM_CPU_")
_THREAD_FLAGS = ("-t", "--threads")


def _ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def _stat_fields(proc: Path, pid: int) -> tuple[str, list[str]] | None:
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()


def process_cpu(proc: Path = Path("/proc")) -> dict[int, tuple[str, int, float]]:
    """Every process now: pid -> (name, parent pid, CPU seconds used so far)."""
    out = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        parsed = _stat_fields(proc, int(entry.name))
        if parsed:
            name, fields = parsed
            try:
                out[int(entry.name)] = (name, int(fields[1]), (int(fields[11]) + int(fields[12])) / _ticks())
            except (ValueError, IndexError):
                continue
    return out


def machine_busy_seconds(proc: Path = Path("/proc")) -> float:
    """CPU seconds every core spent on anything but idle and I/O wait, since boot."""
    fields = (proc / "stat").read_text().splitlines()[0].split()[1:]
    return sum(int(x) for i, x in enumerate(fields[:8]) if i not in (3, 4)) / _ticks()


def _tree(pid: int, table: dict[int, tuple[str, int, float]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for p, (_, parent, _) in table.items():
        children.setdefault(parent, []).append(p)
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += children.get(p, [])
    return out


def _own_cpu() -> float:
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


class CpuWindow:
    """Opened before a benchmark and closed after it: the load and where the CPU went meanwhile."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        self.started_at = time.time()
        self.load_before = list(os.getloadavg())
        self._t0, self._busy0, self._own0 = time.monotonic(), machine_busy_seconds(proc), _own_cpu()
        self._table0 = process_cpu(proc)

    def close(self, engines: dict[str, int | None]) -> dict[str, Any]:
        """The window's figures; ``engines`` names the engine processes measured (their trees count
        as theirs), None for one that was not found."""
        table = process_cpu(self.proc)
        window = time.monotonic() - self._t0
        busy = machine_busy_seconds(self.proc) - self._busy0
        own = _own_cpu() - self._own0

        def used(pid: int) -> float:
            # A process that started in the window used all its CPU in it.
            return table[pid][2] - (self._table0[pid][2] if pid in self._table0 else 0.0)

        engine_cores, counted = {}, {os.getpid()}
        for label, pid in engines.items():
            if pid is None or pid not in table:
                engine_cores[label] = None
                continue
            tree = _tree(pid, table)
            counted |= tree
            engine_cores[label] = round(sum(used(p) for p in tree) / window, 3)
        own_children = _tree(os.getpid(), table) - counted  # the runner's own commands (capyctl CLI)
        counted |= own_children
        others = sorted(((used(p), p) for p in table if p not in counted and used(p) > 0), reverse=True)
        other_cores = max(0.0, busy - own - sum(c or 0.0 for c in engine_cores.values()) * window) / window
        return {"window": [round(self.started_at, 3), round(time.time(), 3)], "window_s": round(window, 3),
                "load_before": [round(x, 2) for x in self.load_before],
                "load_after": [round(x, 2) for x in os.getloadavg()],
                "cpus_usable": len(os.sched_getaffinity(0)),
                "busy_cores": round(busy / window, 3), "runner_cores": round(own / window, 3),
                "engine_cores": engine_cores, "other_cores": round(other_cores, 3),
                "top_other": [{"pid": p, "name": table[p][0], "cores": round(s / window, 3)}
                              for s, p in others[:5] if s / window >= 0.01]}


def unit_main_pid(unit: str, argv: list[str], proc: Path = Path("/proc")) -> int | None:
    """The engine process of a CapyCTL unit on this machine: in the unit's cgroup and running
    ``argv`` (which names the engine's own port, so two sandboxes' units of one name differ)."""
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cgroups = (entry / "cgroup").read_text().splitlines()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")[:-1]
        except OSError:
            continue
        if any(line.endswith("/" + unit) for line in cgroups) and [c.decode(errors="replace") for c in cmdline] == argv:
            return int(entry.name)
    return None


def _cgroup_mounts(proc: Path) -> tuple[dict[str, Path], Path | None]:
    """The cgroup v1 hierarchies' mount points by controller, and the cgroup v2 mount when it is the
    whole tree (/sys/fs/cgroup itself: a v2 mount beside v1 ones, "hybrid", holds no controller)."""
    v1: dict[str, Path] = {}
    v2 = None
    for line in (proc / "self" / "mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, options = (right.split() + ["", "", ""])[:3]
        mount = Path(left.split()[4])
        if fstype == "cgroup":
            for option in options.split(","):
                v1[option] = mount
        elif fstype == "cgroup2":
            v2 = mount
    return v1, (v2 if not v1.get("cpu") else None)


def cpu_cgroups_beside(pid: int, leaf: str, proc: Path = Path("/proc")) -> list[Path]:
    """Directories of a cgroup ``leaf`` beside the CPU cgroup of process ``pid`` (a unit's engine):
    the same parent, so the kernel's scheduler, which shares the CPU among sibling cgroups by their
    weights, treats a process put there as it treats the unit. In the v1 ``cpu`` hierarchy, or the
    v2 tree; empty when neither is mounted here."""
    try:
        v1, v2 = _cgroup_mounts(proc)
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return []
    dirs = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        mount = v2 if hierarchy == "0" and not controllers else (
            v1.get("cpu") if "cpu" in controllers.split(",") else None)
        if mount is not None and path.startswith("/") and path != "/":
            dirs.append(mount / path.lstrip("/").rpartition("/")[0] / leaf)
    return dirs


def place_in(pid: int, dirs: list[Path]) -> str | None:
    """Move process ``pid`` (all its threads) into each cgroup directory, made if missing; why not,
    or None when done."""
    for directory in dirs:
        try:
            directory.mkdir(exist_ok=True)
            (directory / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            return f"could not put it in {directory}: {exc}"
    return None if dirs else "no CPU cgroup hierarchy to put it in"


def remove_cgroups(dirs: list[Path]) -> None:
    for directory in dirs:
        try:
            directory.rmdir()
        except OSError:
            pass


def engine_facts(pid: int | None, argv: list[str], proc: Path = Path("/proc")) -> dict[str, Any]:
    """How the engine process uses the CPU: its thread flag, its threads, affinity and niceness, its
    CPU cgroup, and the environment variables of thread pools."""
    words = _launch_words(argv)
    flag = next((words[i + 1] for i, w in enumerate(words[:-1]) if w in _THREAD_FLAGS), None)
    facts: dict[str, Any] = {"argv": _comparable_argv(argv), "threads_flag": flag}
    if pid is None:
        return {**facts, "pid": None, "unknown": "the engine's process is not on this machine"}
    try:
        parsed = _stat_fields(proc, pid)
        environ = (proc / str(pid) / "environ").read_bytes().decode(errors="replace").split("\0")
        cgroup = (proc / str(pid) / "cgroup").read_text().splitlines()
        facts.update(pid=pid, tasks=len(os.listdir(proc / str(pid) / "task")),
                     cpu_affinity=sorted(os.sched_getaffinity(pid)),
                     nice=int(parsed[1][16]) if parsed else None,
                     cpu_cgroup=next((line.split(":", 2)[2] for line in cgroup
                                      if line.split(":")[1] in ("cpu", "cpu,cpuacct", "")), None),
                     thread_env=dict(sorted(kv.split("=", 1) for kv in environ
                                            if "=" in kv and kv.startswith(_THREAD_ENV))))
    except (OSError, ValueError, IndexError) as exc:
        facts.update(pid=pid, unknown=f"could not read /proc/{pid}: {exc}")
    return facts


def _launch_words(argv: list[str]) -> list[str]:
    return [p for a in argv for p in (a.split("=", 1) if a.startswith("--") and "=" in a else [a])]


def _comparable_argv(argv: list[str]) -> list[str]:
    """The command line without what the direct launch changes (where it listens, key, scratch)."""
    words, out, skip = _launch_words(argv), [], False
    for word in words:
        if skip:
            skip = False
        elif word in _LAUNCH_FLAGS:
            skip = True
        else:
            out.append(word)
    return out


# ---------------------------------------------------------------- the check

def check(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether every report ran under the baseline's (the first one's) conditions.

    ``differences`` lists what makes the ratios compare more than the sides: a report that
    recorded no conditions, sides measured one after the other instead of turn by turn, other
    work on the machine that differed, and for the same engine and model, a different command
    line, thread count, affinity, niceness or thread-pool environment. ``notes`` says what held
    for all (a machine busy with other work on every side)."""
    differences: list[str] = []
    notes: list[str] = []
    base = reports[0]
    labels = [f"{r['recipe']['name']} ({r['via']})" for r in reports]
    missing = [labels[i] for i, r in enumerate(reports) if not isinstance(r.get("conditions"), dict)]
    if missing:
        differences.append("no conditions recorded (a run from before they were) for: " + ", ".join(missing))
        return {"same": False, "differences": differences, "notes": notes}
    cb = base["conditions"]
    same_engine = all((r.get("engine") or {}).get("kind") == (base.get("engine") or {}).get("kind")
                      and (r.get("model") or {}).get("pin") == (base.get("model") or {}).get("pin") for r in reports)
    for label, report in zip(labels[1:], reports[1:]):
        c = report["conditions"]
        together = report.get("run_id") in (cb.get("measured_with") or []) and \
            base.get("run_id") in (c.get("measured_with") or [])
        if not together:
            differences.append(f"{label} was not measured turn by turn with {labels[0]} but at another time "
                               f"(bench windows {_when(cb)} and {_when(c)}): other work on the machine may "
                               "have fallen on one side only")
        ob, oc = (cb.get("cpu") or {}).get("other_cores"), (c.get("cpu") or {}).get("other_cores")
        if ob is not None and oc is not None and abs(ob - oc) >= BUSY_CORES:
            differences.append(f"other work on the machine: {ob:.2f} cores during {labels[0]}, {oc:.2f} during "
                               f"{label}")
        if same_engine:
            eb, ec = cb.get("engine") or {}, c.get("engine") or {}
            pb, pc = _parent(eb.get("cpu_cgroup")), _parent(ec.get("cpu_cgroup"))
            if pb is not None and pc is not None and pb != pc:
                differences.append(f"the engine's CPU cgroup: under {pb} for {labels[0]}, under {pc} for {label} "
                                   "(the scheduler shares the CPU among sibling cgroups: with other work on the "
                                   "machine the two get different shares)")
            for key, what in (("argv", "command line (where it listens aside)"), ("threads_flag", "thread flag"),
                              ("cpu_affinity", "CPU affinity"), ("nice", "niceness"),
                              ("thread_env", "thread-pool environment")):
                if key in eb and key in ec and eb[key] != ec[key]:
                    differences.append(f"the engine's {what}: {eb[key]!r} for {labels[0]}, {ec[key]!r} for {label}")
    busy = [f"{label} {r['conditions']['cpu']['other_cores']:.2f}" for label, r in zip(labels, reports)
            if ((r["conditions"].get("cpu") or {}).get("other_cores") or 0) >= BUSY_CORES]
    if busy:
        notes.append("other work held the CPU while measuring (cores, on average): " + ", ".join(busy)
                     + "; the figures are low for it, the ratios of sides measured turn by turn less so")
    return {"same": not differences, "differences": differences, "notes": notes}


def _parent(cgroup: Any) -> str | None:
    return (cgroup.rpartition("/")[0] or "/") if isinstance(cgroup, str) and cgroup.startswith("/") else None


def _when(conditions: dict[str, Any]) -> str:
    window = (conditions.get("cpu") or {}).get("window") or [None, None]
    if not all(isinstance(t, (int, float)) for t in window):
        return "?"
    return "-".join(time.strftime("%H:%M:%S", time.gmtime(t)) for t in window)

"""docs/benchmarks.md names each benchmark goal as benchmarks/bench_goals.py has it (issue 48): the
goals' tables are what the module renders, every goal column (generated or written by hand) says
one of the module's goals, and no sentence gives a goal the module does not have."""

from __future__ import annotations

import re
from pathlib import Path

from tests.benchmarks import load_benchmark

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "benchmarks.md"
bs = load_benchmark("bench_summary")
G = bs.G

NUMBER = r"(\d[\d,]*(?:\.\d+)?)\s*(x|ms|MiB|%|µs|us|requests/s|/s|s)(?!\w)"
# "goal 0.5x", "goal of 1.25x", "goal <= 0.70 ms", "goal at most 2 MiB"; "the 64 MiB goal"
WORD_THEN_FIGURE = re.compile(r"\bgoals?\b(?: of| is| at)?\s*(?:(?:[≤≥<>]=?|at most|at least)\s*)?" + NUMBER)
FIGURE_THEN_WORD = re.compile(NUMBER + r"\s+goals?\b")
# The goal column of bench_summary's rows that judge nothing.
INFO = {"(peer)", "(profile)", "(baseline)", "(floor)", "(bound)", "(attack)"}


def _goal_texts() -> set[str]:
    """Every goal cell a table may have: each goal as the module says it, and as the rows say it
    (some rows put two together)."""
    return {g.shown for g in G.GOALS.values()} | {r.goal for r in bs.evaluate({})}


def _a_goal(cell: str, texts: set[str]) -> bool:
    """A goal column's cell: one of the goals, one with the run's own figure after it ("<= quantum +
    (one-model p99 + one swap) per other model (6.50 s)"), an information row's "(peer)", or nothing."""
    return not cell or cell in texts | INFO or any(cell.startswith(t + " (") for t in texts)


def _figure(number: str, unit: str) -> tuple[float, str]:
    return float(number.replace(",", "")), {"µs": "us", "requests/s": "/s"}.get(unit, unit)


def _goal_figures() -> set[tuple[float, str]]:
    """Each goal's bound as its goal column says it, with its unit: (0.7, "ms"), (2848.0, "/s")."""
    return {_figure(*m) for g in G.GOALS.values() for m in re.findall(NUMBER, g.shown)}


def stray_goals(text: str) -> list[str]:
    """The goals a text's sentences give that are none of the module's, figure and unit."""
    flat = " ".join(text.split())
    figures = _goal_figures()
    return [m.group(0) for pattern in (WORD_THEN_FIGURE, FIGURE_THEN_WORD) for m in pattern.finditer(flat)
            if _figure(m.group(1), m.group(2)) not in figures]


def _outside_blocks(text: str) -> str:
    return bs.MARKER.sub("", text)


def _tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table of ``text``, rows of cells, header first."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(bs.parse_table("\n".join(current)))
            current = []
    return tables


def test_the_goals_tables_are_what_the_goals_module_renders():
    blocks = {m.group("name"): m.group("body") for m in bs.MARKER.finditer(DOCS.read_text())}
    goals = [name for name in blocks if name == "goals" or name.startswith("goals-")]
    assert "goals" in goals
    for name in goals:
        issue = None if name == "goals" else int(name.split("-", 1)[1])
        assert blocks[name] == bs.render_goals(issue) + "\n", (
            f"docs/benchmarks.md's {name} table is not benchmarks/bench_goals.py's: run "
            "benchmarks/bench_summary.py RUN --docs docs/benchmarks.md")


def test_every_goal_column_of_the_docs_says_one_of_the_modules_goals():
    texts = _goal_texts()
    text = DOCS.read_text()
    checked = 0
    for m in bs.MARKER.finditer(text):
        if m.group("name").startswith("goals"):
            continue
        table = bs.parse_table(m.group("body"))
        if not table:
            continue
        column = table[0].index("goal")
        for row in table[1:]:
            assert _a_goal(row[column], texts), f"{m.group('name')}: {row[0]}: goal {row[column]!r} is not the module's"
            checked += 1
    for table in _tables(_outside_blocks(text)):
        columns = [i for i, head in enumerate(table[0]) if head.startswith("goal")]
        verdicts = [c for row in table[1:] for c in row if re.search(r"\b(PASS|MISS)\b", c)]
        assert columns or not verdicts, f"a table judged by hand without its goals: {table[0]}"
        for row in table[1:]:
            for i in columns:
                assert _a_goal(row[i], texts), f"{row[0]}: goal {row[i]!r} is not benchmarks/bench_goals.py's"
                checked += bool(row[i])
    assert checked >= 20


def test_no_sentence_of_the_docs_gives_another_goal():
    text = _outside_blocks(DOCS.read_text())
    prose = "\n".join(line for line in text.splitlines() if not line.startswith("|"))
    assert stray_goals(prose) == []


def test_a_stray_goal_is_found():
    assert stray_goals("the goal <= 0.60 ms held") == ["goal <= 0.60 ms"]
    assert stray_goals("its goal\nof 7,000 requests/s and a 3 MiB goal") == ["goal of 7,000 requests/s", "3 MiB goal"]
    assert stray_goals("the goal <= 0.70 ms, goal 0.5x, the 64 MiB goal, a goal of 1.25x") == []
    texts = _goal_texts()
    assert _a_goal("<= 0.70 ms over direct", texts) and not _a_goal("<= 0.60 ms over direct", texts)
    assert _a_goal("<= quantum + (one-model p99 + one swap) per other model (6.50 s)", texts)
    assert not _a_goal("<= wait_max + one wake (30.40 s)", texts) and _a_goal("(peer)", texts)

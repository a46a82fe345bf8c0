"""How long the planner takes to plan one wake, on a busy 8-GPU host with 1,000 deployments.

    .venv/bin/python benchmarks/planner.py [--repeats 200] [--seed 1]

The cluster: one host with 8 identical 80 GiB cards and 2 TiB of RAM; 1,000 deployments, of
which 3 per card are ready (24), 8 hold two cards, 150 are parked in place (their weights in host
RAM) and the rest are stopped. Every plan is for a new deployment that needs one or two whole-ish
cards, so each one has to choose victims.

Two baselines, both measured in this same run:

* scale: the same planner on 10 deployments (the first 10 of the same cluster) -> how the time
  grows from 10 to 1,000 deployments;
* brute force: a naive planner that tries every placement and every set of evictable deployments
  in order of size (the definition of "the minimal set of victims"), on a cluster small enough for
  it to finish (4 cards, 12 ready deployments), against this planner on that same cluster.

Standard library only (and CapyCTL). Prints medians; speed is not asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from itertools import combinations
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capyctl.scheduler import (Candidate, Footprint, GpuCard, HostResources, Ledger, NoRoom, Plan,  # noqa: E402
                               Request, Victim, plan)

GiB = 1 << 30
CARDS = 8


def build(deployments: int, rng: random.Random, *, cards: int = CARDS, ready_per_card: int = 3, pairs: int = 8,
          parked: int = 150) -> tuple[Ledger, list[Candidate]]:
    host = HostResources("node", 2048 * GiB, 64 * GiB, tuple(GpuCard(i, "H100", 80 * GiB) for i in range(cards)))
    ledger = Ledger([host])
    candidates: list[Candidate] = []
    names = iter(range(deployments))

    def add(fp: Footprint, gpus: tuple[int, ...], state: str) -> bool:
        index = next(names, None)
        if index is None:
            return False
        name = f"model-{index:04d}"
        ledger.place(name, fp, "node", gpus, state)
        candidates.append(Candidate(name, state, float(rng.randint(0, 10_000)), busy=rng.random() < 0.15,
                                    never_evict=rng.random() < 0.03))
        return True

    for card in range(cards):
        for _ in range(ready_per_card):
            add(Footprint(1, rng.randint(8, 24) * GiB, rng.randint(2, 8) * GiB, rng.randint(4, 24) * GiB),
                (card,), "ready")
    for i in range(pairs):
        add(Footprint(2, rng.randint(2, 6) * GiB, 4 * GiB, 30 * GiB), (2 * (i % (cards // 2)), 2 * (i % (cards // 2)) + 1), "ready")
    for _ in range(parked):
        add(Footprint(1, 20 * GiB, 2 * GiB, rng.randint(2, 8) * GiB), (rng.randrange(cards),), "parked")
    while add(Footprint(1, 20 * GiB, 2 * GiB, 8 * GiB), (rng.randrange(cards),), "stopped"):
        pass
    return ledger, candidates


def requests(count: int, rng: random.Random) -> list[Request]:
    return [Request(f"new-{i}", Footprint(rng.choice((1, 1, 2)), rng.randint(50, 76) * GiB, 8 * GiB, 16 * GiB))
            for i in range(count)]


def brute_force_plan(request: Request, ledger: Ledger, candidates: list[Candidate]) -> Plan:
    """The definition, executed: fewest victims first, every option, every subset; stop them all."""
    host = ledger.hosts[0]
    cards = [d.index for d in ledger.host_domains(host) if d.kind == "gpu"]
    options = list(combinations(cards, request.footprint.gpus))
    evictable = [c.deployment for c in candidates if not c.busy and not c.never_evict
                 and c.state in ("ready", "parked") and ledger.get(c.deployment) is not None]
    for size in range(len(evictable) + 1):
        for victims in combinations(evictable, size):
            for gpus in options:
                trial = ledger.copy()
                for name in victims:
                    trial.set_state(name, "stopped")
                    trial.confirm_released(name)
                trial.place(request.deployment, request.footprint, host, gpus)
                if not trial.overcommitted():
                    return Plan(request.deployment, host, gpus, tuple(Victim(v, "stop") for v in victims))
    raise NoRoom("no room")


def median_seconds(planner, batch: list[Request], ledger: Ledger, candidates: list[Candidate],
                   now: float) -> tuple[float, list[int | None]]:
    times: list[float] = []
    victims: list[int | None] = []  # per plan; None for no room
    for request in batch:
        start = time.perf_counter()
        try:
            result = planner(request, ledger, candidates, now) if planner is plan else planner(request, ledger,
                                                                                              candidates)
            victims.append(len(result.victims))
        except NoRoom:
            victims.append(None)
        times.append(time.perf_counter() - start)
    return statistics.median(times), victims


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200, help="plans per measurement")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    now = 20_000.0
    batch = requests(args.repeats, rng)

    big, big_candidates = build(1000, random.Random(args.seed))
    small, small_candidates = build(10, random.Random(args.seed))
    t_big, v_big = median_seconds(plan, batch, big, big_candidates, now)
    t_small, _ = median_seconds(plan, batch, small, small_candidates, now)

    tiny, tiny_candidates = build(12, random.Random(args.seed), cards=4, ready_per_card=3, pairs=0, parked=0)
    few = batch[: max(5, args.repeats // 20)]
    t_fast, v_fast = median_seconds(plan, few, tiny, tiny_candidates, now)
    t_brute, v_brute = median_seconds(brute_force_plan, few, tiny, tiny_candidates, now)

    resident = sum(1 for p in big.placements() if p.state != "stopped")
    print(f"planner, 1000 deployments ({resident} resident) on {CARDS} GPUs + host RAM: "
          f"median {t_big * 1e3:.3f} ms per plan over {len(batch)} plans ({statistics.mean(v or 0 for v in v_big):.2f} victims per plan, "
          f"{v_big.count(None)} without room)")
    print(f"baseline 1 (scale), same planner on 10 deployments: median {t_small * 1e3:.3f} ms per plan; "
          f"ratio 1000/10 = {t_big / t_small:.1f}x")
    print(f"baseline 2 (brute force), 12 deployments on 4 GPUs, {len(few)} plans: brute force median {t_brute * 1e3:.3f} ms, "
          f"planner median {t_fast * 1e3:.3f} ms; brute force / planner = {t_brute / t_fast:.1f}x; "
          f"same number of victims on every plan: {'yes' if v_fast == v_brute else 'NO'}")
    if args.json:
        args.json.write_text(json.dumps({"plans": len(batch), "median_s_1000": t_big, "median_s_10": t_small,
                                         "scale_ratio": t_big / t_small, "brute_force_median_s": t_brute,
                                         "planner_median_s_12": t_fast, "brute_over_planner": t_brute / t_fast,
                                         "same_victims": v_fast == v_brute}))


if __name__ == "__main__":
    main()

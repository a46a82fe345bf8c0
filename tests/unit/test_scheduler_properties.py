"""Properties of the planner on generated small clusters, checked against a brute-force oracle.

The oracle knows nothing of the planner's search: it tries every placement option and every set
of evictable deployments on a copy of the ledger (stop them, confirm their release, place the
deployment) and asks the ledger whether any domain is over-committed.
"""

from __future__ import annotations

from itertools import combinations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from capyctl.scheduler import (Candidate, Footprint, GpuCard, HostResources, Ledger, NoRoom, Plan, Request,
                               plan)
from tests.examples import examples

CARD_TYPES = [("A100", 8), ("A100", 8), ("A100", 8), ("L4", 6), ("A100", 6)]  # the last differs from A100/8 by memory only
NOW = 100.0


def _identical_sets(host: HostResources, n: int) -> list[tuple[int, ...]]:
    cards = {c.index: c for c in host.gpus}
    if n == 0:
        return [()]
    return [combo for combo in combinations(sorted(cards), n)
            if len({(cards[i].model, cards[i].memory_total) for i in combo}) == 1]


@st.composite
def scenarios(draw) -> tuple[Ledger, list[Candidate], Request, list[HostResources]]:
    hosts = []
    for h in range(draw(st.integers(1, 2))):
        # Hypothesis favours boundary values of integers(); sampled_from gives the intended odds.
        kinds = draw(st.lists(st.sampled_from(CARD_TYPES), min_size=draw(st.sampled_from([2, 1, 2, 0])),
                              max_size=3))
        hosts.append(HostResources(f"h{h}", draw(st.integers(6, 16)), draw(st.integers(0, 2)),
                                   tuple(GpuCard(i, m, t) for i, (m, t) in enumerate(kinds))))
    ledger = Ledger(hosts)
    candidates = []
    # Deployments drawn card by card so most cards are busy and most requests need victims.
    where: list[tuple[HostResources, int]] = []  # (host, gpus) per deployment
    for host in hosts:
        for _ in host.gpus:
            where += [(host, 1)] * draw(st.integers(1, 2))
        where += [(host, 2)] * draw(st.integers(0, 1)) + [(host, 0)] * draw(st.integers(0, 2))
    where = draw(st.permutations(where))[:7]  # the brute-force oracle tries every subset
    for i, (host, gpus) in enumerate(where):
        name = f"d{i}"
        fp = Footprint(gpus, draw(st.sampled_from([2, 3, 4, 1, 5, None])) if gpus else None,
                       draw(st.sampled_from([1, 2, 0, 3, 4])), draw(st.sampled_from([None, 0, 1, 2, 3])))
        state = draw(st.sampled_from(["ready"] * 6 + ["parked", "parked", "stopped", "starting", "failed"]))
        sets = _identical_sets(host, gpus)
        if sets:
            cards = draw(st.sampled_from(sets))
            in_place = draw(st.booleans()) if fp.parks_in_place else False
            trial = ledger.copy()
            trial.place(name, fp, host.name, cards, state, in_place=in_place)
            if trial.overcommitted():
                state = "stopped"
                ledger.place(name, fp, host.name, cards, state)
            else:
                ledger = trial
        else:
            state = "stopped"  # never placed: the ledger does not know it
        candidates.append(Candidate(name, state, float(draw(st.integers(0, 20))),
                                    busy=draw(st.sampled_from([False] * 7 + [True])),
                                    never_evict=draw(st.sampled_from([False] * 9 + [True]))))
    # Stops whose release is not yet confirmed, and use outside CapyCTL seen by the inventory.
    for c in list(candidates):
        placed = ledger.get(c.deployment)
        if placed is not None and c.state == "ready" and draw(st.sampled_from([False] * 5 + [True])):
            ledger.set_state(c.deployment, "stopped")
            candidates[candidates.index(c)] = Candidate(c.deployment, "stopped", c.last_used, c.busy, c.never_evict)
    for dom in ledger.domains:
        if draw(st.sampled_from([False] * 8 + [True])) and ledger.free(dom) > 0:
            ledger.observe_free(dom, ledger.free(dom) - draw(st.integers(0, ledger.free(dom))))

    waking = [c for c in candidates if c.state in ("stopped", "parked", "failed")]
    if waking and draw(st.sampled_from([False, False, False, True])):
        chosen = draw(st.sampled_from(waking))
        placed = ledger.get(chosen.deployment)
        fp = placed.footprint if placed is not None else Footprint(0, None, draw(st.integers(0, 6)))
        request = Request(chosen.deployment, fp)
    else:
        gpus = draw(st.sampled_from([1, 2, 1, 0, 2, 1, 3]))
        fp = Footprint(gpus, draw(st.sampled_from([6, 5, 7, None, 4, 8, 3])) if gpus else None,
                       draw(st.sampled_from([4, 6, 2, 8, 10, 0])), draw(st.sampled_from([None, 0, 2, 4])))
        allowed = draw(st.one_of(st.none(), st.lists(st.sampled_from([h.name for h in hosts] + ["elsewhere"]),
                                                     min_size=1, max_size=2, unique=True)))
        request = Request("x", fp, tuple(allowed) if allowed is not None else None)
    return ledger, candidates, request, hosts


def _options(ledger: Ledger, request: Request, hosts: list[HostResources]) -> list[tuple[str, tuple[int, ...]]]:
    own = ledger.get(request.deployment)
    if own is not None and own.parked_in_place:
        return [(own.host, own.gpus)]
    allowed = [h for h in hosts if request.hosts is None or h.name in request.hosts]
    return [(h.name, cards) for h in allowed for cards in _identical_sets(h, request.footprint.gpus)]


def _evictable(ledger: Ledger, candidates: list[Candidate], request: Request) -> list[Candidate]:
    return [c for c in candidates if c.deployment != request.deployment and not c.busy and not c.never_evict
            and c.state in ("ready", "parked") and ledger.get(c.deployment) is not None]


def _fits(ledger: Ledger, request: Request, host: str, cards: tuple[int, ...], stopped: tuple[str, ...]) -> bool:
    trial = ledger.copy()
    for name in stopped:
        trial.set_state(name, "stopped")
        trial.confirm_released(name)
    own = trial.get(request.deployment)
    trial.place(request.deployment, request.footprint, host, cards,
                "waking" if own is not None and own.parked_in_place else "starting")
    return not trial.overcommitted()


def _carry_out(ledger: Ledger, request: Request, result: Plan) -> Ledger:
    after = ledger.copy()
    after.apply(result, request)
    for victim in result.victims:
        after.confirm_released(victim.deployment)
    return after


@settings(max_examples=examples(2500), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_plan_is_safe_minimal_and_complete(scenario) -> None:
    ledger, candidates, request, hosts = scenario
    options = _options(ledger, request, hosts)
    evictable = _evictable(ledger, candidates, request)
    by_name = {c.deployment: c for c in candidates}
    try:
        result = plan(request, ledger, candidates, NOW)
    except NoRoom as exc:
        event("no room")
        assert exc.code == "no_room" and request.deployment in exc.message
        # Completeness: not even evicting every evictable deployment would make room anywhere.
        everyone = tuple(c.deployment for c in evictable)
        assert not any(_fits(ledger, request, host, cards, everyone) for host, cards in options)
        return

    event(f"{len(result.victims)} victims, {sum(v.action == 'park' for v in result.victims)} parked")
    # Placement: an allowed option (identical cards on one host, or where it is parked in place).
    assert (result.host, result.gpus) in options
    assert len(result.gpus) == request.footprint.gpus

    # Victims: idle, evictable, distinct, never the deployment itself.
    names = [v.deployment for v in result.victims]
    assert len(set(names)) == len(names)
    for victim in result.victims:
        c = by_name[victim.deployment]
        assert not c.busy and not c.never_evict and victim.deployment != request.deployment
        assert victim.action in ("park", "stop")
        if victim.action == "park":
            placed = ledger.get(victim.deployment)
            assert placed.state == "ready" and placed.footprint.parks_in_place

    # Safety: carried out (victims parked or stopped as planned, releases confirmed), nothing is over-committed.
    assert _carry_out(ledger, request, result).overcommitted() == []

    # Minimality: no set with fewer victims works on any option, and no proper subset of these on this one.
    k = len(result.victims)
    for size in range(k):
        for subset in combinations([c.deployment for c in evictable], size):
            assert not any(_fits(ledger, request, host, cards, subset) for host, cards in options), (subset, result)
    for size in range(k):
        for subset in combinations(names, size):
            assert not _fits(ledger, request, result.host, result.gpus, subset)

    # LRU: among the feasible sets of k victims, none spares a more recently used deployment.
    def lru_key(group: tuple[str, ...]) -> tuple:
        return tuple(sorted(((by_name[n].last_used, n) for n in group), reverse=True))

    feasible = [s for s in combinations([c.deployment for c in evictable], k)
                if any(_fits(ledger, request, host, cards, s) for host, cards in options)]
    assert lru_key(tuple(names)) == min(map(lru_key, feasible))

    # Park rather than stop whenever the parked footprint would still fit.
    parked_ok = _carry_out(ledger, request, result)
    for victim in result.victims:
        placed = ledger.get(victim.deployment)
        if victim.action == "stop" and placed.state == "ready" and placed.footprint.parks_in_place:
            parked_ok.set_state(victim.deployment, "parked", in_place=True)
            parked_ok.confirm_released(victim.deployment)
            assert parked_ok.overcommitted(), f"{victim.deployment} was stopped but its parked footprint fits"
            parked_ok.set_state(victim.deployment, "stopped")
            parked_ok.confirm_released(victim.deployment)


@settings(max_examples=examples(1000), deadline=None)
@given(scenarios())
def test_busy_and_never_evict_are_never_victims_even_under_pressure(scenario) -> None:
    # Mark every other deployment busy or never-evicted: a plan may exist only without victims.
    ledger, candidates, request, hosts = scenario
    pinned = [Candidate(c.deployment, c.state, c.last_used, busy=i % 2 == 0, never_evict=i % 2 == 1)
              for i, c in enumerate(candidates)]
    options = _options(ledger, request, hosts)
    try:
        result = plan(request, ledger, pinned, NOW)
    except NoRoom:
        assert not any(_fits(ledger, request, host, cards, ()) for host, cards in options)
        return
    assert result.victims == ()
    assert _fits(ledger, request, result.host, result.gpus, ())

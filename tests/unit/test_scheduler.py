"""The scheduler's documented rules, one example each."""

from __future__ import annotations

import pytest

from capyctl.errors import CapyError
from capyctl.scheduler import (Candidate, Footprint, GpuCard, HostResources, Ledger, NoRoom, Plan, Request,
                               Victim, idle_to_park, plan)

GiB = 1 << 30
NOW = 1000.0


def one_host(cards=(("H100", 80),), ram=64, reserve=4) -> Ledger:
    return Ledger([HostResources("gpu1", ram * GiB, reserve * GiB,
                                 tuple(GpuCard(i, m, t * GiB) for i, (m, t) in enumerate(cards)))])


def ready(name: str, last_used: float, **kw) -> Candidate:
    return Candidate(name, "ready", last_used, **kw)


# -- the ledger ------------------------------------------------------------------------------------

def test_charges_follow_the_state_table() -> None:
    ledger = one_host()
    fp = Footprint(1, 30 * GiB, 2 * GiB, parked_ram=12 * GiB)
    for state in ("starting", "ready", "waking", "parking", "stopping"):
        ledger.place("m", fp, "gpu1", (0,), state)
        ledger.confirm_released("m")
        assert (ledger.charged("gpu:gpu1:0"), ledger.charged("ram:gpu1")) == (30 * GiB, 2 * GiB), state
    ledger.set_state("m", "parked")  # in place: the weights move to host RAM
    ledger.confirm_released("m")
    assert (ledger.charged("gpu:gpu1:0"), ledger.charged("ram:gpu1")) == (0, 12 * GiB)
    for state, in_place in (("parked", False), ("stopped", None), ("failed", None)):
        ledger.set_state("m", state, in_place=in_place)
        ledger.confirm_released("m")
        assert (ledger.charged("gpu:gpu1:0"), ledger.charged("ram:gpu1")) == (0, 0), state


def test_ram_domain_is_total_minus_reserve_and_gpus_carry_their_model() -> None:
    ledger = one_host(cards=(("H100", 80), ("L4", 24)), ram=64, reserve=4)
    assert ledger.domains["ram:gpu1"].capacity == 60 * GiB
    assert ledger.domains["gpu:gpu1:1"].card_type == ("L4", 24 * GiB)


def test_released_memory_stays_charged_until_confirmed() -> None:
    ledger = one_host()
    ledger.place("m", Footprint(1, 50 * GiB, 2 * GiB), "gpu1", (0,), "ready")
    ledger.set_state("m", "stopped")
    assert ledger.pending("gpu:gpu1:0") == {"m": 50 * GiB}
    assert ledger.free("gpu:gpu1:0") == 30 * GiB
    ledger.confirm_released("m", "gpu:gpu1:0")
    assert ledger.free("gpu:gpu1:0") == 80 * GiB
    assert ledger.pending("ram:gpu1") == {"m": 2 * GiB}  # only the domain confirmed was cleared


def test_observed_free_memory_clears_pending_releases_and_counts_outside_use() -> None:
    ledger = one_host()
    ledger.place("a", Footprint(1, 20 * GiB), "gpu1", (0,), "ready")
    ledger.place("b", Footprint(1, 30 * GiB), "gpu1", (0,), "ready")
    ledger.set_state("a", "stopped")
    ledger.set_state("b", "stopped")
    # NVML still sees 20 GiB in use: b's release (the newer) is done, a's is not.
    ledger.observe_free("gpu:gpu1:0", 60 * GiB)
    assert ledger.pending("gpu:gpu1:0") == {"a": 20 * GiB}
    # Later 5 GiB are still in use: a's release is not whole yet, as far as anyone can tell.
    ledger.observe_free("gpu:gpu1:0", 75 * GiB)
    assert ledger.pending("gpu:gpu1:0") == {"a": 5 * GiB}
    assert ledger.free("gpu:gpu1:0") == 75 * GiB
    # The inventory shows a's process gone: the 5 GiB belong to someone outside CapyCTL.
    ledger.confirm_released("a")
    ledger.observe_free("gpu:gpu1:0", 75 * GiB)
    assert ledger.pending("gpu:gpu1:0") == {}
    assert ledger.external("gpu:gpu1:0") == 5 * GiB
    assert ledger.free("gpu:gpu1:0") == 75 * GiB
    ledger.observe_free("gpu:gpu1:0", 80 * GiB)
    assert ledger.charged("gpu:gpu1:0") == 0


def test_a_card_observation_confirms_releases_by_process_and_keeps_what_is_still_held() -> None:
    ledger = one_host(cards=(("H100", 80),))
    ledger.place("gone", Footprint(1, 30 * GiB, GiB), "gpu1", (0,), "ready")
    ledger.place("exiting", Footprint(1, 20 * GiB, GiB), "gpu1", (0,), "ready")
    ledger.place("new", Footprint(1, 25 * GiB, GiB), "gpu1", (0,), "ready")
    ledger.set_state("gone", "stopped")
    ledger.set_state("exiting", "stopped")
    ledger.set_state("new", "starting")  # it has not allocated anything yet
    # NVML: no process of "gone" any more, "exiting" still holds 8 GiB, "new" nothing yet, plus
    # 3 GiB of a process nobody knows. observe_free would have cleared "exiting" (use <= charges).
    used = 8 * GiB + 3 * GiB
    ledger.observe_card("gpu:gpu1:0", 80 * GiB - used, {"exiting": 8 * GiB})
    assert ledger.pending("gpu:gpu1:0") == {"exiting": 8 * GiB}
    assert ledger.external("gpu:gpu1:0") == 0  # "new"'s charge covers the unknown 3 GiB for now
    assert ledger.free("gpu:gpu1:0") == 80 * GiB - 25 * GiB - 8 * GiB
    ledger.observe_card("gpu:gpu1:0", 80 * GiB - 25 * GiB - 3 * GiB, {"new": 25 * GiB})
    assert ledger.pending("gpu:gpu1:0") == {} and ledger.external("gpu:gpu1:0") == 3 * GiB
    with pytest.raises(CapyError) as info:
        ledger.observe_card("ram:gpu1", 0, {})
    assert info.value.code == "not_a_gpu"


def test_a_measured_correction_replaces_the_estimate_without_a_pending_release() -> None:
    ledger = one_host(cards=(("H100", 80),))
    ledger.place("m", Footprint(1, 30 * GiB, 4 * GiB), "gpu1", (0,), "ready")
    ledger.correct("m", gpu_memory=12 * GiB, ram=GiB)
    assert (ledger.charged("gpu:gpu1:0"), ledger.charged("ram:gpu1")) == (12 * GiB, GiB)
    assert ledger.get("m").footprint == Footprint(1, 12 * GiB, GiB)
    ledger.correct("m", gpu_memory=40 * GiB)  # an estimate that was too low grows
    assert ledger.charged("gpu:gpu1:0") == 40 * GiB and ledger.pending("gpu:gpu1:0") == {}
    ledger.set_state("m", "stopped")  # what it then releases is the corrected amount
    assert ledger.pending("gpu:gpu1:0") == {"m": 40 * GiB}
    ledger.place("cpu", Footprint(0, None, GiB), "gpu1", (), "ready")
    with pytest.raises(CapyError):
        ledger.correct("cpu", gpu_memory=GiB)
    with pytest.raises(CapyError):
        ledger.correct("nobody", ram=GiB)


def test_waking_in_place_takes_back_its_own_pending_release() -> None:
    ledger = one_host()
    fp = Footprint(1, 40 * GiB, 2 * GiB, parked_ram=10 * GiB)
    ledger.place("m", fp, "gpu1", (0,), "ready")
    ledger.set_state("m", "parked")
    assert ledger.pending("gpu:gpu1:0") == {"m": 40 * GiB}
    ledger.set_state("m", "waking")  # the same process re-allocates what it released
    assert ledger.pending("gpu:gpu1:0") == {} and ledger.charged("gpu:gpu1:0") == 40 * GiB


def test_ledger_rejects_impossible_placements() -> None:
    ledger = one_host()
    with pytest.raises(CapyError) as info:
        ledger.place("m", Footprint(2, GiB), "gpu1", (0, 1))
    assert info.value.code == "unknown_gpu"
    with pytest.raises(CapyError) as info:
        ledger.place("m", Footprint(1, GiB), "gpu1", ())
    assert info.value.code == "invalid_placement"
    with pytest.raises(CapyError) as info:
        ledger.set_state("ghost", "ready")
    assert info.value.code == "not_placed"


# -- placement -------------------------------------------------------------------------------------

def test_multi_gpu_deployment_gets_identical_cards_on_one_host() -> None:
    ledger = Ledger([
        HostResources("a", 64 * GiB, 0, (GpuCard(0, "A100", 80 * GiB), GpuCard(1, "A100", 40 * GiB),
                                         GpuCard(2, "L4", 24 * GiB))),
        HostResources("b", 64 * GiB, 0, (GpuCard(0, "L4", 24 * GiB), GpuCard(1, "A100", 40 * GiB),
                                         GpuCard(2, "A100", 40 * GiB))),
    ])
    result = plan(Request("tp2", Footprint(2, 30 * GiB, 4 * GiB)), ledger, [], NOW)
    assert (result.host, result.gpus, result.victims) == ("b", (1, 2), ())


def test_tightest_fit_keeps_the_big_hole_for_a_big_model() -> None:
    ledger = one_host(cards=(("A100", 80), ("A100", 80)))
    ledger.place("big", Footprint(1, 60 * GiB), "gpu1", (1,), "ready")
    result = plan(Request("small", Footprint(1, 10 * GiB)), ledger, [ready("big", 1)], NOW)
    assert result.gpus == (1,)


def test_host_constraint_is_obeyed() -> None:
    ledger = Ledger([HostResources("a", 64 * GiB), HostResources("b", 64 * GiB)])
    assert plan(Request("cpu", Footprint(ram=GiB), hosts=("b",)), ledger, [], NOW).host == "b"


def test_between_equal_hosts_the_manifest_order_is_the_preference() -> None:
    ledger = Ledger([HostResources("a", 64 * GiB), HostResources("b", 64 * GiB)])
    assert plan(Request("cpu", Footprint(ram=GiB), hosts=("b", "a")), ledger, [], NOW).host == "b"
    assert plan(Request("cpu", Footprint(ram=GiB), hosts=("a", "b")), ledger, [], NOW).host == "a"
    assert plan(Request("cpu", Footprint(ram=GiB)), ledger, [], NOW).host == "a"  # the ledger's order


def test_cpu_deployment_uses_host_ram_only() -> None:
    ledger = one_host(ram=8, reserve=1)
    ledger.place("gpu-model", Footprint(1, 80 * GiB, 0), "gpu1", (0,), "ready")
    result = plan(Request("cpu", Footprint(ram=6 * GiB)), ledger, [ready("gpu-model", 1)], NOW)
    assert result == Plan("cpu", "gpu1", (), ())


def test_parked_in_place_wakes_on_its_own_cards() -> None:
    ledger = one_host(cards=(("A100", 80), ("A100", 80)))
    fp = Footprint(1, 40 * GiB, 2 * GiB, parked_ram=10 * GiB)
    ledger.place("m", fp, "gpu1", (1,), "parked")
    ledger.place("other", Footprint(1, 60 * GiB), "gpu1", (1,), "ready")
    result = plan(Request("m", fp), ledger, [ready("other", 5)], NOW)
    # Card 0 is empty, but the weights of "m" sit in this process: it must wake on card 1.
    assert (result.gpus, result.victims) == ((1,), (Victim("other", "stop"),))


# -- eviction --------------------------------------------------------------------------------------

def test_least_recently_used_idle_instance_is_evicted_first() -> None:
    ledger = one_host(cards=(("A100", 80), ("A100", 80), ("A100", 80)))
    for index, name in enumerate(("a", "b", "c")):
        ledger.place(name, Footprint(1, 70 * GiB), "gpu1", (index,), "ready")
    candidates = [ready("a", 30), ready("b", 10), ready("c", 20)]
    result = plan(Request("new", Footprint(1, 70 * GiB)), ledger, candidates, NOW)
    assert (result.gpus, result.victims) == ((1,), (Victim("b", "stop"),))


def test_fewest_victims_beat_an_older_pair() -> None:
    ledger = one_host()
    ledger.place("old1", Footprint(1, 20 * GiB), "gpu1", (0,), "ready")
    ledger.place("old2", Footprint(1, 20 * GiB), "gpu1", (0,), "ready")
    ledger.place("recent", Footprint(1, 40 * GiB), "gpu1", (0,), "ready")
    candidates = [ready("old1", 1), ready("old2", 2), ready("recent", 50)]
    result = plan(Request("new", Footprint(1, 40 * GiB)), ledger, candidates, NOW)
    assert result.victims == (Victim("recent", "stop"),)


def test_among_equal_counts_the_most_recent_victim_is_as_old_as_possible() -> None:
    ledger = one_host()
    for name, size in (("a", 5), ("b", 35), ("c", 20), ("d", 20)):
        ledger.place(name, Footprint(1, size * GiB), "gpu1", (0,), "ready")
    # Need 40 GiB. Oldest first would take three (a, c, d); of the pairs that free enough,
    # {c, d} (used at 10 and 20) spares b, used last, where {a, b} and {b, c} would not.
    candidates = [ready("a", 1), ready("b", 40), ready("c", 10), ready("d", 20)]
    result = plan(Request("new", Footprint(1, 40 * GiB)), ledger, candidates, NOW)
    assert result.victims == (Victim("c", "stop"), Victim("d", "stop"))


def test_victim_parks_when_its_parked_footprint_fits_else_stops() -> None:
    fp = Footprint(1, 70 * GiB, 2 * GiB, parked_ram=30 * GiB)
    roomy = one_host(ram=64, reserve=4)
    roomy.place("m", fp, "gpu1", (0,), "ready")
    assert plan(Request("new", Footprint(1, 70 * GiB, 4 * GiB)), roomy, [ready("m", 1)], NOW).victims == (
        Victim("m", "park"),)
    tight = one_host(ram=40, reserve=4)  # 36 GiB: the new one's 10 GiB + 30 GiB of parked weights do not fit
    tight.place("m", fp, "gpu1", (0,), "ready")
    assert plan(Request("new", Footprint(1, 70 * GiB, 10 * GiB)), tight, [ready("m", 1)], NOW).victims == (
        Victim("m", "stop"),)


def test_stop_only_engine_is_stopped() -> None:
    ledger = one_host()
    ledger.place("llama", Footprint(1, 70 * GiB, 2 * GiB, parked_ram=None), "gpu1", (0,), "ready")
    result = plan(Request("new", Footprint(1, 70 * GiB)), ledger, [ready("llama", 1)], NOW)
    assert result.victims == (Victim("llama", "stop"),)


def test_parked_weights_in_ram_can_be_stopped_to_make_room_for_ram() -> None:
    ledger = one_host(ram=40, reserve=0)
    ledger.place("sleeper", Footprint(1, 70 * GiB, 2 * GiB, parked_ram=30 * GiB), "gpu1", (0,), "parked")
    result = plan(Request("cpu", Footprint(ram=20 * GiB)), ledger,
                  [Candidate("sleeper", "parked", 1)], NOW)
    assert result.victims == (Victim("sleeper", "stop"),)


def test_busy_deployment_is_never_a_victim_and_no_room_names_it() -> None:
    ledger = one_host()
    ledger.place("chat", Footprint(1, 70 * GiB, 2 * GiB), "gpu1", (0,), "ready")
    with pytest.raises(NoRoom) as info:
        plan(Request("new", Footprint(1, 40 * GiB)), ledger, [ready("chat", 1, busy=True)], NOW)
    err = info.value
    assert (err.code, err.status) == ("no_room", 503)
    assert "needs a GPU with 40.0 GiB free" in err.message
    assert "gpu:gpu1:0 10.0 GiB" in err.message
    assert "busy deployments: chat (70.0 GiB on gpu:gpu1:0" in err.message
    assert err.detail["hosts"]["gpu1"]["busy"] == ["chat (70.0 GiB on gpu:gpu1:0, 2.0 GiB on ram:gpu1)"]


def test_never_evict_deployment_is_never_a_victim() -> None:
    ledger = one_host()
    ledger.place("pinned", Footprint(1, 70 * GiB), "gpu1", (0,), "ready")
    with pytest.raises(NoRoom) as info:
        plan(Request("new", Footprint(1, 40 * GiB)), ledger, [ready("pinned", 1, never_evict=True)], NOW)
    assert "never evicted deployments: pinned" in info.value.message


def test_pending_release_blocks_until_confirmed() -> None:
    ledger = one_host()
    ledger.place("old", Footprint(1, 70 * GiB), "gpu1", (0,), "ready")
    ledger.set_state("old", "stopped")
    request = Request("new", Footprint(1, 40 * GiB))
    with pytest.raises(NoRoom) as info:
        plan(request, ledger, [Candidate("old", "stopped", 1)], NOW)
    assert "not yet confirmed released: old (70.0 GiB on gpu:gpu1:0)" in info.value.message
    ledger.confirm_released("old")
    assert plan(request, ledger, [Candidate("old", "stopped", 1)], NOW).victims == ()


def test_applied_plan_charges_the_new_deployment_and_releases_victims_once_confirmed() -> None:
    ledger = one_host()
    ledger.place("m", Footprint(1, 70 * GiB, 2 * GiB, parked_ram=20 * GiB), "gpu1", (0,), "ready")
    request = Request("new", Footprint(1, 60 * GiB, 4 * GiB))
    result = plan(request, ledger, [ready("m", 1)], NOW)
    ledger.apply(result, request)
    assert ledger.get("new").state == "starting" and ledger.get("m").parked_in_place
    assert ledger.overcommitted() == ["gpu:gpu1:0"]  # until the park is seen done
    ledger.confirm_released("m")
    assert ledger.overcommitted() == []
    assert ledger.charged("ram:gpu1") == 24 * GiB


def test_state_mismatch_between_controller_and_ledger_is_an_error() -> None:
    ledger = one_host()
    ledger.place("m", Footprint(1, 10 * GiB), "gpu1", (0,), "ready")
    with pytest.raises(CapyError) as info:
        plan(Request("new", Footprint(1, 10 * GiB)), ledger, [Candidate("m", "parked", 1)], NOW)
    assert info.value.code == "ledger_out_of_sync"


def test_a_deployment_that_holds_its_memory_keeps_its_place() -> None:
    ledger = one_host()
    ledger.place("m", Footprint(1, 10 * GiB), "gpu1", (0,), "ready")
    assert plan(Request("m", Footprint(1, 10 * GiB)), ledger, [], NOW) == Plan("m", "gpu1", (0,), ())


# -- idle parking ----------------------------------------------------------------------------------

def test_idle_to_park_lists_idle_ready_deployments_past_their_time_oldest_first() -> None:
    deployments = [
        Candidate("due", "ready", NOW - 700, idle_park_after=600),
        Candidate("older-due", "ready", NOW - 900, idle_park_after=600),
        Candidate("not-yet", "ready", NOW - 100, idle_park_after=600),
        Candidate("busy", "ready", NOW - 900, busy=True, idle_park_after=600),
        Candidate("pinned", "ready", NOW - 900, never_evict=True, idle_park_after=600),
        Candidate("no-timer", "ready", NOW - 9000),
        Candidate("already", "parked", NOW - 9000, idle_park_after=600),
    ]
    assert idle_to_park(deployments, NOW) == ["older-due", "due"]


def test_many_card_host_still_places_on_its_cheapest_identical_cards() -> None:
    # 16 cards taken 8 at a time are 12,870 sets: the planner tries only sets of the cheapest cards.
    ledger = Ledger([HostResources("big", 2048 * GiB, 0, tuple(GpuCard(i, "H100", 80 * GiB) for i in range(16)))])
    candidates = []
    for card in range(16):
        for j in range(3 if card < 8 else 2):  # cards 8-15 need one victim fewer each
            name = f"m{card}-{j}"
            ledger.place(name, Footprint(1, 20 * GiB), "big", (card,), "ready")
            candidates.append(ready(name, float(card * 3 + j)))
    request = Request("tp8", Footprint(8, 50 * GiB, 8 * GiB))
    result = plan(request, ledger, candidates, NOW)
    assert result.gpus == tuple(range(8, 16)) and len(result.victims) == 8
    ledger.apply(result, request)
    for victim in result.victims:
        ledger.confirm_released(victim.deployment)
    assert ledger.overcommitted() == []


def test_a_wake_in_place_does_not_lend_its_surplus_host_ram_to_a_victims_park() -> None:
    """A deployment parked in place holds more host RAM (its weights) than it needs awake. When it
    wakes, the surplus is pending release, not free, until the inventory confirms it: a victim
    parked in place to make room must not count on it. (Found by test_scheduler_properties.)"""
    ledger = one_host(cards=(("A100", 8),), ram=6, reserve=0)
    waking = Footprint(1, None, 1 * GiB, parked_ram=2 * GiB)  # the whole card awake, 2 GiB parked
    ledger.place("sleeper", waking, "gpu1", (0,), "parked", in_place=True)
    ledger.place("victim", Footprint(1, 2 * GiB, 1 * GiB, parked_ram=3 * GiB), "gpu1", (0,), "ready")
    ledger.place("other", Footprint(0, None, 2 * GiB), "gpu1", (), "ready")
    ledger.confirm_released("sleeper")
    assert ledger.free("ram:gpu1") == 1 * GiB
    candidates = [Candidate("sleeper", "parked", 1.0), ready("victim", 2.0), ready("other", 3.0, busy=True)]
    result = plan(Request("sleeper", waking), ledger, candidates, NOW)
    # Waking takes 1 GiB of the 2 it holds (1 GiB pending release); stopping the victim frees its
    # 1 GiB once confirmed: 2 GiB of RAM slack, too little for the victim's 3 GiB park.
    assert result.victims == (Victim("victim", "stop"),)
    after = ledger.copy()
    after.apply(result, Request("sleeper", waking))
    after.confirm_released("victim")
    assert after.overcommitted() == []


# -- waiting for room held by busy deployments (plan_when_idle) ------------------------------------

def test_plan_when_idle_names_the_busy_deployment_that_must_yield() -> None:
    from capyctl.scheduler import plan_when_idle
    ledger = one_host(cards=(), ram=8, reserve=4)  # 4 GiB: one of the two fits
    ledger.place("a", Footprint(0, None, 3 * GiB), "gpu1", (), "ready")
    candidates = [ready("a", 10.0, busy=True)]
    request = Request("b", Footprint(0, None, 3 * GiB))
    with pytest.raises(NoRoom):  # now: a is busy
        plan(request, ledger, candidates, NOW)
    later = plan_when_idle(request, ledger, candidates, NOW)
    assert later.victims == (Victim("a", "stop"),)


def test_plan_when_idle_waits_for_deployments_in_transition_too() -> None:
    from capyctl.scheduler import plan_when_idle
    ledger = one_host(cards=(), ram=8, reserve=4)
    ledger.place("a", Footprint(0, None, 3 * GiB), "gpu1", (), "waking")
    request = Request("b", Footprint(0, None, 3 * GiB))
    assert plan_when_idle(request, ledger, [Candidate("a", "waking", 10.0)], NOW).victims == (Victim("a", "stop"),)
    assert ledger.get("a").state == "waking"  # a what-if: the ledger itself is unchanged


def test_plan_when_idle_refuses_room_that_waiting_never_brings() -> None:
    from capyctl.scheduler import plan_when_idle
    ledger = one_host(cards=(), ram=8, reserve=4)
    ledger.place("a", Footprint(0, None, 3 * GiB), "gpu1", (), "ready")
    request = Request("b", Footprint(0, None, 3 * GiB))
    with pytest.raises(NoRoom):  # park: never
        plan_when_idle(request, ledger, [ready("a", 10.0, busy=True, never_evict=True)], NOW)
    with pytest.raises(NoRoom):  # larger than the host
        plan_when_idle(Request("c", Footprint(0, None, 5 * GiB)), ledger, [ready("a", 10.0, busy=True)], NOW)

"""Cores as a scheduler resource: counted like memory on ``cpu:<host>``, and which cores each
deployment holds chosen by the ledger so that two never share one."""

from __future__ import annotations

import pytest

from capyctl.errors import CapyError
from capyctl.scheduler import Candidate, Footprint, HostResources, Ledger, NoRoom, Request, plan

GiB = 1 << 30
NOW = 1000.0


def cpu_host(cores: int = 4, reserve: int = 0, smt: int = 1) -> Ledger:
    """A CPU host whose core i has the CPU ids i, i + cores, ... (the kernel's usual SMT numbering)."""
    listed = tuple(tuple(i + t * cores for t in range(smt)) for i in range(cores))
    return Ledger([HostResources("cpu1", 64 * GiB, 0, (), listed, reserve)])


def fp(cores: int, ram: int = 1, parked_ram: int | None = None) -> Footprint:
    return Footprint(ram=ram * GiB, cores=cores, parked_ram=parked_ram)


def test_the_core_domain_counts_the_cores_left_after_the_reserve() -> None:
    ledger = cpu_host(cores=4, reserve=1)
    assert ledger.domains["cpu:cpu1"].capacity == 3
    assert ledger.host_cores("cpu1") == ((1,), (2,), (3,))  # the first core is kept for the daemon


def test_a_host_without_known_cores_has_no_core_domain_and_plans_none() -> None:
    ledger = Ledger([HostResources("h", 64 * GiB)])
    assert "cpu:h" not in ledger.domains
    ledger.place("m", fp(2), "h", (), "ready")
    assert ledger.cores_of("m") == ()


def test_two_running_deployments_get_disjoint_cores() -> None:
    ledger = cpu_host(cores=4)
    ledger.place("a", fp(2), "cpu1", (), "ready")
    ledger.place("b", fp(1), "cpu1", (), "starting")
    a, b = ledger.cores_of("a"), ledger.cores_of("b")
    assert len(a) == 2 and len(b) == 1 and not set(a) & set(b)
    assert ledger.charged("cpu:cpu1") == 3 and ledger.free("cpu:cpu1") == 1


def test_a_core_is_all_its_hardware_threads() -> None:
    ledger = cpu_host(cores=2, smt=2)
    ledger.place("a", fp(1), "cpu1", (), "ready")
    assert ledger.get("a").cpus == (0, 2)


def test_cores_are_free_again_once_stopped_with_nothing_pending() -> None:
    ledger = cpu_host(cores=2)
    ledger.place("a", fp(2), "cpu1", (), "ready")
    ledger.set_state("a", "stopping")
    assert ledger.free("cpu:cpu1") == 0  # the process still runs on them
    ledger.set_state("a", "stopped")
    assert ledger.free("cpu:cpu1") == 2 and ledger.pending("cpu:cpu1") == {}


def test_a_deployment_parked_in_place_keeps_its_cores_and_wakes_on_them() -> None:
    ledger = cpu_host(cores=2)
    ledger.place("a", fp(1, parked_ram=1), "cpu1", (), "ready")
    mine = ledger.cores_of("a")
    ledger.set_state("a", "parked", in_place=True)
    ledger.place("b", fp(1), "cpu1", (), "ready")
    assert ledger.charged("cpu:cpu1") == 2 and not set(ledger.cores_of("b")) & set(mine)
    ledger.set_state("a", "waking")
    assert ledger.cores_of("a") == mine


def test_a_restart_keeps_its_cores_when_they_are_still_free_else_takes_free_ones() -> None:
    ledger = cpu_host(cores=3)
    ledger.place("a", fp(1), "cpu1", (), "ready")
    ledger.place("b", fp(1), "cpu1", (), "ready")
    b_cores = ledger.cores_of("b")
    ledger.set_state("b", "stopped")
    ledger.set_state("b", "starting")
    assert ledger.cores_of("b") == b_cores
    ledger.set_state("b", "stopped")
    ledger.place("c", fp(2), "cpu1", (), "ready")  # takes b's core and the free one
    ledger.set_state("b", "starting")  # not through a plan: over-committed, and it shows
    assert ledger.overcommitted() == ["cpu:cpu1"]


def test_adopted_cores_are_kept_when_free() -> None:
    ledger = cpu_host(cores=4)
    ledger.place("a", fp(2), "cpu1", (), "ready", cores=((2,), (3,)))
    assert ledger.get("a").cpus == (2, 3)


def test_a_corrected_footprint_keeps_the_cores() -> None:
    ledger = cpu_host(cores=4)
    ledger.place("a", fp(2), "cpu1", (), "ready")
    cores = ledger.cores_of("a")
    ledger.correct("a", ram=3 * GiB)
    assert ledger.cores_of("a") == cores and ledger.get("a").footprint.cores == 2


def test_a_host_listing_a_cpu_twice_is_refused() -> None:
    with pytest.raises(CapyError) as err:
        Ledger([HostResources("h", GiB, 0, (), ((0,), (0,)))])
    assert err.value.code == "invalid_host"


# -- the planner -------------------------------------------------------------------------------------

def test_two_deployments_that_fit_side_by_side_need_no_victim() -> None:
    ledger = cpu_host(cores=2)
    ledger.place("a", fp(1), "cpu1", (), "ready")
    result = plan(Request("b", fp(1)), ledger, [Candidate("a", "ready", NOW - 10)], NOW)
    assert result.victims == ()


def test_cores_alone_make_an_idle_deployment_a_victim() -> None:
    ledger = cpu_host(cores=2)
    ledger.place("a", fp(1), "cpu1", (), "ready")
    ledger.place("b", fp(1), "cpu1", (), "ready")
    candidates = [Candidate("a", "ready", NOW - 50), Candidate("b", "ready", NOW - 10)]
    result = plan(Request("c", fp(1)), ledger, candidates, NOW)
    assert [v.deployment for v in result.victims] == ["a"]  # least recently used
    ledger.apply(result, Request("c", fp(1)))
    assert ledger.cores_of("c") == ledger.cores_of("a")  # its core, now free


def test_more_cores_than_the_host_has_is_no_room_in_cores() -> None:
    ledger = cpu_host(cores=2)
    with pytest.raises(NoRoom) as err:
        plan(Request("big", fp(3)), ledger, [], NOW)
    assert "3 cores" in err.value.message and "cpu:cpu1 2 cores" in err.value.message
    assert err.value.detail["needs"]["cores"] == 3


def test_a_busy_holder_of_the_cores_is_named_in_no_room() -> None:
    ledger = cpu_host(cores=1)
    ledger.place("a", fp(1), "cpu1", (), "ready")
    with pytest.raises(NoRoom) as err:
        plan(Request("b", fp(1)), ledger, [Candidate("a", "ready", NOW, busy=True)], NOW)
    assert "a (1 core on cpu:cpu1, " in err.value.message

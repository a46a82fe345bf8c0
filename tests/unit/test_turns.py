"""Taking turns (capyctl/controller/_turns.py): a wake whose room busy deployments hold waits for
it instead of failing, deployments that cannot be resident together are served in batches, and
no deployment waits for room past ``swap.wait_max``.

The real Controller and actors run here over a systemd that records the units it is asked to
start and stop, with one card from a fake NVML (tests/fakes/fake_nvml.py) and two vLLM-shaped
deployments that each need most of it. The engine's own start is the one thing skipped (its health
check and the proof, which need a served model): tests/integration/test_turns_llama.py runs the
same with the real llama-server on a RAM budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

import pytest

from capyctl.config import DaemonConfig
from capyctl.controller import _controller
from capyctl.controller._actor import DeploymentActor
from capyctl.controller._proof import WakeProof
from capyctl.controller._timeline import (EVICT, FIRST_ANSWER, HEALTH, PARK, UNIT_START, UNIT_STOP, WAIT_FOR_PARK,
                                          WAIT_FOR_ROOM, WAKE, Clocks, Timeline)
from capyctl.controller._turns import RoomWaitTimeout, WakeCancelled
from capyctl.errors import Unavailable
from capyctl.spec import parse_manifest
from tests.controllers import RecordingSystemd, vllm_controller

GiB = 1 << 30
HANG_GUARD = 20.0
REAL_PROVE_AFTER_REQUESTS = WakeProof.after_requests


@pytest.fixture
async def one_card(tmp_path, monkeypatch):
    """A Controller over one fake 80 GiB card, vLLM registered, and a model directory."""
    from tests.fakes.fake_nvml import FakeDevice, FakeNvml

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([FakeDevice("NVIDIA H100 80GB HBM3", "GPU-h100",
                                                                    minor=0, total=80 * GiB)]))

    async def healthy(self, progress, timeout):
        await asyncio.sleep(0.05)  # an engine that loads its model in 50 ms

    async def proven(self, *args, **kwargs):
        return None

    monkeypatch.setattr(DeploymentActor, "_wait_healthy", healthy)
    monkeypatch.setattr(WakeProof, "check", proven)
    monkeypatch.setattr(WakeProof, "after_requests", lambda self, seconds: None)
    config = DaemonConfig()
    config.swap_quantum, config.swap_wait_max = 0.3, 3.0
    monkeypatch.setenv("CAPYCTL_ARM_PARKED", "0")
    systemd = RecordingSystemd()
    async with vllm_controller(tmp_path, systemd, config) as (ctl, model):
        yield ctl, systemd, model


async def _deploy(ctl, model, name: str, extra: str = ""):
    return await ctl.deploy(parse_manifest(
        f"name: {name}\nengine: vllm\nmodel: {{path: {model}}}\n"
        f"resources: {{gpus: 1, gpu_memory: 50GiB, ram: 2GiB}}\npark: stop\n{extra}"))


async def _until(condition, timeout: float = HANG_GUARD) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _served(ctl, name: str) -> None:
    """One request to ``name``, let in and done."""
    async with ctl.acquire(name):
        pass


class _Clock:
    """The clock a wait in line is measured with (Turns.clock), moved only by the test: the
    quantum and swap.wait_max pass when the test says, however slow the machine is."""

    def __init__(self) -> None:
        self.now = 1024.0  # (binary fractions added to it stay exact: 1024.75 - 1024 == 0.75)

    def __call__(self) -> float:
        return self.now


def _count_looks(ctl) -> list[str]:
    """Each look a wake waiting for room takes at the plan ends in Turns.yield_to: the names of
    those that looked, in order. A look reads the clock and checks swap.wait_max in one step, so
    a look counted after the test moved the clock saw the new time."""
    looks: list[str] = []
    yield_to = ctl.turns.yield_to

    def counted(name, *args, **kwargs):
        looks.append(name)
        return yield_to(name, *args, **kwargs)

    ctl.turns.yield_to = counted
    return looks


async def _look_again(ctl, looks: list[str], name: str) -> None:
    """Until ``name`` has looked at the plan again (a beat asks it to at once)."""
    before = looks.count(name)
    ctl.turns.changed()
    await _until(lambda: looks.count(name) > before)


@contextlib.asynccontextmanager
async def _one_request_in_flight(ctl, actor):
    """One request to ``actor`` in flight while the block runs: its model is never idle."""
    done = asyncio.Event()

    async def hold():
        async with ctl.acquire(actor.name):
            await done.wait()

    holder = asyncio.create_task(hold())
    try:
        await _until(lambda: actor.state == "ready" and actor.in_flight > 0)
        yield
    finally:
        done.set()
        await holder


class _Clients:
    """Clients that each send requests to their models in turn, for a while, and record what
    they got: (model, start, end, error code or None)."""

    def __init__(self, ctl, hold: float = 0.05, starts=None) -> None:
        self.ctl = ctl
        self.hold = hold
        self.answers: list[tuple[str, float, float, str | None]] = []
        self.entered: list[tuple[float, float, str]] = []  # (let in, began, model) of each request
        self.progress: dict[str, list[str]] = {}
        # With ``starts`` (how many engine starts so far): how many each request waited through.
        self.starts = starts
        self.starts_waited: list[tuple[str, int]] = []

    async def one(self, model: str) -> None:
        began = time.monotonic()
        starts_before = self.starts() if self.starts else 0
        lines = self.progress.setdefault(model, [])
        try:
            async with self.ctl.acquire(model, progress=lines.append):
                self.entered.append((time.monotonic(), began, model))
                if self.starts:
                    self.starts_waited.append((model, self.starts() - starts_before))
                await asyncio.sleep(self.hold)
        except Exception as exc:  # recorded: the test asserts there are none
            self.answers.append((model, began, time.monotonic(), getattr(exc, "code", repr(exc))))
        else:
            self.answers.append((model, began, time.monotonic(), None))

    async def run(self, models: list[str], seconds: float) -> None:
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            await self.one(models[i % len(models)])
            i += 1

    async def run_until(self, models: list[str], done: asyncio.Event) -> None:
        i = 0
        while not done.is_set():
            await self.one(models[i % len(models)])
            i += 1


async def test_a_wake_whose_room_a_busy_deployment_holds_waits_and_is_served_after_a_swap(one_card):
    ctl, systemd, model = one_card
    a = await _deploy(ctl, model, "a")
    b = await _deploy(ctl, model, "b")
    clients = _Clients(ctl)
    # a is resident and never idle: two clients keep a request in flight until the test is done
    # with them. So b is served only if a yields its turn while its clients still want it (were b
    # to wait for a's clients to stop, it would wait past HANG_GUARD).
    done = asyncio.Event()
    busy_a = [asyncio.create_task(clients.run_until(["a"], done)) for _ in range(2)]
    try:
        await _until(lambda: a.state == "ready")
        assert a.busy
        began = time.monotonic()
        await asyncio.wait_for(clients.one("b"), HANG_GUARD)
        waited = time.monotonic() - began
        assert not any(task.done() for task in busy_a)
        # a's clients were held at its door meanwhile, and are served again once it is b's turn no more.
        b_answered = len(clients.answers)
        await _until(lambda: any(m == "a" for m, *_ in clients.answers[b_answered:]))
    finally:
        done.set()
        await asyncio.wait_for(asyncio.gather(*busy_a), HANG_GUARD)

    assert [code for *_, code in clients.answers if code] == []
    assert [m for m, *_, code in clients.answers if m == "b"] == ["b"]
    # It waited for a's quantum to pass (a lower bound: a slow machine only makes it longer).
    assert ctl.config.swap_quantum <= waited
    assert b.state != "failed" and "failed" not in {a.state, b.state}
    assert ("stop", "capyctl-a.service") in systemd.events
    assert any(line.startswith("waking b: waiting for room held by a") for line in clients.progress["b"])


async def test_two_models_used_at_once_are_served_in_batches_with_no_failure(one_card):
    ctl, systemd, model = one_card
    await _deploy(ctl, model, "a")
    await _deploy(ctl, model, "b")
    clients = _Clients(ctl, starts=lambda: sum(1 for e in systemd.events if e[0] == "start"))
    await asyncio.wait_for(asyncio.gather(*(clients.run(["a", "b"] if i % 2 else ["b", "a"], 4.0)
                                            for i in range(8))), HANG_GUARD)
    codes = [code for *_, code in clients.answers if code]
    assert codes == []  # none waited past swap.wait_max: that is a 503 room_wait_timeout
    per_model = {m: sum(1 for name, *_ in clients.answers if name == m) for m in ("a", "b")}
    assert min(per_model.values()) >= len(clients.answers) / 5, per_model
    starts = [e for e in systemd.events if e[0] == "start"]
    # Batches: far fewer swaps than answers (one swap a request would be one start each).
    assert 2 <= len(starts) <= len(clients.answers) / 4, (len(starts), len(clients.answers))
    # Nobody is starved: a request waits at most for the other model's turn and then its own
    # model's start (its door closed for the other: that one starts, then its own), never through
    # more turns, however slow the machine. Counted in starts, not seconds.
    assert len(clients.starts_waited) == len(clients.answers)
    assert max(waited for _, waited in clients.starts_waited) <= 2, clients.starts_waited


async def test_past_the_bound_the_wait_ends_with_a_clear_503_and_the_deployment_is_not_failed(one_card):
    ctl, systemd, model = one_card
    ctl.config.swap_wait_max = 0.75
    clock = ctl.turns.clock = _Clock()  # the wait's time passes when the test moves it
    looks = _count_looks(ctl)
    a = await _deploy(ctl, model, "a")
    b = await _deploy(ctl, model, "b")
    async with _one_request_in_flight(ctl, a):
        waiting = asyncio.ensure_future(_served(ctl, "b"))
        await _until(lambda: ctl.turns.in_line("b"))
        joined = ctl.turns.waiting()["b"]
        clock.now = joined + 0.74  # past the quantum, just short of the bound: b waits on
        await _look_again(ctl, looks, "b")
        assert ctl.turns.in_line("b") and not waiting.done()
        clock.now = joined + 0.75  # the bound: the next look ends the wait
        ctl.turns.changed()
        with pytest.raises(RoomWaitTimeout) as caught:
            await asyncio.wait_for(waiting, HANG_GUARD)
        assert caught.value.code == "room_wait_timeout" and caught.value.status == 503
        assert caught.value.retry_after and caught.value.retry_after >= 1
        assert "waited" in caught.value.message and "swap.wait_max" in caught.value.message
        assert caught.value.detail == {"waited": 0.75}  # as the clock says: at the bound, not after
        assert b.state == "stopped" and a.state == "ready"
    # And once a is idle, b is served.
    async with ctl.acquire("b"):
        assert b.state == "ready"


async def test_room_that_waiting_never_brings_still_fails_at_once(one_card):
    ctl, systemd, model = one_card
    await _deploy(ctl, model, "a", "")
    big = await ctl.deploy(parse_manifest(
        f"name: big\nengine: vllm\nmodel: {{path: {model}}}\nresources: {{gpus: 1, gpu_memory: 90GiB, ram: 2GiB}}\n"))
    ctl.turns.clock = _Clock()  # stands still: a wait in line would never reach its bound
    looks = _count_looks(ctl)
    lines: list[str] = []
    with pytest.raises(Unavailable) as caught:
        await asyncio.wait_for(ctl.acquire("big", progress=lines.append).__aenter__(), HANG_GUARD)
    assert caught.value.code == "wake_failed" and caught.value.detail["cause"] == "no_room"
    # At once: it never joined the line nor waited for room.
    assert looks == [] and not ctl.turns.in_line("big") and not any("waiting for room" in x for x in lines)
    assert big.state == "failed"


async def test_in_arrival_order_each_change_of_model_is_a_swap(one_card):
    """The baseline benchmarks/contention.py compares batches with: requests served as they came."""
    ctl, systemd, model = one_card
    ctl.config.swap_order = "arrival"
    await _deploy(ctl, model, "a")
    await _deploy(ctl, model, "b")
    clients = _Clients(ctl)
    await asyncio.wait_for(asyncio.gather(*(clients.run(["a", "b"] if i % 2 else ["b", "a"], 3.0)
                                            for i in range(8))), HANG_GUARD)
    arrival_starts = sum(1 for e in systemd.events if e[0] == "start")
    assert [code for *_, code in clients.answers if code] == []
    assert arrival_starts >= 4


async def test_in_arrival_order_clients_started_one_after_another_are_let_in_as_they_came(one_card):
    """Clients started one after the other on alternating models, as benchmarks/contention.py starts
    them: the models are let in in the order their requests came, which is nearly a change of model
    a request. The same in every run, which is what lets the benchmark's arrival-order runs be
    compared (started at once, they raced for the first turn and fell into batches in some runs)."""
    ctl, systemd, model = one_card
    ctl.config.swap_order = "arrival"
    await _deploy(ctl, model, "a")
    await _deploy(ctl, model, "b")
    clients = _Clients(ctl)

    async def client(i: int) -> None:
        await asyncio.sleep(i * 0.05)
        await clients.run(["a", "b"] if i % 2 == 0 else ["b", "a"], 2.0)

    await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(4))), HANG_GUARD)
    assert [code for *_, code in clients.answers if code] == []
    let_in = [m for _, _, m in sorted(clients.entered)]
    came = [m for _, m in sorted((began, m) for _, began, m in clients.entered)]
    assert len(let_in) >= 8 and let_in == came
    changes = sum(1 for x, y in zip(let_in, let_in[1:]) if x != y)
    assert changes >= len(let_in) // 2, let_in  # batches would be a change each 4 requests


async def test_a_wait_for_room_gives_way_to_a_stop_but_not_to_another_wake(one_card):
    ctl, systemd, model = one_card
    ctl.config.swap_quantum = 60.0  # a never yields here
    a = await _deploy(ctl, model, "a")
    b = await _deploy(ctl, model, "b")
    async with _one_request_in_flight(ctl, a):
        waiting = asyncio.ensure_future(ctl.acquire("b").__aenter__())
        await _until(lambda: ctl.turns.in_line("b"))
        status = await ctl.describe("b")  # what `capyctl status deployment b` shows
        assert status["waiting_for_room"]["ahead"] == 0 and status["waiting_for_room"]["seconds"] >= 0
        assert (await ctl.describe("a"))["waiting_for_room"] is None
        second = b.submit("wake")  # as `capyctl wake b` does: joins, does not cancel
        await asyncio.sleep(0.3)
        assert not waiting.done() and ctl.turns.in_line("b")
        stop = b.submit("stop")
        with pytest.raises(WakeCancelled) as caught:
            await asyncio.wait_for(waiting, HANG_GUARD)
        assert caught.value.code == "wake_cancelled"
        await asyncio.wait_for(stop, HANG_GUARD)
        assert b.state == "stopped" and not ctl.turns.in_line("b")
        second.cancel()


async def test_a_wake_whose_requests_all_left_stops_waiting_and_evicts_nobody(one_card, monkeypatch):
    ctl, systemd, model = one_card
    # Only the client's leaving can end b's wait: the bound never passes and the periodic look is
    # an hour apart (were b to wait for either, it would still be in line at HANG_GUARD).
    ctl.config.swap_quantum, ctl.config.swap_wait_max = 0.2, 3600.0
    clock = ctl.turns.clock = _Clock()
    monkeypatch.setattr(_controller, "ROOM_RECHECK_S", 3600.0)
    looks = _count_looks(ctl)
    a = await _deploy(ctl, model, "a")
    b = await _deploy(ctl, model, "b")
    async with _one_request_in_flight(ctl, a):
        client = asyncio.ensure_future(ctl.acquire("b").__aenter__())
        await _until(lambda: ctl.turns.in_line("b"))
        clock.now = ctl.turns.waiting()["b"] + 0.2  # b waited its quantum: a's door closes for it
        await _look_again(ctl, looks, "b")
        assert (await ctl.describe("a"))["door"] == "closed"
        client.cancel()  # the only client waiting for b gives up
        await _until(lambda: not ctl.turns.in_line("b"))
        assert b.state == "stopped" and b.waiting == 0
        assert (await ctl.describe("a"))["door"] == "open"  # a's clients are not held for nobody
    await asyncio.sleep(0.3)
    assert a.state == "ready" and ("stop", "capyctl-a.service") not in systemd.events


async def _parked(ctl, model, name):
    actor = await _deploy(ctl, model, name)
    async with ctl.acquire(name):
        pass
    await actor.submit("park")
    assert actor.state == "parked"
    return actor


async def test_the_end_of_a_proof_after_a_wake_lets_a_waiting_wake_go_on_at_once(one_card, monkeypatch):
    """The proof after a restart wake counts as a request in flight; when it ends, a wake waiting
    for its room must hear of it at once, not at its next periodic look (it waited a second)."""
    ctl, systemd, model = one_card
    # Only the proof's end can end b's wait: the quantum and the bound never pass (the clock stands
    # still, and their timers are an hour away) and the periodic look is an hour apart. Were b to
    # wait for any of them, it would wait past HANG_GUARD.
    ctl.config.swap_quantum, ctl.config.swap_wait_max = 3600.0, 3600.0
    ctl.turns.clock = _Clock()
    monkeypatch.setattr(_controller, "ROOM_RECHECK_S", 3600.0)
    proofs = []
    proof_may_end = asyncio.Event()

    async def slow_proof(self, woken_from_park, *args, **kwargs):
        if woken_from_park:
            proofs.append(self.deployment_name)
            await proof_may_end.wait()

    monkeypatch.setattr(WakeProof, "after_requests", REAL_PROVE_AFTER_REQUESTS)
    monkeypatch.setattr(WakeProof, "check", slow_proof)
    a = await _parked(ctl, model, "a")
    await _deploy(ctl, model, "b")
    async with ctl.acquire("a"):  # a wakes by restart: its proof follows this request
        pass
    await _until(lambda: proofs == ["a"])
    b_served = asyncio.ensure_future(_served(ctl, "b"))  # waits for a's proof, then a's room
    await _until(lambda: ctl.turns.in_line("b"))
    assert not b_served.done()
    proof_may_end.set()
    await asyncio.wait_for(b_served, HANG_GUARD)
    assert a.state == "parked"


async def test_a_deployment_is_deleted_while_the_proof_after_its_wake_runs(one_card, monkeypatch):
    # The proof counts as a request in flight so that a park or stop drains it, but it is no client's:
    # a delete right after a wake's answer must not be refused as "requests in flight" (it was, in
    # tests/integration/test_vllm_real.py, whose vLLM proof takes a while on CPU).
    ctl, systemd, model = one_card
    proving = asyncio.Event()

    async def slow_proof(self, woken_from_park, *args, **kwargs):
        if woken_from_park:
            proving.set()
            await asyncio.sleep(0.3)

    monkeypatch.setattr(WakeProof, "after_requests", REAL_PROVE_AFTER_REQUESTS)
    monkeypatch.setattr(WakeProof, "check", slow_proof)
    a = await _parked(ctl, model, "a")
    async with ctl.acquire("a"):  # a wakes by restart: its proof follows this request
        pass
    await asyncio.wait_for(proving.wait(), HANG_GUARD)
    assert a.busy and not a.requests.serving_clients
    await asyncio.wait_for(ctl.delete("a"), HANG_GUARD)
    assert "a" not in ctl.actors


async def test_the_proof_after_a_wake_is_deferred_while_another_deployment_waits(one_card, monkeypatch):
    ctl, systemd, model = one_card
    ctl.config.swap_quantum = 30.0
    proofs = []

    async def proof(self, woken_from_park, *args, **kwargs):
        if woken_from_park:  # (a cold start records its reference through the same call)
            proofs.append(self.deployment_name)

    monkeypatch.setattr(WakeProof, "after_requests", REAL_PROVE_AFTER_REQUESTS)
    monkeypatch.setattr(WakeProof, "check", proof)
    a = await _parked(ctl, model, "a")
    await _deploy(ctl, model, "b")
    release = asyncio.Event()

    async def one_request_to_a():
        async with ctl.acquire("a"):
            await release.wait()

    first = asyncio.create_task(one_request_to_a())  # a wakes by restart, its proof waits for this request
    await _until(lambda: a.state == "ready")
    waiting = asyncio.ensure_future(ctl.acquire("b").__aenter__())
    await _until(lambda: ctl.turns.in_line("b"))
    release.set()
    await first
    await asyncio.wait_for(waiting, HANG_GUARD)  # served: a was evicted without holding b up
    assert proofs == []
    assert a.park_record["proof"]["result"] == "skipped"
    assert a.park_record["proof"]["reason"] == "another deployment waited for room"


async def test_a_swap_records_its_phases_from_the_last_answer_to_the_first(one_card):
    """The incoming wake's timeline holds its phases in order, ends at its first answer, and carries
    the evicted deployment's park timeline from that one's last answer (controller/_timeline.py);
    /metrics' histograms observe each phase and the swap."""
    ctl, systemd, model = one_card
    a = await _deploy(ctl, model, "a")
    b = await _deploy(ctl, model, "b")
    async with _one_request_in_flight(ctl, a):
        wanted = asyncio.create_task(_Clients(ctl).one("b"))
        await _until(lambda: not a.requests.door_open)  # b waited its quantum: a's door closed for it
    await asyncio.wait_for(wanted, HANG_GUARD)

    wake = b.park_record["last_wake"]
    names = [p["phase"] for p in wake["phases"]]
    assert names[-1] == "first answer", names
    for phase in ("wait for room", "evict", "make room", "prepare", "credentials and confinement", "unit start", "health"):
        assert phase in names, names
    starts = [p["at"] for p in wake["phases"]]
    assert starts == sorted(starts)
    assert wake["seconds"] == pytest.approx(sum(p["seconds"] for p in wake["phases"]), abs=1e-5)

    [evicted] = wake["evicted"]
    assert evicted["deployment"] == "a" and evicted == {"deployment": "a", **a.park_record["last_park"]}
    assert [p["phase"] for p in evicted["phases"]] == ["wait for park", "drain", "save prompt cache", "unit stop"]
    last_answer, door_closed = evicted["marks"]["last answer"], evicted["marks"]["door closed"]
    assert door_closed <= last_answer <= evicted["phases"][1]["at"]
    # The swap holds a's park (from its last answer) and b's phases after the evict, which came
    # after it; b's wake began before a's last answer. (Its arithmetic, on a clock the test moves:
    # test_a_swap_lasts_from_the_first_evicted_last_answer_to_the_incoming_first_answer.)
    after_evict = sum(p["seconds"] for p in wake["phases"][names.index("evict") + 1:])
    assert evicted["seconds"] + after_evict - 1e-3 <= wake["swap_seconds"] < wake["seconds"]

    durations = ctl.phase_durations()
    assert durations[("b", "wake", "health")].count == 1
    assert durations[("a", "park", "unit stop")].count == 1
    assert durations[("b", "swap", "last answer to first answer")].count == 1
    from capyctl.proxy._metrics import ProxyMetrics
    text = ProxyMetrics().render({}, phase_durations=durations).decode()
    assert 'capyctl_phase_duration_seconds_count{deployment="b",kind="swap",phase="last answer to first answer"} 1.0' \
        in text


async def test_a_wake_nobody_asks_anything_of_ends_its_timeline_at_its_next_park(one_card):
    ctl, systemd, model = one_card
    a = await _deploy(ctl, model, "a")
    await a.submit("wake")
    assert "last_wake" not in a.park_record  # open until its first answer
    await a.submit("park")
    wake, park = a.park_record["last_wake"], a.park_record["last_park"]
    assert "first answer" not in [p["phase"] for p in wake["phases"]] and "evicted" not in wake
    # A park nobody evicted begins at its command, not at the last answer, and seals its next key.
    assert [p["phase"] for p in park["phases"]] == ["drain", "save prompt cache", "unit stop", "arm"]
    assert "marks" not in park


class _TimelineClocks:
    """A timeline's clocks, moved together and only by the test: ``t`` seconds in, the wall clock
    reads 1024 + t and the monotonic clock t (binary fractions, so that every sum is exact)."""

    def __init__(self) -> None:
        self.t = 0.0
        self.clocks = Clocks(wall=lambda: 1024.0 + self.t, monotonic=lambda: self.t)


def test_a_swap_lasts_from_the_first_evicted_last_answer_to_the_incoming_first_answer():
    clock = _TimelineClocks()
    wake = Timeline(WAKE, clocks=clock.clocks)  # b's wake, asked at 1024.0
    clock.t = 1.0
    wake.lap(WAIT_FOR_ROOM)
    # c answered last at 1024.75 and a at 1024.5; c is evicted first (parked by 1025.5), then a
    # (by 1026.0). Each park's timeline begins at its deployment's last answer, as _actor.py's does.
    for name, last_answer, stopped in (("c", 1024.75, 1.5), ("a", 1024.5, 2.0)):
        park = Timeline(PARK, began_at=last_answer, clocks=clock.clocks)
        park.mark("last answer", last_answer)
        park.lap(WAIT_FOR_PARK)
        clock.t = stopped
        park.lap(UNIT_STOP)
        wake.evicted.append({"deployment": name, **park.record()})
    wake.lap(EVICT)
    for t, phase in ((2.25, UNIT_START), (3.0, HEALTH), (3.25, FIRST_ANSWER)):  # b answers first at 1027.25
        clock.t = t
        wake.lap(phase)

    record = wake.record()
    assert record["swap_seconds"] == 2.75  # 1027.25, b's first answer, less 1024.5, a's last one
    assert record["at"] == 1024.0 and record["seconds"] == 3.25
    assert [(p["phase"], p["at"], p["seconds"]) for p in record["phases"]] == [
        ("wait for room", 1024.0, 1.0), ("evict", 1025.0, 1.0), ("unit start", 1026.0, 0.25),
        ("health", 1026.25, 0.75), ("first answer", 1027.0, 0.25)]
    c, a = record["evicted"]
    assert (c["deployment"], c["at"], c["marks"]) == ("c", 1024.75, {"last answer": 1024.75})
    assert [(p["phase"], p["at"], p["seconds"]) for p in c["phases"]] == [
        ("wait for park", 1024.75, 0.25), ("unit stop", 1025.0, 0.5)]
    assert [(p["phase"], p["at"], p["seconds"]) for p in a["phases"]] == [
        ("wait for park", 1024.5, 1.0), ("unit stop", 1025.5, 0.5)]
    # Without its first answer, a wake has no swap to tell of yet.
    unanswered = Timeline(WAKE, clocks=clock.clocks)
    unanswered.evicted.append(a)
    assert "swap_seconds" not in unanswered.record()


def test_a_phase_lapped_again_in_a_row_is_one_entry():
    timeline = Timeline()
    for _ in range(50):  # a long wait for room, looked at again and again
        timeline.lap("wait for room")
    timeline.lap("evict")
    timeline.lap("wait for room")
    assert [p["phase"] for p in timeline.phases] == ["wait for room", "evict", "wait for room"]
    assert timeline.stages["wait for room"] == pytest.approx(timeline.phases[0]["seconds"] + timeline.phases[2]["seconds"])


async def test_a_replica_added_for_load_never_makes_a_busy_deployment_yield(one_card):
    # The card holds one of these engines. r's first replica is woken by its request and may take
    # its turn; a second one, added for load or to keep min, takes only free or idle room: it must
    # not close the door of a (busy, resident) and make it yield (capyctl/controller/_replicas.py).
    ctl, systemd, model = one_card
    a = await _deploy(ctl, model, "a")
    r = await _deploy(ctl, model, "r", "replicas: {min: 2, max: 2}\n")
    second = ctl.get("r@2")
    async with _one_request_in_flight(ctl, a):
        with pytest.raises(RoomWaitTimeout, match="added for load only where room is free"):
            await second.submit("wake", room_now_only=True)
        assert a.requests.door_open and a.state == "ready" and second.state == "stopped"
        assert ("stop", "capyctl-a.service") not in systemd.events
    # Idle, a is evicted for r's first replica as any deployment is; then min brings the second only
    # where room is free: none here, so it is decided, refused without waiting, and left stopped.
    await _served(ctl, "r")
    assert r.state == "ready" and a.state in ("parked", "stopped")
    ctl.scale_replicas()
    await _until(lambda: not second.has_pending_commands)
    assert second.state == "stopped" and r.state == "ready"
    assert ctl.stats()["r@2"]["scaled_min"] == 1

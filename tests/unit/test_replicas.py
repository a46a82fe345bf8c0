"""Routing and scaling among a deployment's replicas (capyctl/controller/_replicas.py), and the prompt
text the proxy hands it (capyctl/proxy/_prompt_prefix.py): pure, with replicas as plain objects."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from capyctl.config import replica_name, replica_of
from capyctl.controller._lifecycle import DeploymentState
from capyctl.controller import _replicas as replicas_module
from capyctl.controller._replicas import (DECISION_RETRY_S, PREFIX_BLOCK_CHARS, SUSPECT_S, PrefixIndex, ReplicaSet,
                                          prefix_hashes)
from capyctl.proxy._prompt_prefix import routing_prompt
from capyctl.spec import DeploymentSpec

READY, PARKED, STOPPED, FAILED, STARTING = (DeploymentState.READY, DeploymentState.PARKED, DeploymentState.STOPPED,
                                            DeploymentState.FAILED, DeploymentState.STARTING)


@dataclass
class Door:
    door_open: bool = True


@dataclass
class FakeReplica:
    name: str
    spec: DeploymentSpec
    state: DeploymentState = READY
    in_flight: int = 0
    waiting: int = 0
    last_used: float = 0.0
    ready_since: float = 0.0
    launch_id: str | None = "launch-1"
    has_pending_commands: bool = False
    requests: Door = field(default_factory=Door)
    backoff: float = 0.0

    @property
    def busy(self) -> bool:
        return self.in_flight + self.waiting > 0

    def backoff_left(self) -> float:
        return self.backoff


def replica_set(replicas: int | dict = 2, count: int | None = None) -> tuple[ReplicaSet, list[FakeReplica]]:
    """``replicas`` as a manifest's field has it: a count, or a mapping (min, max, ...)."""
    spec = DeploymentSpec.model_validate({"name": "chat", "engine": "llama.cpp", "model": {"path": "/m.gguf"},
                                          "replicas": replicas})
    rs = ReplicaSet("chat")
    members = [FakeReplica(replica_name("chat", i), spec) for i in range(1, (count or spec.replicas.max) + 1)]
    for i, m in enumerate(members, 1):
        rs.members[i] = m
    return rs, members


PROMPT = "system:" + "x" * (PREFIX_BLOCK_CHARS * 4)


def conversation(n: int, turns: int = 1) -> str:
    return PROMPT + "".join(f"\x1euser:conversation {n} turn {t} " + "y" * PREFIX_BLOCK_CHARS for t in range(turns))


def test_replica_names_round_trip():
    assert replica_name("chat", 1) == "chat" and replica_name("chat", 3) == "chat@3"
    assert replica_of("chat@3") == ("chat", 3) and replica_of("chat") == ("chat", 1)
    assert replica_of("chat@x") == ("chat@x", 1)  # not a replica's name


def test_prefix_hashes_chain_whole_blocks_only():
    short = prefix_hashes("a" * (PREFIX_BLOCK_CHARS - 1))
    assert short == () and prefix_hashes(None) == ()
    one, two = prefix_hashes(PROMPT), prefix_hashes(PROMPT + "z" * PREFIX_BLOCK_CHARS)
    assert len(one) == 4 and two[:4] == one and len(two) == 5
    # A hash names the whole prefix: the same block after another prefix hashes differently.
    assert prefix_hashes("b" * PREFIX_BLOCK_CHARS + "x" * PREFIX_BLOCK_CHARS)[1] != one[1]


def test_the_index_is_bounded_and_forgets_a_replica():
    first, second, third = (prefix_hashes(conversation(n, 2)) for n in (1, 2, 3))
    assert len(first) == 6 and first[:4] == second[:4] and first[4] != second[4]
    index = PrefixIndex(capacity=8)
    index.record(first, "chat")
    index.record(second, "chat@2")
    assert len(index) == 8  # the shared system prompt's 4 blocks once
    assert index.depths(first) == {"chat": 6, "chat@2": 4}
    index.record(third, "chat")
    assert len(index) == 8  # bounded: conversation 1's own blocks, the least recently used, are gone
    assert index.depths(first) == {"chat": 4, "chat@2": 4}
    index.forget("chat@2")
    assert index.depths(second) == {"chat": 4}


def test_without_a_known_prefix_the_least_busy_ready_replica_serves():
    rs, (one, two) = replica_set()
    one.in_flight = 3
    assert rs.pick_ready(prefix_hashes(conversation(1))) is two
    two.state = PARKED
    assert rs.pick_ready(()) is one  # the only one ready
    one.state = PARKED
    assert rs.pick_ready(()) is None


def test_a_conversation_goes_back_to_its_replica_within_the_slack():
    rs, (one, two) = replica_set({"min": 2, "max": 2, "affinity_slack": 2})
    first = prefix_hashes(conversation(7, 1))
    rs.served(first, two)
    one.in_flight, two.in_flight = 0, 2  # two is busier, by the slack
    assert rs.pick_ready(prefix_hashes(conversation(7, 2))) is two
    two.in_flight = 3  # past it: the least busy wins
    assert rs.pick_ready(prefix_hashes(conversation(7, 2))) is one
    # Among replicas matching equally deep, the least busy: the shared system prompt is on both.
    rs.served(prefix_hashes(PROMPT), one)
    assert rs.pick_ready(prefix_hashes(conversation(8, 1))) is one


def test_slack_zero_is_load_alone():
    rs, (one, two) = replica_set({"min": 2, "max": 2, "affinity_slack": 0})
    rs.served(prefix_hashes(conversation(1)), two)
    two.in_flight = 1
    assert rs.pick_ready(prefix_hashes(conversation(1, 2))) is one


def test_a_lost_replica_is_out_of_routing_until_its_next_launch(monkeypatch):
    rs, (one, two) = replica_set()
    rs.served(prefix_hashes(conversation(1)), two)
    rs.lost(two)
    assert rs.ready() == [one]
    assert rs.pick_ready(prefix_hashes(conversation(1, 2))) is one
    assert rs.to_wake() is one  # not the one whose connection just broke
    two.launch_id = "launch-2"
    assert rs.ready() == [one, two]
    # A connection broken on an engine that lives on: back in routing once SUSPECT_S passed.
    rs.lost(two)
    assert rs.ready() == [one]
    real = time.monotonic
    monkeypatch.setattr(replicas_module.time, "monotonic", lambda: real() + SUSPECT_S)
    assert rs.ready() == [one, two]


def test_held_draining_closed_and_busy_with_commands_are_not_routed():
    rs, (one, two) = replica_set()
    rs.held.add(two.name)
    assert rs.ready() == [one]
    rs.held.clear()
    rs.draining.add(one.name)
    assert rs.ready() == [two]
    rs.draining.clear()
    one.requests.door_open = False
    two.has_pending_commands = True
    assert rs.ready() == []


def test_to_wake_joins_a_start_under_way_and_skips_one_in_its_backoff():
    rs, (one, two) = replica_set()
    one.state, two.state = PARKED, STARTING
    assert rs.to_wake() is two
    one.state, two.state, one.backoff = FAILED, PARKED, 5.0
    assert rs.to_wake() is two
    assert rs.member("chat@2") is two and rs.member("other@2") is None and rs.member(None) is None


def test_scaling_adds_one_replica_after_the_load_lasted():
    rs, (one, two, three) = replica_set({"min": 1, "max": 3, "scale_up_load": 2, "scale_up_after": 5})
    two.state = three.state = PARKED
    assert rs.scale(now=0) == []
    one.in_flight, one.waiting = 2, 1  # 3 per ready replica, past 2
    assert rs.scale(now=10) == []  # the load starts being seen
    assert rs.scale(now=14) == []
    [decision] = rs.scale(now=15)
    assert (decision.replica, decision.direction) == ("chat@2", "up") and "scale_up_load 2" in decision.reason
    two.state = STARTING
    assert rs.scale(now=30) == []  # one at a time: not while one starts
    two.state, two.ready_since = READY, time.time()
    one.in_flight, one.waiting = 1, 0
    assert rs.scale(now=31) == []  # 0.5 per ready replica: the clock restarts
    one.in_flight = 5
    assert rs.scale(now=32) == [] and rs.scale(now=36) == []
    assert rs.scale(now=37)[0].replica == "chat@3"


def test_scaling_parks_an_idle_replica_beyond_min_the_highest_first():
    rs, (one, two, three) = replica_set({"min": 1, "max": 3, "scale_down_after": 30})
    now = time.time()
    for r in (one, two, three):
        r.last_used = now - 100
    three.in_flight = 1
    [decision] = rs.scale()
    assert (decision.replica, decision.direction) == ("chat@2", "down")
    three.in_flight = 0
    assert rs.scale()[0].replica == "chat@3"
    two.state = three.state = PARKED
    assert rs.scale() == []  # min stays


def test_min_is_kept_while_it_serves_and_nothing_starts_while_all_rest():
    rs, (one, two) = replica_set(2)
    one.state, two.state = PARKED, PARKED
    assert rs.scale(now=100) == []  # parked as a whole: the next request wakes it
    one.state = READY
    [decision] = rs.scale(now=100)
    assert (decision.replica, decision.direction) == ("chat@2", "min")
    two.state, two.backoff = FAILED, 3.0  # its wake failed
    assert rs.scale(now=120) == []  # in its back-off
    two.backoff = 0.0
    assert rs.scale(now=120)[0].replica == "chat@2"
    assert rs.scale(now=120 + DECISION_RETRY_S - 1) == []  # a wake that found no room is retried, not repeated
    assert rs.scale(now=120 + DECISION_RETRY_S)[0].replica == "chat@2"
    rs.held.add("chat@2")
    assert rs.scale(now=1000) == []  # stopped by name: left alone


def test_the_prompt_text_of_each_route():
    system = [{"role": "system", "content": "Be brief."}]
    chat = routing_prompt("/v1/chat/completions", {"messages": system + [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {}}]}]})
    assert chat == "system:Be brief.\x1euser:Hi"
    assert routing_prompt("/v1/completions", {"prompt": "Once"}) == "Once"
    assert routing_prompt("/v1/completions", {"prompt": ["a", "b"]}) is None
    assert routing_prompt("/v1/responses", {"instructions": "Be brief.", "input": "Hi"}) == \
        "system:Be brief.\x1euser:Hi"
    assert routing_prompt("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Hi"}]}]}) == "user:Hi"
    assert routing_prompt("/v1/messages", {"system": [{"type": "text", "text": "Be brief."}],
                                           "messages": [{"role": "user", "content": "Hi"}]}) == \
        "system:Be brief.\x1euser:Hi"
    assert routing_prompt("/v1/embeddings", {"input": "Hi"}) is None
    assert routing_prompt("/v1/chat/completions", {"messages": "not a list"}) is None

"""Replicas (manifest `replicas`) with real systemd and the real llama-server: each replica its own
unit, requests routed by prompt prefix and load, a killed replica's requests served by its
sibling, a new revision rolled over the replicas, and scaling up under load and down after it.
The official openai client; llama-server's answer says how many prompt tokens came from its
cache ("timings": {"cache_n"}, tools/server/server-common.cpp), which tells which replica served."""

from __future__ import annotations

import threading
import urllib.request

import openai
import pytest

from tests.components import missing, require_root

from .capyhost import CapyHost, llama_server_path, smollm2_path

pytestmark = [pytest.mark.sandbox, pytest.mark.llama]

# Some 1,000 tokens: long enough that a replica holding it answers the next turn from its cache.
SYSTEM = " ".join(f"Rule {i}: capybara herd {i % 5} grazes at pond {i * 7 % 11} before noon." for i in range(70))


@pytest.fixture(scope="module")
def host():
    """One sandboxed daemon for the module: each test deploys its own deployment and deletes it."""
    require_root()
    if llama_server_path() is None or smollm2_path() is None:
        missing("llama-server is not built; run scripts/build-llama-server (scripts/test does)")
    h = CapyHost().boot()
    try:
        h.start_daemon()
        h.cli("engine", "add", llama_server_path(), "--name", "llama")
        h.key = h.create_key()
        yield h
    finally:
        try:
            print(h.daemon_journal(300))
        finally:
            h.teardown()


def deploy(host: CapyHost, name: str, replicas: str, extra: str = "", activate: bool = True) -> None:
    # Each engine on one core of its own: two replicas do not slow each other on a small machine.
    manifest = host.write_manifest(name, f"name: {name}\nengine: llama\nmodel: {{path: {smollm2_path()}}}\n"
                                         f"resources: {{cpus: 1}}\nreplicas: {replicas}\n{extra}")
    host.cli("deploy", "model", "--file", str(manifest), *(["--activate", "--wait"] if activate else []))


def client(host: CapyHost) -> openai.OpenAI:
    return openai.OpenAI(base_url=host.base_url + "/v1", api_key=host.key, max_retries=0, timeout=300)


def replicas(host: CapyHost, name: str) -> dict[str, dict]:
    return {r["name"]: r for r in host.cli_json("status", "deployment", name)["replicas"]}


def wait_for_state(host: CapyHost, replica: str, states: tuple[str, ...], timeout: float = 240) -> dict:
    """Until ``replica`` is in one of ``states`` (the daemon's own status, asked twice a second)."""
    import time
    deadline = time.monotonic() + timeout
    while True:
        status = host.cli_json("status", "deployment", replica)
        if status["state"] in states:
            return status
        assert time.monotonic() < deadline, f"{replica} stayed {status['state']}: {status.get('reason')}"
        time.sleep(0.5)


def daemon_log(host: CapyHost) -> str:
    """The daemon's own journal, all of it (its engines' lines left out)."""
    return host.sh("journalctl", "-u", "capytest-daemon.service", "--no-pager", "-o", "cat").stdout


def main_pid(host: CapyHost, unit: str) -> int:
    return int(host.unit_property(unit, "MainPID"))


class Load:
    """Clients asking ``model`` over and over (half of them streamed) until stopped; every error kept."""

    def __init__(self, host: CapyHost, model: str, clients: int = 4, tokens: int = 24) -> None:
        self.c, self.model, self.tokens = client(host), model, tokens
        self.stop, self.errors, self.answers = threading.Event(), [], 0
        # Streams whose events had begun when their engine died: they end with its error event.
        self.cut_streams: list[str] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)

    def _run(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            messages = [{"role": "user", "content": f"Client {i}, question {n}: name a colour."}]
            try:
                if i % 2:
                    stream = self.c.chat.completions.create(model=self.model, messages=messages, stream=True,
                                                            max_tokens=self.tokens, temperature=0)
                    try:
                        finished = [chunk.choices[0].finish_reason for chunk in stream if chunk.choices]
                    except openai.APIError as exc:  # an error event (an error without one is a cut: no APIError)
                        self.cut_streams.append(str(exc))
                        continue
                    assert finished and finished[-1] is not None, "the stream ended without a finish reason"
                else:
                    self.c.chat.completions.create(model=self.model, messages=messages, max_tokens=self.tokens,
                                                   temperature=0)
                with self._lock:
                    self.answers += 1
            except Exception as exc:  # the tests assert there are none
                self.errors.append(f"client {i} request {n}: {exc!r}")

    def wait_answers(self, more: int) -> None:
        """Until ``more`` answers beyond those so far came back (the load is really flowing)."""
        import time
        target = self.answers + more
        deadline = time.monotonic() + 240
        while self.answers < target and not self.errors:
            assert time.monotonic() < deadline, f"only {self.answers} answers of {target}"
            time.sleep(0.2)


def test_two_replicas_serve_each_in_its_own_unit(host):
    deploy(host, "pair", "2")
    try:
        units = ("capyctl-pair.service", "capyctl-pair@2.service")
        for unit in units:
            assert host.unit_property(unit, "ActiveState") == "active", unit
            assert host.unit_property(unit, "Slice") == "capyctl.slice"
        assert main_pid(host, units[0]) != main_pid(host, units[1])
        # Each its own cgroup and core (resources.cpus: 1 each, two cores planned apart).
        cpus = [host.unit_property(unit, "AllowedCPUs") for unit in units]
        assert all(cpus) and cpus[0] != cpus[1], cpus
        found = host.sh("systemctl", "list-units", "--plain", "--no-legend", "capyctl-pair*").stdout
        assert all(unit in found for unit in units), found
        table = host.cli("list", "deployments").stdout
        row = next(line for line in table.splitlines() if line.startswith("pair "))
        assert row.split()[1:3] == ["ready", "2/2"], table
        status = host.cli("status", "deployment", "pair").stdout
        assert "Replicas: 2 ready of 2 (min 2, max 2)" in status, status
        assert all(f"{unit}: ready on local" in status for unit in units), status
        listing = host.cli_json("list", "deployments")
        assert {d["name"]: d["replica"]["index"] for d in listing if d["replica"]["deployment"] == "pair"} == \
            {"pair": 1, "pair@2": 2}
        # Requests at once are spread by load: both engines answer some.
        c = client(host)
        barrier = threading.Barrier(4)

        def ask(i: int) -> None:
            barrier.wait()
            c.chat.completions.create(model="pair", messages=[{"role": "user", "content": f"Count to {i + 20}."}],
                                      max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for unit in units:
            journal = host.sh("journalctl", "-u", unit, "--no-pager", "-o", "cat").stdout
            assert "print_timing" in journal, f"{unit} answered no request"
        # A replica's name is not a model: clients ask for the deployment.
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="pair@2", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        # A daemon restarted adopts both replicas' engines as they run.
        pids = [main_pid(host, unit) for unit in units]
        host.kill_daemon()
        host.start_daemon()
        assert {n: r["state"] for n, r in replicas(host, "pair").items()} == {"pair": "ready", "pair@2": "ready"}
        assert [main_pid(host, unit) for unit in units] == pids
        # One replica drained: out of routing and parked, its sibling serves, scaling leaves it be.
        host.cli("drain", "deployment", "pair@2")
        drained = replicas(host, "pair")["pair@2"]
        assert drained["state"] == "parked" and drained["held"], drained
        for i in range(3):
            c.chat.completions.create(model="pair", messages=[{"role": "user", "content": f"Hi {i}"}], max_tokens=2)
        assert replicas(host, "pair")["pair@2"]["state"] == "parked"
        host.cli("wake", "deployment", "pair@2")
        woken = replicas(host, "pair")["pair@2"]
        assert woken["state"] == "ready" and not woken["held"], woken
    finally:
        host.cli("delete", "deployment", "pair")
    assert "capyctl-pair" not in host.sh("systemctl", "list-units", "--plain", "--no-legend", "capyctl-pair*").stdout


def test_a_conversation_goes_back_to_the_replica_holding_its_prefix(host):
    deploy(host, "conv", "2")
    c = client(host)
    try:
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which pond comes first?"}]
        answer = c.chat.completions.create(model="conv", messages=first, max_tokens=4, temperature=0)
        # A long answer keeps the replica that served the first turn busy: by load alone the next
        # turn would go to its idle sibling, which never saw the conversation.
        busy = threading.Thread(target=lambda: c.chat.completions.create(
            model="conv", messages=[{"role": "user", "content": "Count slowly."}], max_tokens=256,
            temperature=0, extra_body={"ignore_eos": True}))
        busy.start()
        try:
            wait_until_in_flight(host, "conv", 1)
            second = first + [{"role": "assistant", "content": answer.choices[0].message.content or ""},
                              {"role": "user", "content": "And which comes last?"}]
            again = c.chat.completions.create(model="conv", messages=second, max_tokens=4, temperature=0)
        finally:
            busy.join()
        cached = int((again.model_extra or {}).get("timings", {}).get("cache_n", -1))
        prompt = again.usage.prompt_tokens
        assert cached > prompt * 0.8, f"the second turn reused {cached} of {prompt} prompt tokens"
    finally:
        host.cli("delete", "deployment", "conv")


def wait_until_in_flight(host: CapyHost, name: str, count: int) -> None:
    import time
    deadline = time.monotonic() + 60
    while sum(r["in_flight"] for r in replicas(host, name).values()) < count:
        assert time.monotonic() < deadline, replicas(host, name)
        time.sleep(0.05)


def test_a_killed_or_hung_replica_fails_no_request_and_comes_back(host):
    # A hung engine is found by the watchdog within timeouts.unresponsive plus its probe period.
    deploy(host, "hardy", "2", extra="timeouts: {unresponsive: 2s}\n")
    try:
        killed = main_pid(host, "capyctl-hardy@2.service")
        with Load(host, "hardy") as load:
            load.wait_answers(4)
            host.sh("kill", "-9", str(killed))
            wait_for_state(host, "hardy@2", ("failed", "stopped", "starting", "waking"))
            load.wait_answers(8)  # all served by the sibling meanwhile
            back = wait_for_state(host, "hardy@2", ("ready",))
            load.wait_answers(4)
            # Replica 1 hangs (SIGSTOP): its requests wait until the watchdog stops it, then go to
            # replica 2, which serves alone until replica 1 is started again.
            hung = main_pid(host, "capyctl-hardy.service")
            host.sh("kill", "-STOP", str(hung))
            stopped = wait_for_state(host, "hardy", ("failed", "stopped", "starting", "waking"))
            load.wait_answers(8)
            wait_for_state(host, "hardy", ("ready",))
            load.wait_answers(4)
        assert load.errors == [], load.errors  # non-streamed ones and streams not begun went to the sibling
        assert all("hardy" in cut for cut in load.cut_streams), load.cut_streams
        assert main_pid(host, "capyctl-hardy@2.service") != killed and main_pid(host, "capyctl-hardy.service") != hung
        assert back["wakes"] >= 1 and "engine_unresponsive" in (stopped["reason"] or ""), stopped
        assert "replica hardy@2 lost its engine connection" in daemon_log(host)
    finally:
        host.cli("delete", "deployment", "hardy")


def test_a_new_revision_replaces_the_replicas_one_at_a_time_under_load(host):
    deploy(host, "roll", "2")
    try:
        old = {u: main_pid(host, u) for u in ("capyctl-roll.service", "capyctl-roll@2.service")}
        with Load(host, "roll") as load:
            load.wait_answers(4)
            deploy(host, "roll", "2", extra="env: {ROLLED: '1'}\n")
            load.wait_answers(4)
        assert load.errors == [], load.errors
        for unit, pid in old.items():
            assert main_pid(host, unit) != pid, f"{unit} was not replaced"
            assert "ROLLED=1" in host.unit_property(unit, "Environment")
        assert {r["revision"] for r in replicas(host, "roll").values()} == {2}
        journal = daemon_log(host)
        assert journal.index("replacing replica roll with") < journal.index("replacing replica roll@2 with"), \
            journal[-3000:]
    finally:
        host.cli("delete", "deployment", "roll")


def test_load_adds_a_replica_and_its_end_parks_it(host):
    deploy(host, "elastic", "{min: 1, max: 2, scale_up_load: 1, scale_up_after: 1s, scale_down_after: 2s}")
    try:
        assert host.cli_json("status", "deployment", "elastic@2")["state"] == "stopped"
        with Load(host, "elastic", clients=4, tokens=64) as load:
            wait_for_state(host, "elastic@2", ("ready",))
            load.wait_answers(4)
        assert load.errors == [], load.errors
        parked = wait_for_state(host, "elastic@2", ("parked", "stopped"))
        assert "scaled down" in (parked["reason"] or ""), parked
        assert host.cli_json("status", "deployment", "elastic")["state"] == "ready"  # min 1 stays
        journal = daemon_log(host)
        assert "adding replica elastic@2" in journal and "parking replica elastic@2" in journal, journal[-3000:]
        request = urllib.request.Request(host.base_url + "/metrics", headers={"Authorization": f"Bearer {host.key}"})
        metrics = urllib.request.urlopen(request, timeout=30).read().decode()
        scaled = [line for line in metrics.splitlines() if line.startswith("capyctl_replica_scaled")]
        assert 'capyctl_replica_scaled_up_total{deployment="elastic@2"} 1.0' in scaled, scaled
        assert 'capyctl_replica_scaled_down_total{deployment="elastic@2"} 1.0' in scaled, scaled
    finally:
        host.cli("delete", "deployment", "elastic")

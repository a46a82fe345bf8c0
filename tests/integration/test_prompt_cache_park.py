"""A conversation's prompt cache survives a park by stopping (issue 33): llama-server saves its
slots at the park (POST /slots/{id}?action=save), the wake restores them before any request is
admitted, and the next turn reuses them: llama-server's own answer says how many prompt tokens
came from its cache ("timings": {"cache_n"}, tools/server/server-common.cpp). A changed model
file is refused, and the files are gone once restored, refused, or deleted. Real systemd, real
llama-server, the official openai client."""

from __future__ import annotations

import re
import shutil
import urllib.request

import openai
import pytest

from tests.integration.capyhost import CapyHost

pytestmark = [pytest.mark.sandbox, pytest.mark.llama]

CACHE_DIR = "/var/cache/capyctl-engine/smollm2"
# Some 650 tokens of SmolLM2's tokenizer: long enough that its prefill dominates a turn, short
# enough that the suite's many turns of it stay cheap on 2 cores.
LONG_TEXT = " ".join(f"Note {i}: the capybara colony at pond {i % 7} moved {i * 3} metres north today."
                     for i in range(30))
# Most of LONG_TEXT's tokens: what a turn that reuses the conversation takes from a cache.
MOST_OF_IT = 500


def deploy(host: CapyHost, model: str) -> openai.OpenAI:
    manifest = host.write_manifest("smollm2", f"name: smollm2\nengine: llama\nmodel: {{path: {model}}}\n")
    host.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")
    return openai.OpenAI(base_url=host.base_url + "/v1", api_key=host.create_key(), max_retries=0, timeout=300)


def turn(client: openai.OpenAI, messages: list[dict], slot: int | None = None) -> tuple[str, int]:
    """One turn: the answer, and how many of its prompt tokens llama-server took from its cache.
    ``slot``: the slot that serves it (the request's ``id_slot``, server-context.cpp
    handle_completions_impl; -1, any, by default)."""
    answer = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4, temperature=0,
                                            extra_body={} if slot is None else {"id_slot": slot})
    timings = (answer.model_extra or {}).get("timings") or {}
    return answer.choices[0].message.content or "", int(timings.get("cache_n", -1))


def conversation(client: openai.OpenAI) -> list[dict]:
    """The first turn of a long conversation, and the messages of its second turn."""
    first = [{"role": "user", "content": LONG_TEXT + "\nWhich pond is mentioned first?"}]
    reply, _ = turn(client, first)
    return first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And which one last?"}]


def saved_files(host: CapyHost) -> list[str]:
    out = host.sh("sh", "-c", f"ls {CACHE_DIR}/ 2>/dev/null | grep '^capyctl-slot-' || true").stdout
    return out.split()


def prompt_cache(host: CapyHost) -> dict:
    return host.cli_json("status", "deployment", "smollm2")["park_record"].get("prompt_cache") or {}


def test_the_next_turn_after_a_wake_reuses_the_conversation(capyhost, smollm2):
    client = deploy(capyhost, smollm2)
    second = conversation(client)
    capyhost.cli("park", "deployment", "smollm2")
    saved = prompt_cache(capyhost)
    assert saved["state"] == "saved", saved
    assert saved["tokens"] > MOST_OF_IT and saved["bytes"] > 0, saved
    assert saved_files(capyhost) == saved["files"] and saved["files"], saved

    _, cached = turn(client, second)  # wakes the deployment
    restored = prompt_cache(capyhost)
    assert restored["state"] == "restored", restored
    assert restored["tokens"] == saved["tokens"], restored
    assert restored["seconds_saved"] is not None and restored["seconds_saved"] > 0, restored
    assert cached > MOST_OF_IT, f"the turn after the wake took only {cached} prompt tokens from the cache"
    assert saved_files(capyhost) == []  # restored: nothing stays on disk
    # What a user sees: capyctl status, and the proxy's metrics.
    text = capyhost.cli("status", "deployment", "smollm2").stdout
    assert f"prompt cache: {restored['tokens']} tokens restored" in text, text
    request = urllib.request.Request(capyhost.base_url + "/metrics", headers={"Authorization": f"Bearer {client.api_key}"})
    metrics = urllib.request.urlopen(request, timeout=10).read().decode()
    assert f'capyctl_park_prompt_cache_restored_tokens{{deployment="smollm2"}} {float(restored["tokens"])}' in metrics

    # The wake's proof did not hold that turn: it waits for the next park.
    record = capyhost.cli_json("status", "deployment", "smollm2")["park_record"]
    assert "proof" not in [p["phase"] for p in record["last_wake"]["phases"]], record["last_wake"]
    proven_before = (record.get("proof") or {}).get("at")
    # Parked again: the conversation is still what the slots hold (the proof ran after the save,
    # so it did not move the conversation into llama-server's RAM cache first), the proof passed,
    # and the next wake restores the conversation again.
    capyhost.cli("park", "deployment", "smollm2")
    again = prompt_cache(capyhost)
    assert again["state"] == "saved" and again["tokens"] >= saved["tokens"], again
    record = capyhost.cli_json("status", "deployment", "smollm2")["park_record"]
    assert record["proof"]["result"] == "passed" and record["proof"]["at"] != proven_before, record["proof"]
    assert [p["phase"] for p in record["last_park"]["phases"]][:3] == ["drain", "save prompt cache", "proof"]
    _, cached = turn(client, second)
    assert cached > MOST_OF_IT, f"the turn after the second wake took only {cached} prompt tokens from the cache"

    # Parked again and deleted: the files saved at that park go with the deployment.
    capyhost.cli("park", "deployment", "smollm2")
    assert saved_files(capyhost)
    capyhost.cli("delete", "deployment", "smollm2")
    assert saved_files(capyhost) == []


def test_requests_that_share_a_prefix_all_reuse_the_slots_restored_after_a_wake(capyhost, smollm2):
    """A shared system prompt, several clients at once: every slot holding it is saved at the park
    and restored at the wake, and each of the next requests at once takes it from a slot of its
    own (llama-server started with --no-cache-idle-slots: llamacpp.py says why)."""
    import concurrent.futures
    client = deploy(capyhost, smollm2)
    slots = 4  # llama-server's automatic slot count with a unified KV cache (server-context.cpp)
    shared = [{"role": "system", "content": LONG_TEXT[:1200]}]

    def ask(i: int, slot: int | None = None) -> int:
        return turn(client, shared + [{"role": "user", "content": f"Question {i}: which pond?"}], slot)[1]

    with concurrent.futures.ThreadPoolExecutor(slots) as pool:
        # Each slot now holds the shared prefix: pinned, as requests at once do not always overlap
        # (on a loaded machine two of them were served one after another by the same slot, which
        # left two slots empty to save).
        list(pool.map(ask, range(slots), range(slots)))
        capyhost.cli("park", "deployment", "smollm2")
        saved = prompt_cache(capyhost)
        assert saved["state"] == "saved" and len(saved["files"]) == slots, saved
        cached = list(pool.map(ask, range(slots, 2 * slots)))  # the first of them wakes it
    assert prompt_cache(capyhost)["state"] == "restored"
    assert min(cached) > 200, f"prompt tokens each request took from a restored slot: {cached}"


def test_a_wake_without_the_cache_prefills_again(capyhost, smollm2):
    """The control: keep_across_park off, the same turn after a wake takes nothing from a cache."""
    manifest = capyhost.write_manifest(
        "smollm2", f"name: smollm2\nengine: llama\nmodel: {{path: {smollm2}}}\nprompt_cache: {{keep_across_park: false}}\n")
    capyhost.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")
    client = openai.OpenAI(base_url=capyhost.base_url + "/v1", api_key=capyhost.create_key(), max_retries=0,
                           timeout=300)
    second = conversation(client)
    capyhost.cli("park", "deployment", "smollm2")
    assert prompt_cache(capyhost) == {}
    assert saved_files(capyhost) == []
    _, cached = turn(client, second)
    assert cached < 100, cached


def test_a_changed_model_file_refuses_the_saved_cache(capyhost, smollm2):
    model = str(capyhost.root / "smollm2.gguf")
    shutil.copyfile(smollm2, model)
    client = deploy(capyhost, model)
    second = conversation(client)
    capyhost.cli("park", "deployment", "smollm2")
    assert prompt_cache(capyhost)["state"] == "saved"
    # The same weights, rewritten: CapyCTL cannot tell a re-download from other weights of the
    # same shape, which llama.cpp would restore without a word, so it refuses both.
    shutil.copyfile(smollm2, model + ".new")
    shutil.move(model + ".new", model)
    _, cached = turn(client, second)
    refused = prompt_cache(capyhost)
    assert refused["state"] == "refused" and "model file changed" in refused["why"], refused
    assert cached < 100, cached
    assert saved_files(capyhost) == []


def distinct_prompt(k: int) -> list[dict]:
    """A long prompt sharing no more than the chat template's first tokens with any other k."""
    text = " ".join(f"Record {k}-{i}: herd {k * 31 + i} grazed {i * k + 5} metres from river {k}." for i in range(55))
    return [{"role": "user", "content": f"Ledger {k}. {text}\nHow many records are there?"}]


def fill_the_prompt_cache(host: CapyHost, engine_args: str, prompts: int,
                          past_the_limit: int | None = None) -> tuple[str, str]:
    """Deploy under MemoryMax=320M (-c 2048), send ``prompts`` distinct long prompts one after
    another: with --cache-idle-slots (llama-server's default, which CapyCTL turns off: llamacpp.py)
    each new task moves the idle slots into its host-RAM prompt cache (server-context.cpp), so each
    prompt adds its KV state there until the cache's limit; without it the first prompts would
    only fill empty slots. With ``past_the_limit``, it stops that many prompts after the engine's
    journal first says the cache reached its limit. Returns the engine's MainPID before and after."""
    manifest = host.write_manifest(
        "smollm2", f"name: smollm2\nengine: llama\nmodel: {{path: {host_model(host)}}}\n"
        f"resources: {{ram: 320MiB}}\nengine_args: [-c, '2048', --cache-idle-slots{engine_args}]\n")
    host.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")
    client = openai.OpenAI(base_url=host.base_url + "/v1", api_key=host.create_key(), max_retries=0, timeout=300)
    unit = "capyctl-smollm2.service"
    before = host.unit_property(unit, "MainPID")
    left: int | None = None  # prompts still to send once the limit was reached
    for k in range(prompts):
        try:
            turn(client, distinct_prompt(k))
        except openai.APIError:
            break  # the engine was killed under the request
        if past_the_limit is not None:
            if left is None and cache_limit_reached(host, unit):
                left = past_the_limit
            elif left is not None:
                left -= 1
            if left == 0:
                break
    return before, host.unit_property(unit, "MainPID")


def cache_limit_reached(host: CapyHost, unit: str) -> bool:
    """The engine's journal says its prompt cache reached its limit and gave up its oldest prompts
    (server_prompt_cache::alloc/update, tools/server/server-task.cpp)."""
    journal = host.sh("journalctl", "-u", unit, "--no-pager", "-o", "cat").stdout
    return "making room for prompt cache entry" in journal or "cache size limit reached" in journal


def host_model(host: CapyHost) -> str:
    from tests.integration.capyhost import smollm2_path
    return smollm2_path()


def test_the_planned_prompt_cache_fills_and_the_engine_stays_within_its_limit(capyhost):
    # Three prompts past the first time the cache gave up its oldest prompts: it stays at its limit
    # while new prompts keep arriving (the control below is killed by the same prompts).
    before, after = fill_the_prompt_cache(capyhost, "", prompts=10, past_the_limit=3)
    unit = "capyctl-smollm2.service"
    argv = capyhost.unit_property(unit, "ExecStart")
    # 320 MiB less the weights (93 MiB), the KV cache at -c 2048 (45 MiB) and the runtime (128 MiB).
    planned = re.search(r"--cache-ram (\d+) ", argv)
    assert planned and 32 <= int(planned.group(1)) <= 54, argv
    journal = capyhost.sh("journalctl", "-u", unit, "--no-pager", "-o", "cat").stdout
    assert cache_limit_reached(capyhost, unit), journal[-3000:]
    assert after == before and capyhost.unit_property(unit, "ActiveState") == "active"
    assert capyhost.cli_json("status", "deployment", "smollm2")["state"] == "ready"


def test_llama_servers_own_default_cache_outgrows_the_same_limit(capyhost):
    """The control: what every launch did before the cache was planned (--cache-ram 8192, the
    default) gets the same engine OOM-killed by the same prompts."""
    before, after = fill_the_prompt_cache(capyhost, ", --cache-ram, '8192'", prompts=14)
    assert after != before, "the engine with an 8 GiB prompt cache was never killed under MemoryMax=320M"
    assert "oom" in capyhost.daemon_journal(400).lower()

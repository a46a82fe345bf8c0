"""Turning first-token log-probabilities into /v1/systemone answers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, strategies as st

from capyctl.errors import CapyError
from capyctl.proxy._systemone import (ChoiceQuestion, NoulQuestion, ScoreQuestion, build_messages,
                                      option_for_token, option_probabilities, validate_request)

NOUL = NoulQuestion(type="noul", instructions="Is it raining?")
CHOICE = ChoiceQuestion(type="choice", instructions="Team?", criteria={"billing": None, "shipping": "boxes", "tech": None})
SCORE = ScoreQuestion(type="score", instructions="Urgency?", criteria=["low", "mid", "high"])


@pytest.mark.parametrize("question, token, option", [
    (NOUL, "Yes", "true"), (NOUL, "\u2581yes", "true"), (NOUL, " Y", "true"), (NOUL, "no.", "false"),
    (NOUL, "False", "false"), (NOUL, "Maybe", None), (NOUL, " ", None), (NOUL, "nope", None),
    (CHOICE, "A", "billing"), (CHOICE, " b", "shipping"), (CHOICE, "C)", "tech"), (CHOICE, "D", None),
    (CHOICE, "bill", "billing"), (CHOICE, "Shipping", "shipping"), (CHOICE, "x", None),
    (SCORE, "0", "0"), (SCORE, " 2", "2"), (SCORE, "3", None), (SCORE, "two", None),
])
def test_option_for_token(question, token: str, option: str | None) -> None:
    assert option_for_token(question, token) == option


def test_no_option_in_the_top_list_gives_the_uniform_answer() -> None:
    probabilities = option_probabilities(CHOICE, [{"token": "Hello", "logprob": -0.1}])
    assert probabilities == pytest.approx({"billing": 1 / 3, "shipping": 1 / 3, "tech": 1 / 3})


top_entries = st.lists(st.fixed_dictionaries({
    "token": st.sampled_from(["A", "B", "C", "D", "yes", "No", "0", "1", "2", "9", "the", " ", "bill"]),
    "logprob": st.floats(min_value=-30, max_value=0)}), max_size=20)


@given(top_entries, st.sampled_from([NOUL, CHOICE, SCORE]))
def test_probabilities_are_a_distribution_over_the_options(top, question) -> None:
    probabilities = option_probabilities(question, top)
    assert math.isclose(sum(probabilities.values()), 1.0, rel_tol=1e-9)
    assert all(p > 0 for p in probabilities.values())
    assert len(probabilities) == {"noul": 2, "choice": 3, "score": 3}[question.type]


def test_prompt_names_every_option_and_the_state() -> None:
    text = build_messages({"msg": "hi"}, CHOICE)[-1]["content"]
    assert '{"msg": "hi"}' in text
    assert "A. billing" in text and "B. shipping: boxes" in text and "C. tech" in text
    text = build_messages("s", SCORE)[-1]["content"]
    assert "0: low" in text and "2: high" in text


def test_validation_error_names_the_field() -> None:
    with pytest.raises(CapyError) as caught:
        validate_request({"model": "m", "state": "s",
                          "questions": {"q": {"type": "score", "instructions": "x", "criteria": list("abcdefghijk")}}})
    assert caught.value.status == 422
    assert caught.value.detail["param"] == "questions.q.criteria"


# ---------------------------------------------------------------- TensorFold: /v1/systemone over /v1/decisions
# The shapes follow TensorFold's src/tensorfold/server/decisions.py; the figures are its documented
# full-model checks (docs/decisions-validation.md: "Duplicate charge / category -> billing 0.999395,
# 45 prompt tokens"; "Monday delivery / delivered Monday? -> yes 0.998190"; "Explicit HIGH / levels
# LOW, MEDIUM, HIGH -> mean 1.994257, winning label 0.996727").

from contextlib import asynccontextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import aiohttp  # noqa: E402

from capyctl.engines import LaunchContext, adapter_for  # noqa: E402
from capyctl.proxy import ModelEntry, Upstream, build_app, serve  # noqa: E402
from capyctl.proxy._systemone import (check_decidable, decisions_request,  # noqa: E402
                                      from_decisions_response)
from capyctl.spec import DeploymentSpec, EngineSpec  # noqa: E402
from tests.fakes import free_port, make_fake_tensorfold_venv, start_plan  # noqa: E402

DOCUMENTED = {
    "model": "glm", "state": "A billing question: I was charged twice. The parcel was delivered on Monday.",
    "questions": {
        "category": {"type": "choice", "instructions": "Which team handles this?",
                     "criteria": {"billing": "payments and refunds", "technical": None, "sales": None}},
        "monday": {"type": "noul", "instructions": "The parcel was delivered on Monday.",
                   "criteria": {"true": "it came on Monday"}},
        "priority": {"type": "score", "instructions": "Priority?", "criteria": ["LOW", "MEDIUM", "HIGH"]},
    },
}
DOCUMENTED_ANSWER = {  # what TensorFold's build_response returns for those figures
    "object": "decisions", "model": "glm", "prompt_format_version": 1,
    "answers": {
        "category": {"type": "choice", "probabilities": {"billing": 0.999395, "technical": 0.0004, "sales": 0.000205},
                     "label_mass": 0.993278, "choice": "billing"},
        "monday": {"type": "yes_no", "probabilities": {"yes": 0.998190, "no": 0.001810}, "label_mass": 0.032741},
        "priority": {"type": "score", "probabilities": {"0": 0.00247, "1": 0.000803, "2": 0.996727},
                     "label_mass": 0.987006, "score": 1.994257},
    },
    "usage": {"prompt_tokens": 45 + 32 + 42, "completion_tokens": 0, "total_tokens": 45 + 32 + 42},
}


def test_systemone_request_becomes_a_decisions_request() -> None:
    body = decisions_request(validate_request(DOCUMENTED), "glm-served")
    assert body == {"model": "glm-served", "input": DOCUMENTED["state"], "questions": [
        {"id": "category", "type": "choice", "question": "Which team handles this?",
         "options": [{"name": "billing", "description": "payments and refunds"}, {"name": "technical"},
                     {"name": "sales"}]},
        {"id": "monday", "type": "yes_no", "question": "The parcel was delivered on Monday.",
         "yes": "it came on Monday"},
        {"id": "priority", "type": "score", "question": "Priority?", "levels": ["LOW", "MEDIUM", "HIGH"]},
    ]}


def test_decisions_answer_becomes_the_systemone_answer() -> None:
    answer = from_decisions_response(validate_request(DOCUMENTED), DOCUMENTED_ANSWER)
    assert answer["model"] == "glm"
    assert answer["usage"] == {"input_tokens": 119, "output_tokens": 0}
    category = answer["answers"]["category"]
    assert category["type"] == "choice" and category["choice"] == "billing"
    assert category["probabilities"] == pytest.approx({"billing": 0.999395, "technical": 0.0004, "sales": 0.000205})
    assert category["confidence"] == pytest.approx((0.999395 - 1 / 3) / (1 - 1 / 3))
    assert answer["answers"]["monday"] == {"type": "noul", "noul": pytest.approx(0.998190)}
    priority = answer["answers"]["priority"]
    assert priority["score"] == pytest.approx(1.994257, abs=1e-6)
    assert priority["legend"] == {"0": "LOW", "1": "MEDIUM", "2": "HIGH"}
    assert set(priority) == {"type", "score", "legend", "probabilities", "confidence"}


def test_choice_labels_are_matched_back_through_their_stripped_names() -> None:
    request = validate_request({"model": "m", "state": "s", "questions": {
        "q": {"type": "choice", "instructions": "?", "criteria": {" left ": None, "right": None}}}})
    assert decisions_request(request, "m")["questions"][0]["options"] == [{"name": "left"}, {"name": "right"}]
    answer = from_decisions_response(request, {"answers": {"q": {"type": "choice",
                                                                 "probabilities": {"left": 0.25, "right": 0.75}}}})
    assert answer["answers"]["q"]["probabilities"] == {" left ": 0.25, "right": 0.75}


@pytest.mark.parametrize("body, what", [
    ({}, "no answers object"),
    ({"answers": {"category": {"probabilities": {"billing": 1.0}}}}, "no probability for 'technical'"),
    ({"answers": {}}, "no probabilities for question 'category'"),
])
def test_a_malformed_decisions_answer_is_an_engine_error(body, what) -> None:
    with pytest.raises(CapyError) as caught:
        from_decisions_response(validate_request(DOCUMENTED), body)
    assert caught.value.code == "engine_error" and caught.value.status == 502 and what in caught.value.message


@pytest.mark.parametrize("questions, images, where", [
    ({"q": {"type": "choice", "instructions": "?", "criteria": {f"o{i}": None for i in range(27)}}}, None,
     "at most 26"),
    ({"q": {"type": "choice", "instructions": "?", "criteria": {"Yes": None, "yes ": None}}}, None, "case"),
    ({"q": {"type": "choice", "instructions": "?", "criteria": {"a\nb": None, "c": None}}}, None, "line breaks"),
    ({" ": {"type": "noul", "instructions": "?"}}, None, "blank"),
    ({"q": {"type": "noul", "instructions": "?"}}, ["data:image/png;base64,AAAA"], "Images"),
])
def test_what_decisions_cannot_take_is_refused_before_sending(questions, images, where) -> None:
    body = {"model": "m", "state": "s", "questions": questions, **({"images": images} if images else {})}
    with pytest.raises(CapyError) as caught:
        check_decidable(validate_request(body))
    assert caught.value.code == "systemone_unsupported" and caught.value.status == 400
    assert where in caught.value.message


# -- through the proxy, to the fake TensorFold launched from the adapter's own plan ---------------

ENGINE_KEY = "launch-key-tf"


class OneRouter:
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def models(self) -> list[ModelEntry]:
        return [ModelEntry(id="decider", deployment="decider", state="ready", engine="tensorfold", created=1)]

    @asynccontextmanager
    async def acquire(self, model: str):
        if model != "decider":
            raise CapyError("no such model", code="model_not_found", status=404)
        yield self.upstream

    def stats(self) -> dict:
        return {}


@asynccontextmanager
async def tensorfold_behind_proxy(tmp_path: Path, **fake_env: str):
    """The proxy (keys off) in front of a fake TensorFold; yields (proxy url, engine server).
    The proxy learns what the engine answers from the adapter's capabilities alone."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "glm5_next"}')
    engine = EngineSpec(kind="engine", name="tf", type="tensorfold",
                        path=str(make_fake_tensorfold_venv(tmp_path / "venv")))
    adapter = adapter_for("tensorfold")
    port = free_port()
    dep = DeploymentSpec(name="decider", engine="tf", model={"path": str(model)})
    plan = adapter.build_launch(LaunchContext(deployment=dep, engine=engine, model_path=str(model), port=port))
    plan.environment.update(fake_env)
    server = start_plan(plan, ENGINE_KEY, port, log_path=tmp_path / "tf.log")
    upstream = Upstream("decider", server.base_url, ENGINE_KEY, "tensorfold", adapter.capabilities(engine),
                        served_model=plan.served_model)
    runner = await serve(build_app(OneRouter(upstream), None), host_port="127.0.0.1:0")
    host, proxy_port = runner.addresses[0][:2]
    try:
        await server.wait_healthy()
        yield f"http://{host}:{proxy_port}", server
    finally:
        await runner.cleanup()
        server.stop()


async def fake_stats(http: aiohttp.ClientSession, server) -> dict:
    async with http.get(server.base_url + "/fake/stats") as response:
        return await response.json()


async def test_systemone_through_the_proxy_is_answered_by_tensorfold_decisions(tmp_path: Path) -> None:
    request = {**DOCUMENTED, "model": "decider", "unknown_field": "ignored, and not sent on"}
    async with tensorfold_behind_proxy(tmp_path) as (proxy_url, server), aiohttp.ClientSession() as http:
        async with http.post(proxy_url + "/v1/systemone", json=request) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
        stats = await fake_stats(http, server)
    assert answer["model"] == "decider" and set(answer["answers"]) == {"category", "monday", "priority"}
    # The fake favours the option its input mentions, and says yes to a statement the input holds.
    assert answer["answers"]["category"]["choice"] == "billing"
    assert answer["answers"]["category"]["probabilities"]["billing"] > 0.9
    assert answer["answers"]["monday"]["noul"] > 0.9
    assert answer["usage"]["output_tokens"] == 0 and answer["usage"]["input_tokens"] > 0
    sent = stats["last_decisions_body"]  # the launch key reached it; the client's extra field did not
    assert set(sent) == {"model", "input", "questions"} and sent["model"] == "decider"
    assert [q["type"] for q in sent["questions"]] == ["choice", "yes_no", "score"]
    assert stats["decisions"] == 1 and stats["unauthorized"] == 0


async def test_decisions_refusals_become_systemone_errors(tmp_path: Path) -> None:
    async with tensorfold_behind_proxy(tmp_path) as (proxy_url, server), aiohttp.ClientSession() as http:
        # TensorFold refuses a blank input (decisions.py): its sentence reaches the client.
        async with http.post(proxy_url + "/v1/systemone", json={**DOCUMENTED, "model": "decider", "state": " "}) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert error["code"] == "systemone_unsupported" and "input must not be blank" in error["message"]
        # Images never reach it.
        body = {**DOCUMENTED, "model": "decider", "images": ["data:image/png;base64,AAAA"]}
        async with http.post(proxy_url + "/v1/systemone", json=body) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "systemone_unsupported"
        assert (await fake_stats(http, server))["decisions"] == 0


async def test_an_engine_without_label_scoring_says_so(tmp_path: Path) -> None:
    # docs/api.md "Decisions": a CUDA engine without label scoring answers 400.
    async with tensorfold_behind_proxy(tmp_path, FAKE_TENSORFOLD_NO_LABEL_SCORING="1") as (proxy_url, _), \
            aiohttp.ClientSession() as http:
        async with http.post(proxy_url + "/v1/systemone", json={**DOCUMENTED, "model": "decider"}) as r:
            assert r.status == 400
            error = (await r.json())["error"]
    assert error["code"] == "systemone_unsupported" and "no label scoring" in error["message"]

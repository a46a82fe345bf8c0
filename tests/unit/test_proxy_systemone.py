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

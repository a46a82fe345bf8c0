"""/v1/systemone: request validation, answers computed from token log-probabilities, the
mapping onto TensorFold's /v1/decisions, and the route itself (:func:`answer`, end of this file).

The response follows the native llama-server / TypeSafe shape exactly, so a client
sees the same thing whether an engine answers natively or CapyCTL answers from
log-probabilities: score levels are 0-based indices ("0".."n-1"), ``score`` is the
expected index, and ``confidence`` uses TypeSafe's published formulas
(0 = all options equally likely, 1 = certain).
"""

from __future__ import annotations

import asyncio
import json
import math
import string
from typing import Annotated, Any, Literal, Mapping, Sequence, Union

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import CapyError
from ._exchange import Exchange
from ._intake import model_entry, model_not_found, parse_body, payload_for
from ._keys import KeyGrant
from ._relay import forward
from ._upstream import json_of, open_upstream
from .router import Upstream

JsonText = Union[str, dict[str, Any], list[Any]]
TOP_LOGPROBS = 20
# Letters label choice options in the prompt; each is one token in every tokenizer we know.
CHOICE_LETTERS = string.ascii_uppercase
MAX_SCORE_LEVELS = 10  # levels are numbered 0..9 in the prompt: one digit, one token


class NoulCriteria(BaseModel):
    model_config = ConfigDict(extra="forbid")
    true: str | None = None
    false: str | None = None


class NoulQuestion(BaseModel):
    type: Literal["noul"]
    instructions: JsonText
    criteria: NoulCriteria | None = None


class ChoiceQuestion(BaseModel):
    type: Literal["choice"]
    instructions: JsonText
    criteria: dict[str, str | None]

    @field_validator("criteria")
    @classmethod
    def _at_least_two(cls, value: dict[str, str | None]) -> dict[str, str | None]:
        if len(value) < 2:
            raise ValueError("a choice needs at least 2 options")
        if any(not label.strip() for label in value):
            raise ValueError("option labels must not be blank")
        return value


class ScoreQuestion(BaseModel):
    type: Literal["score"]
    instructions: JsonText
    criteria: list[str] = Field(min_length=2, max_length=MAX_SCORE_LEVELS)


Question = Annotated[Union[NoulQuestion, ChoiceQuestion, ScoreQuestion], Field(discriminator="type")]


class SystemOneRequest(BaseModel):
    # Unknown top-level fields are ignored, as the native server does, and are still
    # passed on to engines that serve the route themselves.
    model: str
    state: JsonText
    questions: dict[str, Question] = Field(min_length=1)
    images: list[str] | None = None


def validate_request(body: Mapping[str, Any]) -> SystemOneRequest:
    """Raises CapyError invalid_systemone_request (422) naming the first bad field."""
    try:
        return SystemOneRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(part) for part in first["loc"]]
        if len(loc) >= 3 and loc[0] == "questions" and loc[2] in ("noul", "choice", "score"):
            del loc[2]  # pydantic puts the union member's tag there; the client never wrote it
        if first["type"] in ("union_tag_invalid", "union_tag_not_found"):
            loc.append("type")
        path = ".".join(loc) or "body"
        raise CapyError(f"{path}: {first['msg']}", code="invalid_systemone_request", status=422,
                        detail={"param": path}) from None


# ---------------------------------------------------------------- prompts

def _as_text(value: JsonText) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def option_keys(question: NoulQuestion | ChoiceQuestion | ScoreQuestion) -> list[str]:
    """The answer's keys, in prompt order."""
    if isinstance(question, NoulQuestion):
        return ["true", "false"]
    if isinstance(question, ChoiceQuestion):
        return list(question.criteria)
    return [str(i) for i in range(len(question.criteria))]


def build_messages(state: JsonText, question: NoulQuestion | ChoiceQuestion | ScoreQuestion) -> list[dict]:
    """A chat prompt whose first answer token names one option."""
    lines = [f"State:\n{_as_text(state)}", "", f"Question: {_as_text(question.instructions)}", ""]
    if isinstance(question, NoulQuestion):
        criteria = question.criteria or NoulCriteria()
        lines.append("Answer yes or no." if not (criteria.true or criteria.false) else "Options:")
        if criteria.true or criteria.false:
            lines.append(f"yes: {criteria.true or 'true'}")
            lines.append(f"no: {criteria.false or 'false'}")
        reply = "Reply with only yes or no."
    elif isinstance(question, ChoiceQuestion):
        lines.append("Options:")
        for letter, (label, description) in zip(CHOICE_LETTERS, question.criteria.items()):
            lines.append(f"{letter}. {label}" + (f": {description}" if description else ""))
        reply = "Reply with only the letter of the best option."
    else:
        lines.append("Levels, lowest first:")
        for index, level in enumerate(question.criteria):
            lines.append(f"{index}: {level}")
        reply = "Reply with only the number of the level."
    lines += ["", reply]
    return [
        {"role": "system", "content": "You answer questions about a state. " + reply},
        {"role": "user", "content": "\n".join(lines)},
    ]


# ---------------------------------------------------------------- tokens to options

def normalize_token(token: str) -> str:
    """Lower-case, without the surrounding spaces and punctuation a tokenizer attaches ("▁A", " B.", "Yes,")."""
    return token.replace("\u2581", " ").replace("\u0120", " ").strip().strip(string.punctuation + " ").casefold()


def option_for_token(question: NoulQuestion | ChoiceQuestion | ScoreQuestion, token: str) -> str | None:
    """The option key a first answer token stands for, or None."""
    word = normalize_token(token)
    if not word:
        return None
    if isinstance(question, NoulQuestion):
        # "y", "ye", "yes" and "n", "no" are prefixes a model may start with; "true"/"false" too.
        if "yes".startswith(word) or word == "true":
            return "true"
        if "no".startswith(word) or word == "false":
            return "false"
        return None
    if isinstance(question, ScoreQuestion):
        return word if word.isdigit() and int(word) < len(question.criteria) else None
    labels = list(question.criteria)
    if len(word) == 1 and word.upper() in CHOICE_LETTERS[:len(labels)]:
        return labels[CHOICE_LETTERS.index(word.upper())]
    # A model that answers with the label text instead: a prefix of exactly one label.
    matches = [label for label in labels if normalize_token(label).startswith(word)]
    return matches[0] if len(matches) == 1 else None


def option_probabilities(question: NoulQuestion | ChoiceQuestion | ScoreQuestion,
                         top_logprobs: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Probabilities over the options from the top log-probabilities of the first answer token.

    Each option gets the summed probability of the tokens that stand for it; an option
    absent from the top list gets a floor of a tenth of the least likely listed token
    (it was less likely than that, and no option is ever called impossible); then the
    masses are renormalized to sum to 1. No listed option at all gives the uniform answer.
    """
    keys = option_keys(question)
    mass = dict.fromkeys(keys, 0.0)
    listed = [math.exp(float(entry["logprob"])) for entry in top_logprobs]
    for entry, probability in zip(top_logprobs, listed):
        key = option_for_token(question, str(entry.get("token", "")))
        if key is not None:
            mass[key] += probability
    floor = (min(listed) if listed else 1.0) / 10
    mass = {key: (value if value > 0 else floor) for key, value in mass.items()}
    total = sum(mass.values())
    return {key: value / total for key, value in mass.items()}


def confidence_choice(probs: Sequence[float]) -> float:
    uniform = 1.0 / len(probs)
    return max(0.0, (max(probs) - uniform) / (1.0 - uniform))


def confidence_score(probs: Sequence[float]) -> float:
    """Mean distance to the mode, relative to a uniform distribution's (TypeSafe's formula)."""
    n = len(probs)
    mode = max(range(n), key=lambda i: probs[i])
    dist = sum(p * abs(i - mode) for i, p in enumerate(probs))
    dist_uniform = sum(abs(i - (n - 1) / 2) / n for i in range(n))
    return max(0.0, 1.0 - dist / dist_uniform)


def format_answer(question: NoulQuestion | ChoiceQuestion | ScoreQuestion,
                  probabilities: dict[str, float]) -> dict:
    if isinstance(question, NoulQuestion):
        return {"type": "noul", "noul": probabilities["true"]}
    values = list(probabilities.values())
    if isinstance(question, ChoiceQuestion):
        best = max(probabilities, key=probabilities.__getitem__)
        return {"type": "choice", "choice": best, "probabilities": probabilities,
                "confidence": confidence_choice(values)}
    return {"type": "score", "score": sum(i * p for i, p in enumerate(values)),
            "legend": {str(i): level for i, level in enumerate(question.criteria)},
            "probabilities": probabilities, "confidence": confidence_score(values)}


def top_logprobs_of(completion: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The top log-probabilities of the first generated token of a chat completion."""
    try:
        content = completion["choices"][0]["logprobs"]["content"]
        return list(content[0]["top_logprobs"]) if content else []
    except (KeyError, IndexError, TypeError):
        raise CapyError("The engine answered without log-probabilities.", code="engine_error",
                        status=502) from None


def check_answerable(request: SystemOneRequest) -> None:
    """What only a native decision model can do."""
    if request.images:
        raise CapyError("Images in /v1/systemone need an engine that serves decisions natively.",
                        code="systemone_unsupported", status=400)
    for qid, question in request.questions.items():
        if isinstance(question, ChoiceQuestion) and len(question.criteria) > len(CHOICE_LETTERS):
            raise CapyError(f"questions.{qid}.criteria: at most {len(CHOICE_LETTERS)} options can be answered "
                            "from log-probabilities.", code="systemone_unsupported", status=400)


# ---------------------------------------------------------------- TensorFold's /v1/decisions

# TensorFold (github.com/ashhart/TensorFold) answers decisions at POST /v1/decisions (docs/api.md
# "Decisions"), in SGLang's prompt format version 1, with this shape (src/tensorfold/server/decisions.py):
#   request  {"model", "input": str|object|array, "questions": [{"id", "type": "choice"|"score"|"yes_no",
#            "question", ...}]}; choice "options": [{"name", "description"?}] (2 to 26, names unique
#            ignoring case and surrounding spaces, no control characters), score "levels": [text] (2 to 10,
#            labelled 0..9), yes_no optional "yes"/"no" descriptions; any other field is refused (400).
#   response {"object": "decisions", "model", "prompt_format_version": 1, "answers": {id: {"type",
#            "probabilities": {name: p}, "label_mass", "choice" (choice), "score" (score)}},
#            "usage": {"prompt_tokens", "completion_tokens": 0, "total_tokens"}}
# ``probabilities`` is a softmax over the label logits, keyed by the stripped option name, the
# level index ("0".."n-1"), or "yes"/"no". CapyCTL's answer is built from them with the same
# formulas as every other path (format_answer), so the client cannot tell which engine answered.
DECISION_MAX_OPTIONS = 26


def _decision_name(label: str) -> str:
    return label.strip()  # decisions.py keys probabilities by name.strip()


def check_decidable(request: SystemOneRequest) -> None:
    """What /v1/decisions cannot take, refused before anything is sent (400 systemone_unsupported)."""
    if request.images:
        raise CapyError("Images in /v1/systemone need an engine that serves /v1/systemone natively; "
                        "/v1/decisions takes text only.", code="systemone_unsupported", status=400)
    for qid, question in request.questions.items():
        if not qid.strip():
            raise CapyError("This engine's /v1/decisions needs question ids that are not blank.",
                            code="systemone_unsupported", status=400, detail={"param": "questions"})
        if not isinstance(question, ChoiceQuestion):
            continue
        where = f"questions.{qid}.criteria"
        if len(question.criteria) > DECISION_MAX_OPTIONS:
            raise CapyError(f"{where}: this engine's /v1/decisions takes at most {DECISION_MAX_OPTIONS} options.",
                            code="systemone_unsupported", status=400, detail={"param": where})
        seen: set[str] = set()
        for label in question.criteria:
            name = _decision_name(label)
            if any(ord(char) < 32 for char in name):
                raise CapyError(f"{where}: this engine's /v1/decisions takes no line breaks or control "
                                "characters in option labels.", code="systemone_unsupported", status=400,
                                detail={"param": where})
            if name.casefold() in seen:
                raise CapyError(f"{where}: this engine's /v1/decisions needs option labels that differ in more "
                                f"than case and spaces ({label!r}).", code="systemone_unsupported", status=400,
                                detail={"param": where})
            seen.add(name.casefold())


def decisions_request(request: SystemOneRequest, model: str) -> dict[str, Any]:
    """The /v1/decisions body that asks the same questions (call check_decidable first)."""
    questions: list[dict[str, Any]] = []
    for qid, question in request.questions.items():
        item: dict[str, Any] = {"id": qid, "question": question.instructions}
        if isinstance(question, NoulQuestion):
            item["type"] = "yes_no"
            criteria = question.criteria or NoulCriteria()
            if criteria.true:
                item["yes"] = criteria.true
            if criteria.false:
                item["no"] = criteria.false
        elif isinstance(question, ChoiceQuestion):
            item["type"] = "choice"
            item["options"] = [{"name": _decision_name(label),
                                **({"description": description} if description else {})}
                               for label, description in question.criteria.items()]
        else:
            item["type"] = "score"
            item["levels"] = list(question.criteria)
        questions.append(item)
    return {"model": model, "input": request.state, "questions": questions}


def _decision_keys(question: NoulQuestion | ChoiceQuestion | ScoreQuestion) -> dict[str, str]:
    """CapyCTL's option key -> the key of the engine's probabilities."""
    if isinstance(question, NoulQuestion):
        return {"true": "yes", "false": "no"}
    if isinstance(question, ChoiceQuestion):
        return {label: _decision_name(label) for label in question.criteria}
    return {key: key for key in option_keys(question)}


def from_decisions_response(request: SystemOneRequest, body: Any) -> dict[str, Any]:
    """CapyCTL's /v1/systemone answer from a /v1/decisions answer; a malformed one is a 502 engine_error."""

    def malformed(what: str) -> CapyError:
        return CapyError(f"The engine's /v1/decisions answer is malformed: {what}.", code="engine_error",
                         status=502)

    answers = body.get("answers") if isinstance(body, dict) else None
    if not isinstance(answers, dict):
        raise malformed("no answers object")
    out: dict[str, Any] = {}
    for qid, question in request.questions.items():
        answer = answers.get(qid)
        probabilities = answer.get("probabilities") if isinstance(answer, dict) else None
        if not isinstance(probabilities, dict):
            raise malformed(f"no probabilities for question {qid!r}")
        mine: dict[str, float] = {}
        for key, theirs in _decision_keys(question).items():
            value = probabilities.get(theirs)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise malformed(f"question {qid!r} has no probability for {theirs!r}")
            mine[key] = float(value)
        out[qid] = format_answer(question, mine)
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    return {"model": request.model, "answers": out,
            "usage": {"input_tokens": int(usage.get("prompt_tokens") or 0),
                      "output_tokens": int(usage.get("completion_tokens") or 0)}}


# ---------------------------------------------------------------- the route

# Questions of one /v1/systemone request asked at the same time (engines have a few slots).
SYSTEMONE_PARALLEL = 4


async def answer(exchange: Exchange, grant: KeyGrant | None, raw: bytes) -> web.StreamResponse:
    """POST /v1/systemone, its key checked and its body read: passed on to an engine that answers
    it natively, or answered here from TensorFold's /v1/decisions or from token log-probabilities."""
    body, model = parse_body(raw)
    model_entry(exchange, grant, model)
    parsed = validate_request(body)  # before admission: a bad request wakes nothing
    try:
        async with exchange.state.router.acquire(model) as upstream:
            exchange.deployment = upstream.deployment
            if "systemone" in upstream.capabilities:
                await forward(exchange, upstream, "/v1/systemone", payload_for(upstream, raw, body, model))
                return exchange.answer()
            if "decisions" in upstream.capabilities:  # TensorFold: the same questions, its own shape
                check_decidable(parsed)
                return web.json_response(await _answer_from_decisions(exchange, upstream, parsed))
            if "logprobs" in upstream.capabilities:
                check_answerable(parsed)
                return web.json_response(await _answer_from_logprobs(exchange, upstream, parsed))
            raise CapyError(f"The engine of '{model}' answers neither /v1/systemone nor token "
                            "log-probabilities.", code="systemone_unsupported", status=400)
    except CapyError as err:
        if err.code == "model_not_found":
            raise model_not_found(model) from None
        raise


async def _answer_from_decisions(exchange: Exchange, upstream: Upstream, parsed: SystemOneRequest) -> dict[str, Any]:
    """One POST /v1/decisions for every question, its answer translated back."""
    payload = decisions_request(parsed, upstream.served_model or parsed.model)
    upstream_response = await open_upstream(exchange, upstream, "/v1/decisions", json.dumps(payload).encode())
    answered = await json_of(upstream, upstream_response)
    if upstream_response.status == 200:
        return from_decisions_response(parsed, answered)
    error = answered.get("error") if isinstance(answered, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if upstream_response.status == 400 and isinstance(message, str):
        # TensorFold refuses what its tokenizer or context cannot score, and engines without
        # label scoring, with 400 and a sentence (docs/api.md "Decisions"): pass the sentence on.
        raise CapyError(f"The engine of '{upstream.deployment}' cannot answer this request: {message}",
                        code="systemone_unsupported", status=400)
    raise CapyError(f"The engine of '{upstream.deployment}' answered {upstream_response.status} to /v1/decisions: "
                    f"{json.dumps(error)[:300]}", code="engine_error", status=502)


async def _answer_from_logprobs(exchange: Exchange, upstream: Upstream, parsed: SystemOneRequest) -> dict[str, Any]:
    """Ask each question as a one-token chat completion and read the option tokens' probabilities."""
    gate = asyncio.Semaphore(SYSTEMONE_PARALLEL)
    usage = {"input_tokens": 0, "output_tokens": 0}

    async def ask(question) -> dict[str, Any]:
        payload = {
            "model": upstream.served_model or parsed.model,
            "messages": build_messages(parsed.state, question),
            "max_tokens": 1, "temperature": 0, "stream": False,
            "logprobs": True, "top_logprobs": TOP_LOGPROBS,
        }
        async with gate:
            upstream_response = await open_upstream(exchange, upstream, "/v1/chat/completions",
                                                    json.dumps(payload).encode())
            completion = await json_of(upstream, upstream_response)
        if upstream_response.status != 200 or not isinstance(completion, dict):
            detail = completion.get("error") if isinstance(completion, dict) else None
            raise CapyError(f"The engine of '{upstream.deployment}' answered {upstream_response.status} to a "
                            f"log-probability request: {json.dumps(detail)[:300]}", code="engine_error",
                            status=502)
        counts = completion.get("usage") or {}
        usage["input_tokens"] += int(counts.get("prompt_tokens", 0))
        usage["output_tokens"] += int(counts.get("completion_tokens", 0))
        return format_answer(question, option_probabilities(question, top_logprobs_of(completion)))

    try:
        async with asyncio.TaskGroup() as group:  # one failure cancels the other questions
            tasks = {qid: group.create_task(ask(question)) for qid, question in parsed.questions.items()}
    except ExceptionGroup as failures:
        # The client gets one error: the first CapyError, else the first failure as it is.
        first = next((exc for exc in failures.exceptions if isinstance(exc, CapyError)), failures.exceptions[0])
        raise first from None
    return {"model": parsed.model, "answers": {qid: task.result() for qid, task in tasks.items()},
            "usage": usage}

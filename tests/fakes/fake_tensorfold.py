"""A fake TensorFold server (github.com/ashhart/TensorFold) for machines without its CUDA GPU.

    python tests/fakes/fake_tensorfold.py serve MODEL_DIR [--host H] [--port P] [--name ID] [--api-key K]
        [--api-key-file PATH] [--enable-sleep-mode [--sleep-token-env NAME] [--sleep-timeout S]] ...

It follows TensorFold's own files; each behaviour names the one it follows. The lifecycle files
were read at these commits of github.com/ashhart/TensorFold: src/tensorfold/server/lifecycle_http.py
at 12cd226a82675e62ab9c79d91de54f66ae390446, src/tensorfold/server/lifecycle.py at
5d57908cb5af8193175c660e28a7c0dc53d95f94, src/tensorfold/server/decisions.py at
16e3a20fb90cf41c4f7033b2cc77c1d626d8254c; the others are cited by path only (the release
tests/fakes/__init__.py names, 0.6.4, was not pinned to a commit):
- src/tensorfold/cli_args.py: ``serve`` takes the model POSITIONALLY; an unknown option (``--model``
  among them) is an argparse error, exit 2. src/tensorfold/cli.py: ``tensorfold MODEL_DIR`` means
  ``tensorfold serve MODEL_DIR``; a model that is not a directory with a config.json exits 1 with
  "tensorfold: ..."; the served id is ``--name``, else the directory's name.
- docs/api.md "API keys" and src/tensorfold/server/auth_http.py: keys from every ``--api-key``, the
  comma-separated ``TENSORFOLD_API_KEY`` and ``--api-key-file`` (one key or ``label: key`` a line, ``#``
  comments; refused at startup when other users may read it); ``Authorization: Bearer`` or ``x-api-key``;
  /v1/*, the un-prefixed inference and tokenizer routes and /metrics need a key; 401 with
  ``WWW-Authenticate: Bearer`` (Anthropic's error shape on the Messages routes); ``/health`` stays open
  and says only ``{"status": "ok"}`` when keys are set.
- src/tensorfold/server/decisions.py: ``POST /v1/decisions`` validation and answer shape (400 with the
  reason for a request it cannot score). The fake has no model: a label mentioned in the input gets the
  higher logit (a choice's name, a score level's text; for yes_no, "yes" when the question's text is in
  the input), so answers are deterministic.
- docs/model-sleep.md, src/tensorfold/server/lifecycle.py and lifecycle_http.py: ``--enable-sleep-mode``
  needs the secret in ``$TENSORFOLD_SLEEP_TOKEN`` (or the variable ``--sleep-token-env`` names), one CUDA
  device and a family with a sleep adapter (``qwen3_5``, ``nemotron_h``), else startup refuses (exit 1).
  ``POST /sleep?level=2`` (level 2 only), ``POST /wake_up``, ``GET /is_sleeping``, also under /v1, take
  only the sleep token (401 ``invalid_sleep_token``; 403 ``sleep_origin_forbidden`` with an ``Origin``
  header), 404 when sleep is off. ``/sleep`` with any query but ``level=2`` is 400
  ``unsupported_sleep_level``; ``/wake_up`` and ``/is_sleeping`` with any query are 400
  ``invalid_lifecycle_query`` (lifecycle_http.py admin). Sleep drains accepted requests
  (``--sleep-timeout``: 409 ``sleep_drain_timeout``, still awake); inference POSTs get 503
  ``model_not_ready`` while draining, asleep or waking; concurrent transitions 409
  ``model_lifecycle_error``; a failed reload 503 ``model_wake_failed``, still asleep (inject one with
  POST /fake/fail_next_wake) (lifecycle.py). These answers have lifecycle_http.py _error's body,
  ``{"error": {"message", "code", "type"}}``. Not modelled: 400 ``invalid_request_body`` (a body
  whose framing read_body refuses).

Test knobs (environment only, so argv stays TensorFold's): FAKE_TOKEN_DELAY (seconds a token),
FAKE_TENSORFOLD_WAKE_DELAY (seconds a reload takes), FAKE_TENSORFOLD_NO_LABEL_SCORING=1 (a CUDA
engine without label scoring: /v1/decisions answers 400, docs/api.md "Decisions").
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import math
import os
import stat
import string
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_openai import FakeEngine  # noqa: E402

COMMANDS = ("serve", "pull", "models", "info", "update", "service", "tui", "plan")  # cli.py
SLEEP_FAMILIES = ("qwen3_5", "nemotron_h")  # docs/model-sleep.md
PROMPT_FORMAT_VERSION = 1  # decisions.py
FAKE_WEIGHT_BYTES = 512 << 20  # what memory.allocated_bytes reports while awake

# decisions.py field sets: anything else is refused.
TOP_FIELDS = {"input", "questions", "temperature", "chat_template_kwargs", "prompt_format_version",
              "return_prompt_token_ids", "model"}
QUESTION_FIELDS = {"choice": {"id", "type", "question", "options"}, "score": {"id", "type", "question", "levels"},
                   "yes_no": {"id", "type", "question", "yes", "no"}}
OPTION_FIELDS = {"name", "description"}
# lifecycle_http.post: the POST routes admitted (and refused while not awake).
INFERENCE_POSTS = ("/v1/chat/completions", "/v1/completions", "/v1/decisions", "/v1/messages",
                   "/v1/messages/count_tokens", "/v1/responses", "/tokenize", "/v1/tokenize", "/detokenize",
                   "/v1/detokenize", "/chat/completions", "/completions", "/decisions")
MESSAGES_PATHS = {"/v1/messages", "/v1/messages/count_tokens", "/messages", "/messages/count_tokens"}


class StartupError(Exception):
    """What cli.py prints as ``tensorfold: <message>`` before exiting 1."""


class DecisionError(ValueError):
    """decisions.py: a request refused before scoring (HTTP 400)."""


class LifecycleError(Exception):
    def __init__(self, message: str, status: int = 409, code: str = "model_lifecycle_error") -> None:
        super().__init__(message)
        self.status, self.code = status, code


def gated(path: str, metrics_open: bool) -> bool:
    """auth_http.gated: the paths that need an API key."""
    path = path.split("?", 1)[0].rstrip("/")
    if metrics_open and path in {"/metrics", "/v1/metrics"}:
        return False
    return (path == "/v1" or path.startswith("/v1/") or
            path in {"/metrics", "/tokenize", "/detokenize", "/models", "/messages", "/messages/count_tokens",
                     "/chat/completions", "/completions", "/decisions"} or
            path == "/responses" or path.startswith("/responses/") or
            path.endswith(("/chat/completions", "/completions", "/decisions", "/models")))


def read_key_file(path: str) -> list[str]:
    """docs/api.md: one key a line, optional ``label: key``, ``#`` comments; 0600 or refused."""
    try:
        mode = os.stat(path).st_mode
        text = Path(path).read_text()
    except OSError as exc:
        raise StartupError(f"cannot read --api-key-file {path}: {exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise StartupError(f"--api-key-file {path} is readable by other users; chmod 600 it")
    keys = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keys.append(line.split(":", 1)[1].strip() if ":" in line else line)
    if not keys:
        raise StartupError(f"--api-key-file {path} holds no key")
    return keys


class FakeTensorFold(FakeEngine):
    label = "fake-tensorfold"
    owned_by = "tensorfold"

    def __init__(self, args: argparse.Namespace, model_dir: Path, model_type: str | None) -> None:
        served = args.name or model_dir.name
        super().__init__(argparse.Namespace(
            served_model_name=served, model=str(model_dir), api_key=None, api_key_env=None,
            token_delay=float(os.environ.get("FAKE_TOKEN_DELAY", "0"))))
        self.aliases: list[str] = list(args.alias)
        keys = list(args.api_key)
        keys += [k.strip() for k in os.environ.get("TENSORFOLD_API_KEY", "").split(",") if k.strip()]
        if args.api_key_file:
            keys += read_key_file(args.api_key_file)
        self.api_keys = keys
        self.metrics_open: bool = args.metrics_open
        self.model_type = model_type
        self.sleep_enabled: bool = args.enable_sleep_mode
        self.sleep_token = ""
        if self.sleep_enabled:
            self.sleep_token = os.environ.get(args.sleep_token_env, "")
            self._check_sleep_opt_in(args)
        elif args.sleep_cache_dir:
            raise StartupError("--sleep-cache-dir requires --enable-sleep-mode")  # docs/model-sleep.md
        self.sleep_timeout: float = args.sleep_timeout
        self.wake_delay = float(os.environ.get("FAKE_TENSORFOLD_WAKE_DELAY", "0"))
        self.label_scoring = os.environ.get("FAKE_TENSORFOLD_NO_LABEL_SCORING") != "1"
        # lifecycle.py: awake, draining, sleeping, waking, error
        self.state, self.level, self.last_error = "awake", None, None
        self.active = 0  # admitted inference requests (lifecycle.admit)
        self.fail_next_wake = False
        self.stats.update({"sleep_calls": 0, "wake_calls": 0, "decisions": 0, "last_decisions_body": None,
                           "rejected_not_ready": 0})

    def _check_sleep_opt_in(self, args: argparse.Namespace) -> None:
        # docs/plans/model-sleep-level2.md: "require a secret from --sleep-token-env ... refuse
        # unsupported opt-ins"; docs/model-sleep.md: single-device CUDA, qwen3_5 and nemotron_h.
        if not self.sleep_token:
            raise StartupError(f"--enable-sleep-mode needs a secret in ${args.sleep_token_env}")
        devices = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        if len(devices) != 1 or args.tp != 1:
            raise StartupError("--enable-sleep-mode supports one CUDA device; tensor parallelism and hosts "
                               f"without a GPU are not implemented (CUDA_VISIBLE_DEVICES={devices})")
        if self.model_type not in SLEEP_FAMILIES:
            raise StartupError(f"--enable-sleep-mode: {self.model_type} has no sleep adapter "
                               f"(supported: {', '.join(SLEEP_FAMILIES)})")

    # -- TensorFold's error shapes ---------------------------------------------------------------
    @staticmethod
    def tf_error(status: int, message: str, code: str | None = None,
                 kind: str | None = None) -> web.Response:
        kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": code}},
                                 status=status)

    @staticmethod
    def lifecycle_error(status: int, message: str, code: str) -> web.Response:
        """lifecycle_http.py _error (12cd226a): a LifecycleError's body has no "param"."""
        kind = "invalid_request_error" if status < 500 else "server_error"
        return web.json_response({"error": {"message": message, "code": code, "type": kind}}, status=status)

    def snapshot(self) -> dict[str, Any]:
        """lifecycle.Lifecycle.snapshot"""
        return {"state": self.state, "ready": self.state == "awake", "is_sleeping": self.state == "sleeping",
                "level": self.level, "active_requests": self.active, "last_error": self.last_error}

    def control_route(self, request: web.Request) -> str | None:
        """lifecycle_http.control_route: enabled lifecycle routes, with or without /v1."""
        route = request.path.rstrip("/").removeprefix("/v1")
        if self.sleep_enabled and (request.method, route) in {
                ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")}:
            return route
        return None

    def key_matches(self, request: web.Request) -> bool:
        presented = []
        parts = request.headers.get("Authorization", "").split()
        if len(parts) == 2 and parts[0].lower() == "bearer":
            presented.append(parts[1])
        if request.headers.get("x-api-key"):
            presented.append(request.headers["x-api-key"].strip())
        return any(hmac.compare_digest(p.encode(), k.encode()) for p in presented for k in self.api_keys)

    @web.middleware
    async def auth(self, request: web.Request, handler):
        path = request.path
        if path.startswith("/fake/"):
            return await handler(request)
        if self.api_keys and request.method != "OPTIONS" and self.control_route(request) is None \
                and gated(path, self.metrics_open) and not self.key_matches(request):
            self.stats["unauthorized"] += 1
            message = "A valid API key is required"
            if path.rstrip("/") in MESSAGES_PATHS:
                payload = {"type": "error", "error": {"type": "authentication_error", "message": message}}
            else:
                payload = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}
            return web.json_response(payload, status=401, headers={"WWW-Authenticate": "Bearer"})
        if request.method == "POST" and path.rstrip("/") in INFERENCE_POSTS:
            return await self.admitted(request, handler)
        return await handler(request)

    async def admitted(self, request: web.Request, handler):
        """lifecycle.admit: the whole request is covered; none is admitted unless awake."""
        if self.state != "awake":
            self.stats["rejected_not_ready"] += 1
            # lifecycle.py admit (5d57908c): LifecycleError 503, sent by lifecycle_http.py post.
            return self.lifecycle_error(503, f"model is {self.state}; wake it before sending inference requests",
                                        "model_not_ready")
        self.active += 1
        try:
            return await handler(request)
        finally:
            self.active -= 1

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.auth])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/decisions", self.decisions)
        # docs/api.md "Route" table; vLLM's tokenizer shapes, OpenAI's and Anthropic's (fake_openai.py).
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses/{id}", self.get_response)
        app.router.add_delete("/v1/responses/{id}", self.delete_response)
        for prefix in ("", "/v1"):
            app.router.add_post(prefix + "/tokenize", self.tokenize)
            app.router.add_post(prefix + "/detokenize", self.detokenize)
        app.router.add_get("/fake/stats", self.fake_stats)
        app.router.add_post("/fake/fail_next_wake", self.fake_fail_next_wake)
        for prefix in ("", "/v1"):
            # Registered always: lifecycle_http answers 404 itself when sleep is off (after the API
            # key check for the /v1 forms, as auth_http gates every /v1 path).
            app.router.add_post(prefix + "/sleep", self.sleep)
            app.router.add_post(prefix + "/wake_up", self.wake_up)
            app.router.add_get(prefix + "/is_sleeping", self.is_sleeping)
        return app

    def stats_snapshot(self) -> dict[str, Any]:
        return {**super().stats_snapshot(), **self.snapshot(), "sleeping": self.state == "sleeping"}

    async def health(self, request: web.Request) -> web.Response:
        if self.api_keys:
            return web.json_response({"status": "ok"})  # docs/api.md: only this when keys are configured
        body: dict[str, Any] = {"status": "ok", "model": self.served_name}
        if self.sleep_enabled:  # lifecycle_http.health
            lifecycle = self.snapshot()
            body.update(lifecycle=lifecycle, ready=lifecycle["ready"])
        return web.json_response(body)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": self.owned_by}
            for name in (self.served_name, *self.aliases)]})

    async def _admit(self, request: web.Request) -> tuple[dict, web.Response | None]:
        # TensorFold answers to --name and every --alias (docs/api.md: /v1/models lists them). Whether it
        # refuses another id is not in its docs; the fake refuses it (404), so a wrong name shows in tests.
        body, refused = await super()._admit(request)
        if refused is not None and body.get("model") in self.aliases:
            return body, None
        return body, refused

    async def fake_fail_next_wake(self, request: web.Request) -> web.Response:
        self.fail_next_wake = True
        return web.json_response({"fail_next_wake": True})

    # -- /v1/decisions (decisions.py) ------------------------------------------------------------
    async def decisions(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self.tf_error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return self.tf_error(400, "the body must be a JSON object")
        if not self.label_scoring:
            return self.tf_error(400, "this engine has no label scoring: /v1/decisions is not served")
        try:
            answer = decide(body)
        except DecisionError as exc:
            return self.tf_error(400, str(exc))
        self.stats["decisions"] += 1
        self.stats["last_decisions_body"] = body
        return web.json_response(answer)

    # -- sleep (lifecycle_http.admin, lifecycle.Lifecycle) ------------------------------------------
    def _control_refusal(self, request: web.Request) -> web.Response | None:
        if self.control_route(request) is None:
            return self.tf_error(404, "unknown path")
        if "Origin" in request.headers:
            return self.lifecycle_error(403, "browser Origin requests cannot control model sleep",
                                        "sleep_origin_forbidden")
        parts = request.headers.getall("Authorization", [])
        parts = parts[0].split() if len(parts) == 1 else []
        if (not self.sleep_token or len(parts) != 2 or parts[0].lower() != "bearer"
                or not hmac.compare_digest(parts[1].encode(), self.sleep_token.encode())):
            return self.lifecycle_error(401, "a valid sleep bearer token is required", "invalid_sleep_token")
        return None

    def _answer(self, result: dict[str, Any]) -> web.Response:
        # CUDA memory figures (docs/model-sleep.md) and the discarded prefix caches (cuda/sleep.py).
        allocated = 0 if self.state == "sleeping" else FAKE_WEIGHT_BYTES
        return web.json_response({**result, "memory": {"allocated_bytes": allocated, "reserved_bytes": allocated},
                                  "cache": {"mode": "discard"}})

    async def sleep(self, request: web.Request) -> web.Response:
        refused = self._control_refusal(request)
        if refused is not None:
            return refused
        await request.read()
        query = {k: request.query.getall(k) for k in request.query}
        levels = query.pop("level", ["2"])
        if query or len(levels) != 1 or levels[0] != "2":  # lifecycle_http.py admin (12cd226a): 400
            return self.lifecycle_error(400, "this runtime supports sleep level 2 only", "unsupported_sleep_level")
        try:
            return self._answer(await self._sleep())
        except LifecycleError as exc:
            return self.lifecycle_error(exc.status, str(exc), exc.code)

    async def _sleep(self) -> dict[str, Any]:
        if self.state == "sleeping":
            return self.snapshot()  # completed repeats are idempotent
        if self.state != "awake":
            raise LifecycleError(f"cannot sleep while model is {self.state}")
        self.state = "draining"
        deadline = time.monotonic() + self.sleep_timeout
        while self.active:  # accepted requests, open streams included, finish first
            if time.monotonic() >= deadline:
                self.state, self.last_error = "awake", "request drain timed out; runtime remains awake"
                raise LifecycleError(self.last_error, code="sleep_drain_timeout")
            await asyncio.sleep(0.01)
        self.stats["sleep_calls"] += 1
        self.state, self.level, self.last_error = "sleeping", 2, None
        return self.snapshot()

    async def wake_up(self, request: web.Request) -> web.Response:
        refused = self._control_refusal(request)
        if refused is not None:
            return refused
        await request.read()
        if request.query:
            # lifecycle_http.py admin (12cd226a): /wake_up and /is_sleeping take no query, 400.
            return self.lifecycle_error(400, "this lifecycle route does not accept query parameters",
                                        "invalid_lifecycle_query")
        try:
            return self._answer(await self._wake())
        except LifecycleError as exc:
            return self.lifecycle_error(exc.status, str(exc), exc.code)

    async def _wake(self) -> dict[str, Any]:
        if self.state == "awake":
            return self.snapshot()
        if self.state != "sleeping":
            raise LifecycleError(f"cannot wake while model is {self.state}")
        self.state = "waking"
        self.stats["wake_calls"] += 1
        if self.wake_delay > 0:
            await asyncio.sleep(self.wake_delay)  # the checkpoint is verified and reloaded
        if self.fail_next_wake:
            self.fail_next_wake = False
            error = "RuntimeError: fake reload failure"
            self.state, self.last_error = "sleeping", error
            raise LifecycleError(f"wake failed; model remains sleeping: {error}", status=503,
                                 code="model_wake_failed")
        self.state, self.level, self.last_error = "awake", None, None
        return self.snapshot()

    async def is_sleeping(self, request: web.Request) -> web.Response:
        refused = self._control_refusal(request)
        if refused is not None:
            return refused
        if request.query:
            # lifecycle_http.py admin (12cd226a): /wake_up and /is_sleeping take no query, 400.
            return self.lifecycle_error(400, "this lifecycle route does not accept query parameters",
                                        "invalid_lifecycle_query")
        return self._answer(self.snapshot())


# -- decisions.py, without a model ----------------------------------------------------------------

def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    raise DecisionError("text must be a string, object, or array")


def _unknown(obj: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise DecisionError(f"unknown field {unknown[0]!r}")


def _validate(body: dict[str, Any]) -> float:
    _unknown(body, TOP_FIELDS)
    version = body.get("prompt_format_version")
    if version is not None and version != PROMPT_FORMAT_VERSION:
        raise DecisionError(f"prompt_format_version {version} is not served, this server uses version "
                            f"{PROMPT_FORMAT_VERSION}")
    temperature = body.get("temperature", 1)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or \
            not math.isfinite(temperature) or temperature <= 0:
        raise DecisionError("temperature must be a number above 0")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise DecisionError("chat_template_kwargs must be an object")
    if "enable_thinking" in kwargs and kwargs["enable_thinking"] is not False:
        raise DecisionError("decisions need enable_thinking false or unset")
    questions = body.get("questions")
    if not isinstance(questions, list) or not questions:
        raise DecisionError("questions must contain at least one question")
    seen: set[str] = set()
    for question in questions:
        if not isinstance(question, dict):
            raise DecisionError("each question must be an object")
        ident = question.get("id")
        if not isinstance(ident, str) or not ident.strip():
            raise DecisionError("a question id must not be blank")
        if ident in seen:
            raise DecisionError(f"question id {ident!r} is repeated")
        seen.add(ident)
    return float(body.get("temperature") or 1.0)


def _wording(text: str, question: dict[str, Any]) -> tuple[str, list[str], list[str], str]:
    """The question's kind, answer names, label texts the fake scores against, and prompt text."""
    kind = question.get("type")
    if kind not in QUESTION_FIELDS:
        raise DecisionError(f"unknown question type {kind!r}")
    _unknown(question, QUESTION_FIELDS[kind])
    lead = _text(question.get("question"))
    if not lead.strip():
        raise DecisionError("a question must not be blank")
    if kind == "choice":
        options = question.get("options")
        if not isinstance(options, list) or not 2 <= len(options) <= 26:
            raise DecisionError("a choice needs 2 to 26 options")
        names, details, seen = [], [], set()
        for option in options:
            if not isinstance(option, dict):
                raise DecisionError("each option must be an object")
            _unknown(option, OPTION_FIELDS)
            name = option.get("name")
            if not isinstance(name, str) or not name.strip() or any(ord(c) < 32 for c in name.strip()):
                raise DecisionError("option names must not be blank or contain line breaks")
            if name.strip().casefold() in seen:
                raise DecisionError(f"option name {name!r} repeats another name")
            seen.add(name.strip().casefold())
            names.append(name.strip())
            details.append(_text(option.get("description")))
        labels = list(string.ascii_uppercase[:len(names)])
        lines = [f"Question: {lead}", *(f"{lab}: {n} - {d}" if d else f"{lab}: {n}"
                                        for lab, n, d in zip(labels, names, details)),
                 "Answer with the letter of one option only."]
        return kind, names, names, "\n".join([text, "", *lines])
    if kind == "score":
        levels = question.get("levels")
        if not isinstance(levels, list) or not 2 <= len(levels) <= 10:
            raise DecisionError("a score needs 2 to 10 levels")
        details = [_text(level) for level in levels]
        if any(not d.strip() for d in details):
            raise DecisionError("a level must not be blank")
        names = [str(i) for i in range(len(details))]
        lines = [f"Question: {lead}", *(f"{n}: {d}" for n, d in zip(names, details)),
                 "Answer with the number of one level only."]
        return kind, names, details, "\n".join([text, "", *lines])
    yes, no = _text(question.get("yes")), _text(question.get("no"))
    lines = [f"Is the following true? {lead}", *([f"yes: {yes}"] if yes else []), *([f"no: {no}"] if no else []),
             "Answer with yes or no only."]
    return kind, ["yes", "no"], [lead, ""], "\n".join([text, "", *lines])


def decide(body: dict[str, Any]) -> dict[str, Any]:
    """decisions.build_response over fake label logits."""
    temperature = _validate(body)
    text = _text(body.get("input"))
    if not text.strip():
        raise DecisionError("input must not be blank")
    answers: dict[str, Any] = {}
    prompt_tokens = 0
    for index, question in enumerate(body["questions"]):
        try:
            kind, names, mentions, prompt = _wording(text, question)
        except DecisionError as exc:
            raise DecisionError(f"question {question['id']!r}: {exc}") from None
        haystack = text.casefold()
        logits = [4.0 if m.strip() and m.strip().casefold() in haystack else -0.5 * i
                  for i, m in enumerate(mentions)]
        peak = max(logits)  # decisions._softmax: shift before dividing by the temperature
        weights = [math.exp((logit - peak) / temperature) for logit in logits]
        total = math.fsum(weights)
        probabilities = [w / total for w in weights]
        answer: dict[str, Any] = {"type": kind, "probabilities": dict(zip(names, probabilities)),
                                  "label_mass": 0.9}
        if kind == "choice":
            answer["choice"] = names[probabilities.index(max(probabilities))]
        elif kind == "score":
            answer["score"] = math.fsum(i * p for i, p in enumerate(probabilities))
        ids = list(range(len(prompt.split())))
        if body.get("return_prompt_token_ids"):
            answer["prompt_token_ids"] = ids
            answer["label_token_ids"] = [1000 + i for i in range(len(names))]
        answers[question["id"]] = answer
        prompt_tokens += len(ids)
    return {"object": "decisions", "model": body.get("model") or "default",
            "prompt_format_version": PROMPT_FORMAT_VERSION, "answers": answers,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}}


# -- the command line (cli_args.py, cli.py) -------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tensorfold")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve")
    serve.add_argument("model")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--name", default="")
    serve.add_argument("--alias", action="append", default=[])
    serve.add_argument("--vision", action="store_true")
    serve.add_argument("--context", type=int, default=None)
    serve.add_argument("--max-tokens", type=int, default=4096)
    serve.add_argument("--temperature", type=float, default=None)
    serve.add_argument("--top-p", type=float, default=None)
    serve.add_argument("--top-k", type=int, default=None)
    serve.add_argument("--min-p", type=float, default=None)
    serve.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True)
    serve.add_argument("--reasoning-effort", choices=("low", "medium", "high", "xhigh"), default=None)
    serve.add_argument("--thinking-budget", type=int, default=0)
    serve.add_argument("--no-drafts", action="store_true")
    serve.add_argument("--drafter", default="auto")
    serve.add_argument("--parallel", default="auto")
    serve.add_argument("--no-update-check", action="store_true")
    serve.add_argument("--backend", choices=("auto", "mlx", "cuda"), default="auto")
    serve.add_argument("--tp", type=int, choices=(1, 2), default=1)
    serve.add_argument("--kv-dtype", choices=("bf16", "int8", "int4"), default="bf16")
    # docs/api.md "API keys"
    serve.add_argument("--api-key", action="append", default=[])
    serve.add_argument("--api-key-file", default=None)
    serve.add_argument("--metrics-open", action="store_true")
    # docs/model-sleep.md
    serve.add_argument("--enable-sleep-mode", action="store_true")
    serve.add_argument("--sleep-token-env", default="TENSORFOLD_SLEEP_TOKEN")
    serve.add_argument("--sleep-timeout", type=float, default=120.0)
    serve.add_argument("--sleep-cache-dir", default=None)
    return parser


def load(argv: list[str]) -> tuple[argparse.Namespace, FakeTensorFold]:
    """Parse as the real CLI does (argparse errors exit 2) and build the server (StartupError: exit 1)."""
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS and Path(argv[0]).is_dir():
        argv = ["serve", *argv]  # cli.py: `tensorfold MODEL ...` is `tensorfold serve MODEL ...`
    args = build_parser().parse_args(argv)
    if args.command != "serve":
        raise StartupError(f"the fake serves only; {args.command} is not modelled")
    model_dir = Path(args.model).expanduser()
    if not model_dir.is_dir():
        raise StartupError(f"{args.model} is neither a directory nor a Hugging Face repo id (owner/name)")
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise StartupError(f"{model_dir}/config.json: {exc}") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if args.sleep_timeout <= 0 or not math.isfinite(args.sleep_timeout):
        raise StartupError("sleep drain timeout must be finite and greater than zero")  # lifecycle.py
    return args, FakeTensorFold(args, model_dir, kind if isinstance(kind, str) else None)


def main(argv: list[str] | None = None) -> int:
    try:
        args, engine = load(list(sys.argv[1:] if argv is None else argv))
    except StartupError as exc:
        print(f"tensorfold: {exc}", file=sys.stderr)
        return 1
    print(f"[tensorfold] serving {engine.served_name} at http://{args.host}:{args.port}/v1", flush=True)
    web.run_app(engine.app(), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

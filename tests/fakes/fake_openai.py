"""The OpenAI-compatible core the fake vLLM and fake SGLang servers share.

A deterministic answer, token by token, with an optional per-token delay so a test can hold a
request in flight; every running request is tracked so the engine's park can abort it or refuse.
Run only through fake_vllm.py / fake_sglang.py.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from aiohttp import web

DEFAULT_MAX_TOKENS = 16


class Aborted(Exception):
    """The engine aborted this request (vLLM's default sleep, mode=abort, does this to running requests)."""


# vLLM 0.32.0 (the only engine here that aborts requests it is running: SGLang's release dies
# instead): pause_scheduler(mode="abort") finishes every running request with FinishReason.ABORT
# and sends it to the client as a finished output with no new tokens (vllm/v1/engine/core.py
# pause_scheduler, _send_abort_outputs; v1/engine/__init__.py FinishReason, "abort"). The OpenAI
# servers raise only for finish_reason "error" (entrypoints/generate/base/serving.py
# _raise_if_error), so the request ends as any other: 200 with the tokens generated so far and
# finish_reason "abort", or a streamed last chunk with that finish_reason, the usage chunk if asked,
# then [DONE] (entrypoints/openai/chat_completion/serving.py, completion/serving.py).
ABORT = "abort"


@dataclass
class Running:
    id: str
    abort: asyncio.Event = field(default_factory=asyncio.Event)


class FakeEngine:
    """State and routes common to both fakes; subclasses add the engine's own control routes."""

    label = "fake"
    owned_by = "fake"

    def __init__(self, args: argparse.Namespace) -> None:
        self.served_name: str = args.served_model_name or args.model
        self.model_path: str = args.model
        key = args.api_key
        if not key and args.api_key_env:
            key = os.environ.get(args.api_key_env) or None
        self.api_key: str | None = key
        self.token_delay: float = args.token_delay
        self.max_model_len = 8192
        self.created = int(time.time())
        self.running: dict[str, Running] = {}
        self.stats: dict[str, Any] = {"requests_total": 0, "completed": 0, "aborted": 0, "unauthorized": 0,
                                      "rejected_unavailable": 0}

    # -- hooks ---------------------------------------------------------------------------------
    def needs_auth(self, path: str) -> bool:
        return not path.startswith("/fake/")

    def unavailable_reason(self) -> str | None:
        """Why generation cannot run now (asleep, memory released), or None."""
        return None

    def extra_routes(self, app: web.Application) -> None:
        pass

    def stats_snapshot(self) -> dict[str, Any]:
        return {**self.stats, "in_flight": len(self.running)}

    # -- plumbing ------------------------------------------------------------------------------
    @web.middleware
    async def auth(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if self.api_key and self.needs_auth(request.path):
            if request.headers.get("Authorization") != f"Bearer {self.api_key}":
                self.stats["unauthorized"] += 1
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.auth])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        self.generation_routes(app)
        app.router.add_get("/fake/stats", self.fake_stats)
        self.extra_routes(app)
        return app

    @staticmethod
    def error(message: str, kind: str, status: int) -> web.Response:
        return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                                 status=status)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def fake_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats_snapshot())

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.served_name, "object": "model", "created": self.created, "owned_by": self.owned_by,
             "root": self.model_path, "parent": None, "max_model_len": self.max_model_len}]})

    # -- generation ----------------------------------------------------------------------------
    def answer_tokens(self, prompt: str, max_tokens: int) -> tuple[list[str], str]:
        words = f"{self.label} {self.served_name} answers: {prompt}".split()
        pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
        if len(pieces) > max_tokens:
            return pieces[:max_tokens], "length"
        return pieces, "stop"

    async def _admit(self, request: web.Request) -> tuple[dict, web.Response | None]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {}, self.error("the body is not JSON", "BadRequestError", 400)
        if not isinstance(body, dict):
            return {}, self.error("the body must be a JSON object", "BadRequestError", 400)
        if body.get("model") not in (None, self.served_name):
            return body, self.error(f"The model `{body.get('model')}` does not exist.", "NotFoundError", 404)
        reason = self.unavailable_reason()
        if reason:
            self.stats["rejected_unavailable"] += 1
            return body, self.error(reason, "ServiceUnavailableError", 503)
        return body, None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body, refused = await self._admit(request)
        if refused:
            return refused
        messages = body.get("messages") or []
        last_user = next((m.get("content", "") for m in reversed(messages)
                          if isinstance(m, dict) and m.get("role") == "user"), "")
        if isinstance(last_user, list):  # content parts
            last_user = " ".join(p.get("text", "") for p in last_user if isinstance(p, dict))
        prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in messages if isinstance(m, dict))
        return await self._generate(request, body, str(last_user), prompt_tokens, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body, refused = await self._admit(request)
        if refused:
            return refused
        prompt = body.get("prompt", "")
        prompt = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        return await self._generate(request, body, prompt, len(prompt.split()), chat=False)

    async def _generate(self, request: web.Request, body: dict, prompt: str, prompt_tokens: int,
                        chat: bool) -> web.StreamResponse:
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS)
        delay = float(body.get("fake_token_delay", self.token_delay))
        pieces, finish = self.answer_tokens(prompt, max_tokens)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        run = Running(rid)
        self.running[rid] = run
        self.stats["requests_total"] += 1
        try:
            if body.get("stream"):
                return await self._stream(request, body, run, pieces, finish, prompt_tokens, delay, chat)
            done = 0
            try:
                for _ in pieces:
                    await self._tick(run, delay)
                    done += 1
                self.stats["completed"] += 1
            except Aborted:
                self.stats["aborted"] += 1
                pieces, finish = pieces[:done], ABORT
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(pieces),
                     "total_tokens": prompt_tokens + len(pieces)}
            text = "".join(pieces)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                       "finish_reason": finish} if chat else
                      {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
            return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                      "created": int(time.time()), "model": self.served_name,
                                      "choices": [choice], "usage": usage})
        finally:
            self.running.pop(rid, None)

    async def _tick(self, run: Running, delay: float) -> None:
        if run.abort.is_set():
            raise Aborted()
        if delay > 0:
            try:
                await asyncio.wait_for(run.abort.wait(), delay)
            except asyncio.TimeoutError:
                return
            raise Aborted()

    async def _stream(self, request: web.Request, body: dict, run: Running, pieces: list[str], finish: str,
                      prompt_tokens: int, delay: float, chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: dict | str, finish_reason: str | None) -> bytes:
            choice = ({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason} if chat
                      else {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason})
            data = {"id": run.id, "object": obj, "created": int(time.time()), "model": self.served_name,
                    "choices": [choice]}
            return f"data: {json.dumps(data)}\n\n".encode()

        if chat:
            await resp.write(chunk({"role": "assistant", "content": ""}, None))
        sent = 0
        try:
            for piece in pieces:
                await self._tick(run, delay)
                await resp.write(chunk({"content": piece} if chat else piece, None))
                sent += 1
            self.stats["completed"] += 1
        except Aborted:  # the finish with no new tokens, as any other finish (see ABORT)
            self.stats["aborted"] += 1
            finish = ABORT
        await resp.write(chunk({} if chat else "", finish))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": run.id, "object": obj, "created": int(time.time()), "model": self.served_name,
                     "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": sent,
                                              "total_tokens": prompt_tokens + sent}}
            await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def abort_all(self) -> int:
        for run in self.running.values():
            run.abort.set()
        return len(self.running)

    # -- the other routes engines serve (each fake registers the ones its engine's source has) --------
    # Shapes: OpenAI's Responses and Anthropic's Messages (the official clients parse them), vLLM's
    # /tokenize {"prompt"} -> {"count", "max_model_len", "tokens"} and /detokenize {"tokens"} ->
    # {"prompt"} (vllm/entrypoints/serve/tokenize/protocol.py; TensorFold takes the same, docs/api.md),
    # vLLM's /v1/rerank and /v1/score (entrypoints/pooling/scoring/protocol.py).
    def generation_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)

    def word_ids(self, text: str) -> list[int]:
        """One "token" per word, numbered from the word's characters, so detokenize can invert it."""
        return [int.from_bytes(w.encode()[:7], "big") for w in text.split()]

    async def tokenize(self, request: web.Request) -> web.Response:
        body, refused = await self._admit(request)
        if refused:
            return refused
        text = body.get("prompt") if "prompt" in body else " ".join(
            str(m.get("content", "")) for m in body.get("messages") or [] if isinstance(m, dict))
        tokens = self.word_ids(str(text or ""))
        return web.json_response({"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens,
                                  "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.Response:
        body, refused = await self._admit(request)
        if refused:
            return refused
        words = [int(t).to_bytes(7, "big").lstrip(b"\0").decode(errors="replace") for t in body.get("tokens") or []]
        return web.json_response({"prompt": " ".join(words)})

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body, refused = await self._admit(request)
        if refused:
            return refused
        given = body.get("input", "")
        prompt = given if isinstance(given, str) else " ".join(
            str(m.get("content", "")) for m in given if isinstance(m, dict))
        pieces, _ = self.answer_tokens(prompt, int(body.get("max_output_tokens") or DEFAULT_MAX_TOKENS))
        rid = "resp_" + uuid.uuid4().hex
        text = "".join(pieces)
        message = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": text, "annotations": []}]}
        done = {"id": rid, "object": "response", "created_at": int(time.time()), "model": self.served_name,
                "status": "completed", "output": [message], "parallel_tool_calls": True, "tool_choice": "auto",
                "tools": [], "usage": {"input_tokens": len(prompt.split()), "output_tokens": len(pieces),
                                       "total_tokens": len(prompt.split()) + len(pieces),
                                       "input_tokens_details": {"cached_tokens": 0},
                                       "output_tokens_details": {"reasoning_tokens": 0}}}
        self.stats["requests_total"] += 1
        self.stored_responses()[rid] = done
        if not body.get("stream"):
            self.stats["completed"] += 1
            return web.json_response(done)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        events = [("response.created", {"response": {**done, "status": "in_progress", "output": []}})]
        events += [("response.output_text.delta", {"item_id": message["id"], "output_index": 0, "content_index": 0,
                                                   "delta": piece}) for piece in pieces]
        events += [("response.completed", {"response": done})]
        for number, (kind, data) in enumerate(events):
            event = {"type": kind, "sequence_number": number, **data}
            await resp.write(f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode())
        self.stats["completed"] += 1
        await resp.write_eof()
        return resp

    def stored_responses(self) -> dict[str, dict]:
        if not hasattr(self, "_stored_responses"):
            self._stored_responses: dict[str, dict] = {}
        return self._stored_responses

    async def get_response(self, request: web.Request) -> web.Response:
        stored = self.stored_responses().get(request.match_info["id"])
        if stored is None:
            return self.error(f"Response with id '{request.match_info['id']}' not found.", "invalid_request_error",
                              404)
        return web.json_response(stored)

    async def delete_response(self, request: web.Request) -> web.Response:
        if self.stored_responses().pop(request.match_info["id"], None) is None:
            return self.error(f"Response with id '{request.match_info['id']}' not found.", "invalid_request_error",
                              404)
        return web.json_response({"id": request.match_info["id"], "object": "response", "deleted": True})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body, refused = await self._admit(request)
        if refused:
            return refused
        prompt = " ".join(str(m.get("content", "")) for m in body.get("messages") or [] if isinstance(m, dict))
        pieces, finish = self.answer_tokens(prompt, int(body.get("max_tokens") or DEFAULT_MAX_TOKENS))
        mid = "msg_" + uuid.uuid4().hex
        usage = {"input_tokens": len(prompt.split()), "output_tokens": len(pieces)}
        stop = "max_tokens" if finish == "length" else "end_turn"
        self.stats["requests_total"] += 1
        if not body.get("stream"):
            self.stats["completed"] += 1
            return web.json_response({"id": mid, "type": "message", "role": "assistant", "model": self.served_name,
                                      "content": [{"type": "text", "text": "".join(pieces)}], "stop_reason": stop,
                                      "stop_sequence": None, "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        start = {"id": mid, "type": "message", "role": "assistant", "model": self.served_name, "content": [],
                 "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}
        events = [("message_start", {"message": start}),
                  ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})]
        events += [("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": piece}})
                   for piece in pieces]
        events += [("content_block_stop", {"index": 0}),
                   ("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None},
                                      "usage": {"output_tokens": len(pieces)}}),
                   ("message_stop", {})]
        for kind, data in events:
            await resp.write(f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode())
        self.stats["completed"] += 1
        await resp.write_eof()
        return resp

    async def count_tokens(self, request: web.Request) -> web.Response:
        body, refused = await self._admit(request)
        if refused:
            return refused
        prompt = " ".join(str(m.get("content", "")) for m in body.get("messages") or [] if isinstance(m, dict))
        return web.json_response({"input_tokens": len(prompt.split())})

    def vector(self, text: str) -> list[float]:
        """A deterministic unit vector for ``text`` (8 dimensions)."""
        raw = [b + 1.0 for b in hashlib.sha256(text.encode()).digest()[:8]]
        norm = sum(v * v for v in raw) ** 0.5
        return [v / norm for v in raw]

    async def embeddings(self, request: web.Request) -> web.Response:
        body, refused = await self._admit(request)
        if refused:
            return refused
        given = body.get("input", "")
        texts = [given] if isinstance(given, str) else [str(t) for t in given]
        tokens = sum(len(t.split()) for t in texts)
        return web.json_response({"object": "list", "model": self.served_name,
                                  "data": [{"object": "embedding", "index": i, "embedding": self.vector(t)}
                                           for i, t in enumerate(texts)],
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def relevance(self, query: str, document: str) -> float:
        """The share of the query's words the document holds."""
        words = set(query.lower().split())
        return len(words & set(document.lower().split())) / max(1, len(words))

    async def rerank(self, request: web.Request) -> web.Response:
        body, refused = await self._admit(request)
        if refused:
            return refused
        query, documents = str(body.get("query", "")), [str(d) for d in body.get("documents") or []]
        results = sorted(({"index": i, "document": {"text": d}, "relevance_score": self.relevance(query, d)}
                          for i, d in enumerate(documents)), key=lambda r: -r["relevance_score"])
        top = body.get("top_n")
        return web.json_response({"id": "rerank-" + uuid.uuid4().hex, "model": self.served_name,
                                  "results": results[:top] if top else results,
                                  "usage": {"total_tokens": len(query.split())}})

    async def score(self, request: web.Request) -> web.Response:
        body, refused = await self._admit(request)
        if refused:
            return refused
        left, right = body.get("text_1", body.get("queries", "")), body.get("text_2", body.get("documents", []))
        pairs = [(str(left), str(r)) for r in (right if isinstance(right, list) else [right])]
        return web.json_response({"id": "score-" + uuid.uuid4().hex, "object": "list", "model": self.served_name,
                                  "data": [{"index": i, "object": "score", "score": self.relevance(q, d)}
                                           for i, (q, d) in enumerate(pairs)],
                                  "usage": {"total_tokens": 0}})


def common_arguments(parser: argparse.ArgumentParser, default_key_env: str | None) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--api-key", default=None, help="the key clients must send as Authorization: Bearer")
    parser.add_argument("--api-key-env", default=default_key_env,
                        help="read the key from this environment variable when --api-key is not given")
    parser.add_argument("--token-delay", type=float, default=float(os.environ.get("FAKE_TOKEN_DELAY", "0")),
                        help="seconds per generated token (holds requests in flight)")
    parser.add_argument("--startup-delay", type=float, default=0.0,
                        help="seconds before the port opens, as a real engine loading weights")


def serve(engine: FakeEngine, host: str, port: int, startup_delay: float) -> None:
    if startup_delay > 0:
        time.sleep(startup_delay)
    # run_app stops cleanly on SIGTERM, as systemd stops a unit.
    web.run_app(engine.app(), host=host, port=port, print=None, access_log=None)

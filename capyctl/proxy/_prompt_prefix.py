"""The text a request's prompt begins with, for routing among a deployment's replicas by prefix
(Router.acquire's ``prompt``; controller/_replicas.py hashes it).

Only what precedes the model's answer counts, in the order the chat template lays it out:
system text first, then each message's role and text. Images, audio and tool schemas are left
out: two requests that differ only there still share their text prefix, which is all the
routing needs to guess where their KV state is. Embeddings and /v1/systemone are routed by load
alone (no prompt).
"""

from __future__ import annotations

from typing import Any

_SEPARATOR = "\x1e"  # between messages: no text a user sends is likely to hold it


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts (OpenAI's
    {"type": "text" | "input_text", "text": ...}, Anthropic's {"type": "text", "text": ...})."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def _messages(messages: Any) -> list[str]:
    if not isinstance(messages, list):
        return []
    return [f"{m.get('role', '')}:{_text(m.get('content'))}" for m in messages if isinstance(m, dict)]


def _chat(body: dict[str, Any]) -> list[str]:
    return _messages(body.get("messages"))


def _completions(body: dict[str, Any]) -> list[str]:
    prompt = body.get("prompt")
    return [prompt] if isinstance(prompt, str) else []  # a batch of prompts has no one prefix


def _responses(body: dict[str, Any]) -> list[str]:
    parts = [f"system:{body['instructions']}"] if isinstance(body.get("instructions"), str) else []
    given = body.get("input")
    return parts + ([f"user:{given}"] if isinstance(given, str) else _messages(given))


def _anthropic_messages(body: dict[str, Any]) -> list[str]:
    system = body.get("system")
    parts = [f"system:{_text(system)}"] if system else []
    return parts + _messages(body.get("messages"))


# Routes whose prompt is read, and the function reading it.
_READERS = {
    "/v1/chat/completions": _chat,
    "/v1/completions": _completions,
    "/v1/responses": _responses,
    "/v1/messages": _anthropic_messages,
}


def routing_prompt(path: str, body: dict[str, Any]) -> str | None:
    """The prompt text of a request on ``path`` (None: a route routed by load alone, or no text)."""
    reader = _READERS.get(path)
    if reader is None:
        return None
    text = _SEPARATOR.join(reader(body))
    return text or None

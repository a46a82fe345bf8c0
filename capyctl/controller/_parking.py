"""Parking you can check: the tier a deployment parks at, what its park really released, and a
proof after every wake that the model still generates what it generated before.

The proof: a short greedy generation (temperature 0, PROOF_MAX_TOKENS tokens, PROOF_PROMPT)
recorded at the first ready of a launch, and generated again after each wake; a wake whose text
differs (weights restored wrong, a resume into fresh memory) or whose generation fails is a failed
wake: the actor restarts the engine cleanly and records the result. After MAX_PROOF_FAILURES
failed proofs in a row the deployment's in-place park is turned off, with the reason.

The park record (kept in the store, shown by ``capyctl status`` and the metrics): the tier reached,
the wake's seconds, the proof's result, what the park was measured still holding.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

from ..errors import CapyError, EngineError
from ..scheduler import gpu_domain, ram_domain

log = logging.getLogger("capyctl.controller")

PROOF_PROMPT = "The capybara is the largest living rodent. It lives in"
PROOF_MAX_TOKENS = 8
MAX_PROOF_FAILURES = 3
# After an in-place park, GPU memory a deployment's processes still hold beyond this is "not
# released" (a sleeping vLLM keeps its CUDA context, some hundreds of MiB, and that stays charged).
# RAM: the cgroup's memory beyond the tier's charge and this slack stays charged.
RAM_RETAINED_SLACK = 64 << 20
# A local host's declaration of unified memory (the local host has no record in the store).
UNIFIED_MEMORY_ENV = "CAPYCTL_UNIFIED_MEMORY"


def park_tier(ctl: Any, spec: Any, host: str, record: dict[str, Any]) -> str:
    """The tier a deployment parks at on ``host`` (engines/_tiers.py); ``restart`` once repeated
    failed proofs turned its in-place park off (its park ``record``)."""
    from ..engines._tiers import RESTART, resolve_park_tier
    if record.get("in_place_disabled"):
        return RESTART
    try:
        adapter = ctl.adapter(spec)
    except CapyError:
        return RESTART
    return resolve_park_tier(adapter, spec, unified_memory=ctl.unified_memory(host))


def unified_memory(ctl: Any, host: str) -> bool:
    """Whether ``host``'s GPU and host memory are one pool: its record's declaration (the local
    host: CAPYCTL_UNIFIED_MEMORY), else what its GPUs' names make certain (hosts.unified_memory_default)."""
    from ..hosts import unified_memory_default
    declared: bool | None = None
    entry = ctl.hosts.entries.get(host) if hasattr(ctl, "hosts") else None
    record = getattr(entry, "record", None)
    if record is not None and getattr(record, "unified_memory", None) is not None:
        declared = bool(record.unified_memory)
    if host == "local":
        value = os.environ.get(UNIFIED_MEMORY_ENV, "").strip().lower()
        if value in ("1", "yes", "true"):
            declared = True
        elif value in ("0", "no", "false"):
            declared = False
    if declared is not None:
        return declared
    names = [d.model or "" for d in ctl.memory.ledger.host_domains(host) if d.kind == "gpu"]
    return bool(unified_memory_default(names))


async def generate_proof(session: Any, base_url: str, key: str | None, model: str,
                         capabilities: frozenset[str]) -> str:
    """The engine's greedy continuation of PROOF_PROMPT. /v1/completions where the engine serves it
    (no chat template in the way), else /v1/chat/completions. Raises EngineError (proof_failed)."""
    from ..engines._base import call
    common = {"model": model, "max_tokens": PROOF_MAX_TOKENS, "temperature": 0, "seed": 0, "stream": False}
    if "completions" in capabilities:
        body = await call(session, "POST", base_url, "/v1/completions", key,
                          json={**common, "prompt": PROOF_PROMPT}, code="proof_failed", what="the post-wake proof")
        text = _first_choice(body, "text")
    elif "chat" in capabilities:
        body = await call(session, "POST", base_url, "/v1/chat/completions", key,
                          json={**common, "messages": [{"role": "user", "content": PROOF_PROMPT}]},
                          code="proof_failed", what="the post-wake proof")
        message = _first_choice(body, "message")
        text = message.get("content") if isinstance(message, dict) else None
    else:
        raise EngineError("the engine serves neither completions nor chat: nothing to prove with",
                          code="proof_unavailable")
    if not isinstance(text, str):
        raise EngineError(f"the post-wake proof got no text: {str(body)[:200]}", code="proof_failed")
    return text


def _first_choice(body: Any, field: str) -> Any:
    if isinstance(body, dict) and isinstance(body.get("choices"), list) and body["choices"]:
        choice = body["choices"][0]
        return choice.get(field) if isinstance(choice, dict) else None
    return None


def proof_mismatch(expected: str, got: str) -> str:
    return f"after the wake the model generated {got[:80]!r} where it generated {expected[:80]!r} before the park"


async def measure_retained(ctl: Any, actor: Any) -> dict[str, int]:
    """What ``actor``, just parked in place, still holds by domain: its processes' memory on each
    card (NVML per process) and its unit's cgroup memory beyond its tier's RAM charge. Empty when
    nothing could be measured (no NVML, no cgroup figure): the tier's charge then stands."""
    from ._memory import read_gpus
    placed = ctl.memory.ledger.get(actor.name)
    if placed is None or not placed.parked_in_place:
        return {}
    held: dict[str, int] = {}
    if placed.gpus:
        gpus = await read_gpus(ctl, actor.host)
        for gpu in gpus or []:
            if int(gpu["index"]) not in placed.gpus:
                continue
            used = sum(int(p.get("used_memory") or 0) for p in gpu.get("processes") or []
                       if p.get("deployment") == actor.name)
            if used:
                held[gpu_domain(actor.host, int(gpu["index"]))] = used
    try:
        ram = await ctl.hosts.systemd(actor.host).memory_current(actor.unit)
    except (CapyError, AttributeError):
        ram = None
    if ram:
        charged = placed.footprint.parked_ram or 0
        if ram > charged + RAM_RETAINED_SLACK:
            held[ram_domain(actor.host)] = int(ram)
    return held


def new_record(tier: str) -> dict[str, Any]:
    return {"tier": tier, "parked_at": None, "parked_in_place": False, "wake_seconds": None, "woken_at": None,
            "proof": None, "proof_failures": 0, "retained": {}, "in_place_disabled": None, "reference": None}


def rounded(seconds: float) -> float:
    return math.floor(seconds * 1000 + 0.5) / 1000


def now() -> float:
    return time.time()


def park_stats(record: dict[str, Any]) -> dict[str, float]:
    """The park record as metric values (capyctl/proxy/_metrics.py)."""
    proof = record.get("proof") or {}
    return {"park_wake_seconds": float(record.get("wake_seconds") or 0.0),
            "park_proof_ok": 1.0 if proof.get("result") in ("passed", "recorded") else 0.0,
            "park_proof_failures": float(record.get("proof_failures") or 0),
            "park_retained_bytes": float(sum((record.get("retained") or {}).values())),
            **prompt_cache_stats(record)}


def prompt_cache_stats(record: dict[str, Any]) -> dict[str, float]:
    """The latest wake's prompt cache restore (controller/_prompt_cache.py) as metric values."""
    cache = record.get("prompt_cache") or {}
    restored = cache.get("state") == "restored"
    return {"park_prompt_cache_restored_tokens": float(cache.get("tokens") or 0) if restored else 0.0,
            "park_prompt_cache_seconds_saved": float(cache.get("seconds_saved") or 0.0) if restored else 0.0}

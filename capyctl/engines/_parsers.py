"""Tool-call and reasoning parsers for vLLM and SGLang, chosen from the model's family.

Without a tool-call parser vLLM and SGLang return a tool call as plain text in ``content``, and
vLLM refuses ``tool_choice: "auto"`` unless started with ``--enable-auto-tool-choice`` and
``--tool-call-parser`` (vllm/entrypoints/launchers/cli_args.py validate_parsed_serve_args). So
for ``tool_call_parser: auto`` / ``reasoning_parser: auto`` (the manifest's default) CapyCTL reads
the checkpoint's ``config.json`` (``model_type``) and chat template and picks the parser of that
family; the template says which markup the model emits, so a family's tool parser is chosen only
when the template has it. ``none`` renders no parser; a name is passed as written (the engine
checks it). The same option in ``engine_args`` wins: nothing is rendered for it.

Every name below is registered in the installed engines (checked by tests/unit/test_engine_parsers.py
against the sources when they are on disk):
- vLLM 0.32.0: vllm/tool_parsers/__init__.py (_TOOL_PARSERS_TO_REGISTER) and
  vllm/reasoning/__init__.py (_REASONING_PARSERS_TO_REGISTER);
- SGLang 0.5.23: sglang/srt/function_call/function_call_parser.py (FunctionCallParser.ToolCallParserEnum)
  and sglang/srt/parser/reasoning_parser.py (ReasoningParser.DetectorMap).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..spec import DeploymentSpec
from ._base import has_flag


TOOL_FLAG, REASONING_FLAG, AUTO_TOOL_CHOICE_FLAG = "--tool-call-parser", "--reasoning-parser", "--enable-auto-tool-choice"


@dataclass(frozen=True)
class FamilyRule:
    """One family's parsers by engine, each used only when the template holds its ``marker``."""

    model_types: tuple[str, ...]
    # (template marker, {engine kind: tool parser}), the first marker found wins.
    tools: tuple[tuple[str, dict[str, str]], ...] = ()
    reasoning: tuple[tuple[str, dict[str, str]], ...] = ()


_QWEN_TOOLS = (
    # Qwen3-Coder and Qwen3.5 templates: XML inside <tool_call> (<function=name>).
    ("<function=", {"vllm": "qwen3_coder", "sglang": "qwen3_coder"}),
    # Qwen2.5 / Qwen3: JSON inside <tool_call>; vLLM's qwen3_json is an alias of hermes there.
    ("<tool_call>", {"vllm": "hermes", "sglang": "qwen25"}),
)
_THINK = (("<think>", {"vllm": "qwen3", "sglang": "qwen3"}),)

FAMILIES: tuple[FamilyRule, ...] = (
    FamilyRule(("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next"), _QWEN_TOOLS,
               _THINK),
    # Llama 3.1-3.3: JSON tool calls after "Environment: ipython" / <|python_tag|>.
    FamilyRule(("llama",), (("<|python_tag|>", {"vllm": "llama3_json", "sglang": "llama3"}),
                            ("Environment: ipython", {"vllm": "llama3_json", "sglang": "llama3"}))),
    FamilyRule(("mistral", "mistral3", "ministral"), (("[TOOL_CALLS]", {"vllm": "mistral", "sglang": "mistral"}),)),
    FamilyRule(("deepseek_v3",), (("tool▁calls▁begin", {"vllm": "deepseek_v3", "sglang": "deepseekv3"}),),
               (("<think>", {"vllm": "deepseek_r1", "sglang": "deepseek-r1"}),)),
    FamilyRule(("gpt_oss",), (("<|call|>", {"vllm": "openai", "sglang": "gpt-oss"}),),
               (("<|channel|>", {"vllm": "openai_gptoss", "sglang": "gpt-oss"}),)),
    FamilyRule(("glm4_moe",), (("<tool_call>", {"vllm": "glm45", "sglang": "glm45"}),),
               (("<think>", {"vllm": "glm45", "sglang": "glm45"}),)),
    FamilyRule(("kimi_k2",), (("<|tool_calls_section_begin|>", {"vllm": "kimi_k2", "sglang": "kimi_k2"}),),
               (("<think>", {"vllm": "kimi_k2", "sglang": "kimi_k2"}),)),
)
PARSER_ENGINES = ("vllm", "sglang")


@dataclass(frozen=True)
class ParserChoice:
    """What one launch renders, and why: ``source`` is declared, off, engine_args, model_family,
    unsupported (the family's template lacks the markup), unknown_family or no_model_config."""

    tool_call_parser: str | None
    tool_source: str
    reasoning_parser: str | None
    reasoning_source: str
    model_type: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"tool_call_parser": self.tool_call_parser, "tool_call_parser_source": self.tool_source,
                "reasoning_parser": self.reasoning_parser, "reasoning_parser_source": self.reasoning_source,
                "model_type": self.model_type}


def read_model_type(model_path: str) -> str | None:
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("model_type") if isinstance(config, dict) else None
    return value if isinstance(value, str) else None


def read_chat_template(model_path: str) -> str:
    """The checkpoint's chat template text (every named one joined), from tokenizer_config.json,
    chat_template.jinja or chat_template.json; empty when it has none."""
    root = Path(model_path)
    texts: list[str] = []
    try:
        texts.append((root / "chat_template.jinja").read_text())
    except OSError:
        pass
    for name in ("tokenizer_config.json", "chat_template.json"):
        try:
            data = json.loads((root / name).read_text())
        except (OSError, ValueError):
            continue
        template = data.get("chat_template") if isinstance(data, dict) else None
        if isinstance(template, str):
            texts.append(template)
        elif isinstance(template, list):  # [{"name": ..., "template": ...}]
            texts += [t.get("template", "") for t in template if isinstance(t, dict)]
    return "\n".join(t for t in texts if isinstance(t, str))


def _by_family(rules: tuple[tuple[str, dict[str, str]], ...], template: str, kind: str) -> str | None:
    for marker, names in rules:
        if marker in template and kind in names:
            return names[kind]
    return None


def choose_parsers(kind: str, deployment: DeploymentSpec, model_path: str | None) -> ParserChoice:
    """The parsers a vLLM or SGLang launch of ``deployment`` renders (engine kind ``kind``)."""
    user = deployment.engine_args
    model_type = read_model_type(model_path) if model_path else None
    template = read_chat_template(model_path) if model_path else ""
    family = next((f for f in FAMILIES if model_type in f.model_types), None)

    def one(setting: str, flag: str, rules_of) -> tuple[str | None, str]:
        if has_flag(user, flag):
            return None, "engine_args"
        if setting == "none":
            return None, "off"
        if setting != "auto":
            return setting, "declared"
        if model_type is None:
            return None, "no_model_config"
        if family is None:
            return None, "unknown_family"
        name = _by_family(rules_of(family), template, kind)
        return (name, "model_family") if name else (None, "unsupported")

    tool, tool_source = one(deployment.tool_call_parser, TOOL_FLAG, lambda f: f.tools)
    reasoning, reasoning_source = one(deployment.reasoning_parser, REASONING_FLAG, lambda f: f.reasoning)
    return ParserChoice(tool, tool_source, reasoning, reasoning_source, model_type)


def parser_flags(kind: str, choice: ParserChoice, user: list[str]) -> list[str]:
    """The flags for ``choice``; vLLM serves tool_choice "auto" only with --enable-auto-tool-choice."""
    flags: list[str] = []
    if choice.tool_call_parser:
        flags += [TOOL_FLAG, choice.tool_call_parser]
        if kind == "vllm" and not has_flag(user, AUTO_TOOL_CHOICE_FLAG):
            flags.append(AUTO_TOOL_CHOICE_FLAG)
    if choice.reasoning_parser:
        flags += [REASONING_FLAG, choice.reasoning_parser]
    return flags

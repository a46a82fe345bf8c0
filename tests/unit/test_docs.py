"""The documentation cannot drift: every YAML example validates, and the manifest reference
is exactly what scripts/gen-docs makes from the models."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from capyctl.cli import spec_body
from capyctl.spec import DeploymentSpec, EngineSpec, ManifestError, parse_manifest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
GEN_DOCS = REPO / "scripts" / "gen-docs"
_YAML_BLOCK = re.compile(r"^```ya?ml[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)

# Pages the packaging issue promises; a missing one is a failure, not a silent pass.
REQUIRED_PAGES = ("quickstart.md", "manifest-reference.md", "engines-and-parking.md", "openai-endpoint.md",
                  "api-keys.md", "several-machines.md", "operations.md", "security.md")


def _yaml_blocks() -> list[tuple[str, int, str]]:
    blocks = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        for match in _YAML_BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 2  # the first line inside the fence
            blocks.append((page.name, line, match.group(1)))
    return blocks


YAML_BLOCKS = _yaml_blocks()


def test_required_pages_exist() -> None:
    missing = [name for name in REQUIRED_PAGES if not (DOCS / name).is_file()]
    assert not missing, f"docs pages missing: {missing}"


def test_docs_have_yaml_examples() -> None:
    # The parametrized test below would pass vacuously if the extraction found nothing.
    pages = {page for page, _, _ in YAML_BLOCKS}
    assert {"quickstart.md", "manifest-reference.md", "engines-and-parking.md"} <= pages, pages


@pytest.mark.parametrize("page,line,text", YAML_BLOCKS, ids=[f"{p}:{ln}" for p, ln, _ in YAML_BLOCKS])
def test_yaml_example_validates(page: str, line: int, text: str) -> None:
    if text.startswith("# /etc/capyctl/config.yaml"):  # an example of the daemon's config file
        from capyctl.config_file import ConfigError, parse_config
        try:
            parse_config(text, f"docs/{page}:{line}")
        except ConfigError as exc:
            pytest.fail(f"the config example at docs/{page} line {line} is not a valid config file:\n{exc}")
        return
    try:
        spec = parse_manifest(text, source=f"docs/{page}:{line}")
    except ManifestError as exc:
        pytest.fail(f"the YAML example at docs/{page} line {line} is not a valid manifest:\n{exc}")
    assert isinstance(spec, (DeploymentSpec, EngineSpec))
    # What the CLI sends the API (its defaults left out) is read back as the same manifest.
    assert type(spec).model_validate(spec_body(spec)) == spec


def test_extraction_finds_a_broken_example(tmp_path: Path) -> None:
    # The extraction and validation above must be able to fail: an invalid block is caught.
    page = "# x\n\n```yaml\nname: Bad Name\nengine: llama\nmodel: {path: relative.gguf}\n```\n"
    blocks = [m.group(1) for m in _YAML_BLOCK.finditer(page)]
    assert len(blocks) == 1
    with pytest.raises(ManifestError) as info:
        parse_manifest(blocks[0])
    fields = {p.field for p in info.value.problems}
    assert {"name", "model.path"} <= fields


def test_manifest_reference_is_generated_from_the_models() -> None:
    generated = subprocess.run([sys.executable, str(GEN_DOCS), "--print", "manifest-reference"],
                               check=True, capture_output=True, text=True, cwd=REPO).stdout
    committed = (DOCS / "manifest-reference.md").read_text()
    assert committed == generated, "docs/manifest-reference.md is stale: run .venv/bin/python scripts/gen-docs"


def test_manifest_reference_names_every_field() -> None:
    text = (DOCS / "manifest-reference.md").read_text()
    for model in (DeploymentSpec, EngineSpec):
        for name, field in model.model_fields.items():
            assert f"| `{name}` |" in text, f"{model.__name__}.{name} is missing from the reference"
            if field.description:
                assert field.description.replace("|", "\\|") in text


def test_docs_links_point_to_existing_pages() -> None:
    broken = []
    for page in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([^)#:\s]+\.md)(?:#[^)]*)?\)", page.read_text()):
            if not (DOCS / target).is_file():
                broken.append(f"{page.name} -> {target}")
    assert not broken, broken


def test_the_cli_leaves_defaults_out_of_what_it_sends() -> None:
    # A daemon older than the CLI refuses a field it does not know even at its default: a CLI that
    # sent on_host_loss: wait with every manifest could drive no daemon from before the field.
    base = "name: m\nengine: llama\nmodel: {path: /models/m.gguf}\n"
    assert spec_body(parse_manifest(base)) == {"name": "m", "engine": "llama", "model": {"path": "/models/m.gguf"}}
    assert spec_body(parse_manifest(base + "on_host_loss: move\n"))["on_host_loss"] == "move"

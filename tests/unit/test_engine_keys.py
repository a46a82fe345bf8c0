"""Per-launch engine keys must survive the engines' own command-line parsing."""

from __future__ import annotations

import argparse

from capyctl.controller._keys import new_engine_key


def test_engine_keys_never_look_like_options():
    # SGLang and vLLM take --api-key through argparse; a key starting with "-" made the fake
    # SGLang exit with status 2 once in 64 launches.
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--api-key")
    parser.add_argument("--port")
    for _ in range(2000):
        key = new_engine_key()
        assert len(key) == 64 and key.isalnum()
        assert parser.parse_args(["--api-key", key, "--port", "1"]).api_key == key

"""What the daemon leaves unimported until it is needed: each is measured idle RSS
(benchmarks/daemon_scale.py), so an eager import slipping back in is a regression."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_the_daemon_without_a_config_file_loads_neither_yaml_nor_the_systemone_models(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        import capyctl.daemon  # noqa: F401 (everything the daemon wires together)
        from capyctl import config_file
        config_file.build_config(path=Path({str(tmp_path / "missing.yaml")!r}), required=False,
                                 overrides=config_file.Overrides())
        lazy = ("yaml", "capyctl.proxy._systemone")
        print(" ".join(name for name in lazy if name in sys.modules))
    """)
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == ""

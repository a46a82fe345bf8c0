"""``python -m capyctl.bench``: the benchmark client, or ``--write-standalone PATH`` to
regenerate the single-file copy (benchmarks/capyctl_bench.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from . import main, standalone_source

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write-standalone":
        Path(sys.argv[2]).write_text(standalone_source())
        sys.exit(0)
    sys.exit(main())

"""capyctl/eventloop.py: the loop the daemon runs on, and the startup heap kept out of full collections."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_objects_alive_at_startup_are_out_of_the_collectors_sight_and_later_ones_are_not():
    # In a process of its own: freezing this test run's heap would outlast the test.
    code = textwrap.dedent("""
        import gc, json
        from capyctl import eventloop
        import capyctl.daemon  # the daemon's modules, as at its startup
        before = len(gc.get_objects())
        eventloop.freeze_startup_objects()
        after = len(gc.get_objects())

        class Node:
            pass

        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made after startup
        del a, b
        print(json.dumps({"before": before, "after": after, "frozen": gc.get_freeze_count(),
                          "collected": gc.collect()}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    import json
    seen = json.loads(out.stdout)
    assert seen["before"] > 10_000 and seen["after"] < 1_000 and seen["frozen"] >= seen["before"] // 2
    assert seen["collected"] >= 2  # what is made later is still collected


"""How many examples a hypothesis property test draws.

The whole search runs on the suite's own Python. scripts/test's runs of the unit tests on the
other supported Pythons set CAPYCTL_TEST_EXAMPLE_SHARE (a tenth): there the question is whether
the code runs the same on that interpreter, not a wider search of the same pure logic, which the
main run already made.
"""

from __future__ import annotations

import os


def examples(count: int) -> int:
    share = float(os.environ.get("CAPYCTL_TEST_EXAMPLE_SHARE", "1"))
    return max(1, round(count * share))

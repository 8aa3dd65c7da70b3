"""``python -m kvstack.cli ...``: the same as ``kvstack ...`` (``router --workers`` and ``up`` start their
child processes this way)."""

from __future__ import annotations

import sys

from kvstack.cli import main

if __name__ == "__main__":
    sys.exit(main())

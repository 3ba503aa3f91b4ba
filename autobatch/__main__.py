"""``python -m autobatch``: the same as the ``autobatch`` command."""

from __future__ import annotations

import sys

from autobatch.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m bench``: run the bench grid and write its outputs."""
from __future__ import annotations

import sys

from bench.cli import main

if __name__ == "__main__":
    sys.exit(main())

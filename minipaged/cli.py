"""What the four command-line programs share."""
from __future__ import annotations

import os
import sys


def prog_name(module: str) -> str:
    """argparse's `prog`: the console script's own name when started as one (`minipaged-worker`),
    else `python -m <module>`, so --help and usage errors name the command the user typed."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("minipaged") else f"python -m {module}"

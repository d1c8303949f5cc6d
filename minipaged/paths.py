"""Where compiled artefacts (the CPU kernels library, emulated CUDA kernels) are cached.

In a source tree they go to `<repo>/build/` as before; an installed package must not write into
site-packages (often read-only, and shared by every user), so there they go to the user's cache
directory, `$XDG_CACHE_HOME/minipaged` (default `~/.cache/minipaged`)."""
from __future__ import annotations

import os

PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def in_source_tree() -> bool:
    """True when the packages are imported from a checkout (pyproject.toml beside them)."""
    return os.path.isfile(os.path.join(PACKAGE_PARENT, "pyproject.toml"))


def build_dir(name: str) -> str:
    if in_source_tree():
        return os.path.join(PACKAGE_PARENT, "build", name)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "minipaged", name)

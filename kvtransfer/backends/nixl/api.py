"""NIXL's Python API from whichever NIXL build is installed.

The ``nixl`` meta-package installs both its CUDA 12 and CUDA 13 builds (about 230 MB of
libraries) and picks one at import. pdserve depends on one build only: ``nixl-cu12`` (which
runs on CPU memory and on CUDA 12 drivers), or ``nixl-cu13`` with the ``cuda13`` extra. The
API comes from the meta-package where it is installed, else from the CUDA 13 build, else
the CUDA 12 one.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_CANDIDATES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


def load() -> ModuleType:
    """The module holding ``nixl_agent`` and ``nixl_agent_config``; ImportError naming what was tried."""
    problems = []
    for name in _CANDIDATES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            problems.append(f"{name}: {exc}")
    raise ImportError("no NIXL build is importable (pip install nixl-cu12, or pdserve[cuda13]): " + "; ".join(problems))

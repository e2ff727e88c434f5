"""Guard against foreign packages with our generic top-level names.

``rollout``, ``instrumentation`` and ``traces`` are generic names (PyPI has a ``traces`` package, for
one). Each of our packages carries the marker ``__opsd_rollout_package__``; importing one of ours
through this check fails loudly when the name resolves to someone else's package.
"""

from __future__ import annotations

import importlib

MARKER = "__opsd_rollout_package__"


def require_own_package(name: str):
    """Import ``name`` and check it is opsd-rollout's package, else raise ``ImportError`` saying why."""
    module = importlib.import_module(name)
    if getattr(module, MARKER, None) != name:
        location = getattr(module, "__file__", None) or getattr(module, "__path__", "?")
        raise ImportError(
            f"`import {name}` resolved to {location}, which is not opsd-rollout's `{name}` package: another "
            f"distribution installs a top-level `{name}` module (e.g. `pip install traces`). Uninstall it "
            f"(`pip uninstall {name}`) or use a separate virtual environment for opsd-rollout.")
    return module

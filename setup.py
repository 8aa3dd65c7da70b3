"""kvstack's build: the project metadata is in pyproject.toml; this adds the compiled request path.

The modules every proxied request runs through (``COMPILED``) are compiled to C extensions with mypyc
(docs/design/compiled-request-path.md). ``KVSTACK_COMPILE=0`` builds pure Python: editable installs use it,
so that an edited module is the one imported (a built extension next to it would shadow it).
"""

from __future__ import annotations

import os

from setuptools import setup

COMPILED = [
    "kvstack/http/server.py",
    "kvstack/http/client.py",
    "kvstack/router/app.py",
    "kvstack/router/proxy.py",
    "kvstack/frontend/routing.py",
    "kvstack/frontend/registry.py",
    "kvstack/frontend/circuit.py",
    "kvstack/frontend/admission.py",
    "kvstack/engines/state.py",
    "kvstack/scheduling/scheduler.py",
]


def _extensions() -> list:
    if os.environ.get("KVSTACK_COMPILE", "1") == "0":
        return []
    from mypyc.build import mypycify

    # Third-party packages may be absent from an isolated build environment: their types are then Any.
    options = ["--ignore-missing-imports", "--config-file", "pyproject.toml"]
    return mypycify([*options, *(f"src/{path}" for path in COMPILED)], opt_level="3")


setup(ext_modules=_extensions())

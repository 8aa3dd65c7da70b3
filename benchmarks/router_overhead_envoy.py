"""The Envoy front end as a router_overhead target: real Envoy asking one ``kvstack epp`` where requests go.

``envoy_target(concurrency, transport)`` starts two commands in one `Group`: the picker (``kvstack epp
--routing round-robin --transport T``, default ``--fallbacks``; ``picker_transport`` resolves T) and Envoy
(``--concurrency N`` worker threads, no hot restart) on the bootstrap `kvstack.epp.envoy_config.bootstrap`
writes: listening on 127.0.0.1, the backend listed as the engine (``override_host``, the fallback-capable
configuration), no access log (a stdout line per request is Envoy CPU no other target spends). The run
reports CPU per process as ``picker`` and ``envoy``.

``ROUTER_OVERHEAD_PROFILE_PICKER=1`` runs each picker under cProfile, written at its stop to
``<logs>/<target>.picker.prof``: for finding where its CPU goes, not for the numbers (the profiler slows it).
"""

# mypy: disable-error-code="import-untyped"
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from procs import DEV_BIN, HOST, KVSTACK, Group, free_port
from router_overhead_targets import Target

from kvstack.epp.envoy_config import EnvoyOptions, bootstrap, render

ENVOY = DEV_BIN / "envoy"
NAME = "envoy+kvstack-epp"
PROFILE_ENV = "ROUTER_OVERHEAD_PROFILE_PICKER"


def envoy_version() -> str:
    out = subprocess.run([str(ENVOY), "--version"], capture_output=True, text=True, timeout=30)
    return out.stdout.strip().rsplit("version: ", 1)[-1]


def picker_transport(requested: str | None) -> str:
    """The transport kvstack epp runs with: ``requested`` (checked by kvstack epp's own parser, which exits
    naming the choices), else kvstack epp's default."""
    from kvstack.cli import build_parser

    flags = ["--transport", requested] if requested else []
    return str(build_parser().parse_args(["epp", *flags]).transport)


def envoy_target(concurrency: int, transport: str) -> Target:
    name = NAME if concurrency == 1 else f"{NAME} c{concurrency}"
    slug = name.replace(" ", "-").replace("+", "-")

    def start(backend: str, logs: Path) -> tuple[Group, str]:
        grpc_port, http_port, listen_port, admin_port = (free_port() for _ in range(4))
        args = ["epp", "--host", HOST, "--grpc-port", str(grpc_port), "--http-port", str(http_port)]
        args += ["--engine", backend, "--routing", "round-robin", "--transport", transport]
        args += ["--log-level", "warning"]
        picker = [str(KVSTACK), *args]
        if os.environ.get(PROFILE_ENV):
            profile = logs / f"{slug}.picker.prof"
            picker = [
                str(DEV_BIN / "python"),
                "-m",
                "cProfile",
                "-o",
                str(profile),
                "-m",
                "kvstack.cli",
                *args,
            ]
        options = EnvoyOptions(
            pickers=(f"{HOST}:{grpc_port}",),
            engines=(backend.removeprefix("http://"),),
            listen_host=HOST,
            listen_port=listen_port,
            admin_host=HOST,
            admin_port=admin_port,
            access_log=False,
        )
        config = logs / f"{slug}.envoy.yaml"
        config.write_text(render(bootstrap(options)))
        envoy = [str(ENVOY), "-c", str(config), "--disable-hot-restart", "--concurrency", str(concurrency)]
        envoy += ["--log-level", "warning"]
        return Group.start(slug, [picker, envoy], logs / f"{slug}.log"), f"http://{HOST}:{listen_port}"

    note = (
        f"Envoy --concurrency {concurrency} with one kvstack epp (round-robin, --transport {transport}); "
        "bootstrap from kvstack.epp.envoy_config, access log off"
    )
    return Target(name, start, note, processes=("picker", "envoy"))

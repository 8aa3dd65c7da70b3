"""File discovery: engines listed in a YAML file, polled and re-read when it changes.

``parse_engines_file`` reads the format (a mapping per engine, or a ``--engine`` string); the fields are
checked by ``kvstack.engines.specs``. ``FileDiscovery`` keeps the last good list while the file is missing or
invalid, and applies the whole next valid edit.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from pathlib import Path

import yaml

from kvstack.backoff import Backoff
from kvstack.engines.discovery.base import (
    RETRY_BACKOFF,
    Discovery,
    DiscoveryConfigError,
    ModelFetcher,
    by_url,
)
from kvstack.engines.discovery.static import parse_engine_spec
from kvstack.engines.specs import FIELDS, EngineSpecError, build_endpoint, with_default_scheme
from kvstack.engines.state import Endpoint

log = logging.getLogger(__name__)


def _file_entry(entry: object, where: str) -> Endpoint:
    if isinstance(entry, str):
        return parse_engine_spec(entry, where)
    if not isinstance(entry, dict):
        raise DiscoveryConfigError(f"{where}: expected a mapping with url, type, role, ... or a URL string")
    unknown = sorted(str(k) for k in entry if k not in FIELDS)
    if unknown:
        known = ", ".join(FIELDS)
        raise DiscoveryConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {known}")
    url = entry.get("url")
    models = entry.get("models") or None
    labels = entry.get("labels") or None
    try:
        return build_endpoint(
            where,
            with_default_scheme(url) if isinstance(url, str) else url,
            engine_type=_scalar(entry.get("type")),
            role=_scalar(entry.get("role")),
            models=[models] if isinstance(models, str) else models,
            node=_scalar(entry.get("node")),
            kv_events=_scalar(entry.get("kv_events")),
            labels={str(k): _scalar(v) for k, v in labels.items()} if isinstance(labels, dict) else labels,
        )
    except EngineSpecError as exc:
        raise DiscoveryConfigError(str(exc)) from None


def _scalar(value: object) -> object:
    """The text of a number: YAML reads ``node: 1`` as a number where the author wrote a name."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def parse_engines_file(text: str, source: str = "engines file") -> list[Endpoint]:
    """Parse the engines file; raises ``DiscoveryConfigError`` naming the file, entry and problem.

    Format (each entry may also be a ``parse_engine_spec`` string)::

        engines:
          - url: http://10.0.0.5:8000
            type: vllm            # vllm | sglang | trtllm | triton; default vllm
            role: both            # both | prefill | decode; default both
            models: [qwen-0.5b]   # default: ask the engine's /v1/models
            node: node-a
            kv_events: tcp://10.0.0.5:5557
            labels: {zone: a}
    """
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise DiscoveryConfigError(f"{source}: invalid YAML{at}: {problem}") from None
    if doc is None:
        # An empty file is more likely a half-written one than a wish for zero engines.
        raise DiscoveryConfigError(f"{source}: file is empty; write 'engines: []' to mean no engines")
    if not isinstance(doc, dict) or not isinstance(doc.get("engines"), list):
        raise DiscoveryConfigError(f"{source}: expected a mapping with the key 'engines' holding a list")
    if set(doc) != {"engines"}:
        unknown = ", ".join(sorted(str(k) for k in doc if k != "engines"))
        raise DiscoveryConfigError(f"{source}: unknown top-level key(s) {unknown}; only 'engines' is read")
    endpoints = [_file_entry(entry, f"{source}: engines[{i}]") for i, entry in enumerate(doc["engines"])]
    by_url(endpoints, source)
    return endpoints


class FileDiscovery(Discovery):
    """Engines from a YAML file (``parse_engines_file``), re-read when it changes.

    Every ``poll_interval_s`` the file's (mtime, size, inode) is compared with the last read; on a change
    the content hash decides whether to parse. A valid file publishes only the differences. A missing or
    invalid file keeps the last good engines and logs one error per distinct problem, naming the entry.
    One bad entry rejects the whole edit, not just that entry: applying the rest would remove the engine the
    entry meant (a typo in a URL being edited), and the file would no longer say what the router serves.
    Polling goes on whatever fails, so the next valid edit is applied.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        poll_interval_s: float = 2.0,
        fetch_models: ModelFetcher | None = None,
        model_backoff: Backoff = RETRY_BACKOFF,
    ) -> None:
        super().__init__(fetch_models=fetch_models, model_backoff=model_backoff)
        self._path = Path(path)
        self._poll_interval_s = poll_interval_s
        self._signature: tuple[int, int, int] | None = None
        self._good_digest: bytes | None = None
        self._loaded_once = False
        self._last_error: str | None = None

    def describe(self) -> str:
        return f"file {self._path}"

    async def _run(self) -> None:
        while True:
            try:
                self._poll()
            except Exception as exc:
                # A bug in reading must cost one poll, not reloading for good: nothing else would show that
                # the router stopped following the file.
                self._signature = None  # read it again next time
                self._fail(f"engines file {self._path}: unexpected error {exc!r}", exc_info=True)
            self._synced.set()
            await asyncio.sleep(self._poll_interval_s)

    def _poll(self) -> None:
        # Blocking stat/read on purpose: a small local file costs microseconds, less than a thread hop.
        try:
            st = os.stat(self._path)
            signature = (st.st_mtime_ns, st.st_size, st.st_ino)
            if signature == self._signature:
                return
            data = self._path.read_bytes()
        except OSError as e:
            self._signature = None
            self._fail(f"engines file {self._path}: cannot read it ({e.strerror or e})")
            return
        self._signature = signature
        digest = hashlib.sha256(data).digest()
        if digest == self._good_digest:
            self._last_error = None
            return
        try:
            endpoints = parse_engines_file(data.decode("utf-8"), f"engines file {self._path}")
        except UnicodeDecodeError as e:
            self._fail(f"engines file {self._path}: not UTF-8 text (byte {e.start})")
            return
        except DiscoveryConfigError as e:
            self._fail(str(e))
            return
        self._good_digest = digest
        self._loaded_once = True
        self._last_error = None
        self._publish({e.url: e for e in endpoints})
        log.info("engines file %s: loaded %d engines", self._path, len(endpoints))

    def _fail(self, message: str, *, exc_info: bool = False) -> None:
        if message == self._last_error:
            return
        self._last_error = message
        kept = (
            f"keeping the last good list ({len(self._published)} engines)"
            if self._loaded_once
            else ("no engines loaded from it yet")
        )
        log.error("%s; %s", message, kept, exc_info=exc_info)

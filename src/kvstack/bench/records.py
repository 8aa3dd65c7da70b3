"""What a benchmark run is given and what it returns: ``BenchConfig``, ``RequestRecord``, ``BenchResult``."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, Literal

from kvstack.bench.workloads import Workload

__all__ = ["BenchConfig", "BenchResult", "RequestRecord"]

Api = Literal["chat", "completions"]


@dataclass(kw_only=True)
class BenchConfig:
    """One run: a workload sent to one OpenAI-compatible server, bounded in requests and time.

    - ``url``: base URL of the server (``http://host:port`` or ``.../v1``); ``model``: the model name sent.
    - ``api``: ``"chat"`` sends ``/v1/chat/completions`` with messages, ``"completions"`` a flattened prompt.
    - ``max_concurrency``: requests in flight at most; arrivals beyond it wait at the client (their delay is
      reported as send lag, so an overloaded client is visible).
    - ``duration``: no request is sent later than this many seconds after the start; in-flight requests
      finish. ``max_requests``: at most this many requests. An endless workload needs one of the two.
    - ``request_timeout``: seconds per request, streaming included; a request over it is an error.
    - ``ignore_eos``: ask for exactly ``max_tokens`` tokens (vLLM's extension), so answer lengths are equal.
    - ``engine_metrics``: base URLs of the engines whose /metrics are read before and after the run, through
      the metric catalog of ``engine_type`` / ``engine_version`` (None = the newest); the second reading
      waits ``metrics_settle_s`` after the last response, for counters updated just after it.
    - ``session_header``: send each turn's session number in this request header (e.g. ``x-user-id``), for
      routers that keep a session on one engine by a header (production-stack's ``--session-key``).
    - ``progress``: show a live progress bar; ``label``: a name for reports.
    """

    url: str
    model: str
    workload: Workload
    api: Api = "chat"
    api_key: str | None = None
    max_concurrency: int = 64
    duration: float | None = None
    max_requests: int | None = None
    request_timeout: float = 300.0
    ignore_eos: bool = True
    engine_metrics: tuple[str, ...] = ()
    engine_type: str = "vllm"
    engine_version: str | None = None
    metrics_settle_s: float = 0.5
    session_header: str | None = None
    progress: bool = False
    label: str | None = None

    def validate(self) -> BenchConfig:
        """Raise ValueError naming the setting to fix; return self."""
        if self.api not in ("chat", "completions"):
            raise ValueError(f"api must be 'chat' or 'completions', not {self.api!r}")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        if self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be positive, got {self.request_timeout}")
        if self.duration is not None and self.duration <= 0:
            raise ValueError(f"duration must be positive, got {self.duration}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be at least 1, got {self.max_requests}")
        if self.workload.size is None and self.duration is None and self.max_requests is None:
            raise ValueError(
                f"the {self.workload.name} workload never ends by itself: give max_requests "
                "(--max-requests) or duration (--duration)"
            )
        return self

    @property
    def planned_requests(self) -> int | None:
        """Requests the run will send at most, when known before it starts."""
        sizes = [s for s in (self.workload.size, self.max_requests) if s is not None]
        return min(sizes) if sizes else None

    def describe(self) -> dict[str, Any]:
        """The settings a report shows (never the API key)."""
        return {
            "url": self.url,
            "model": self.model,
            "api": self.api,
            "max_concurrency": self.max_concurrency,
            "duration": self.duration,
            "max_requests": self.max_requests,
            "request_timeout": self.request_timeout,
            "ignore_eos": self.ignore_eos,
            "engine_metrics": list(self.engine_metrics),
            "engine_type": self.engine_type,
            "engine_version": self.engine_version,
            "session_header": self.session_header,
            "label": self.label,
        }


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds; ``*_s`` offsets are from the run's start."""

    index: int  # the workload's request number
    session: int
    round: int
    group: int | None
    planned_s: float  # planned arrival
    sent_s: float  # actually sent (later than planned when waiting on a previous round or a free slot)
    ttft: float | None = None  # send → first content
    e2e: float | None = None  # send → end of stream (or failure)
    itl: array[float] = field(default_factory=lambda: array("d"))  # gaps between content chunks
    prompt_tokens: int | None = None  # from usage
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when reported
    status: int | None = None  # HTTP status; None when no response arrived
    error: str | None = None
    engine: str | None = None  # the engine that served, from a response header (runner.ENGINE_HEADERS)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class BenchResult:
    """A run's records and summary (see ``kvstack.bench.summary``); ``config`` is None for a loaded report."""

    summary: dict[str, Any]
    records: list[RequestRecord]
    config: BenchConfig | None = None

"""An engine base URL parsed once: the connection key, its Host header and its path prefix (`Origin`)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["Origin"]


@dataclass(frozen=True, slots=True)
class Origin:
    """Where an engine base URL points: the connection key, its Host header and its path prefix."""

    scheme: str
    host: str
    port: int
    base_path: str
    host_header: str

    @classmethod
    def parse(cls, base_url: str) -> Origin:
        """The origin of an http(s) base URL; ``ValueError`` saying what is wrong with any other."""
        if not base_url.isprintable() or any(c.isspace() for c in base_url):
            # These would end up in the request head sent to the engine.
            raise ValueError(f"engine URL {base_url!r} contains whitespace or control characters")
        try:
            parts = urlsplit(base_url)
            port = parts.port  # raises for a port out of range or not a number
        except ValueError as exc:
            raise ValueError(f"engine URL {base_url!r} is not a valid URL: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine URL {base_url!r} is not http(s)://host[:port][/path]")
        if port == 0:
            raise ValueError(f"engine URL {base_url!r} has port 0 (the port must be 1-65535)")
        host_header = parts.netloc.rpartition("@")[2]
        port = port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"), host_header)

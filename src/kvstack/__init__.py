"""kvstack: a KV-cache-aware serving stack around vLLM engines."""

__version__ = "0.1.0"

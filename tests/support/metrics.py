"""Prometheus exposition pages as numbers: every sample by name and labels, a sum of samples, or a
counter's totals by label."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


def counter_totals(text: str, family: str, *labels: str) -> dict[tuple[str, ...], float]:
    """The ``_total`` samples of counter ``family`` in a /metrics page, keyed by the values of ``labels``."""
    return {
        tuple(sample.labels[name] for name in labels): sample.value
        for found in text_string_to_metric_families(text)
        if found.name == family
        for sample in found.samples
        if sample.name.endswith("_total")
    }


def sample_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` (exposition name, e.g. ``..._total``) whose labels include
    ``labels``; 0 when there is none."""
    return sum(
        sample.value
        for found in text_string_to_metric_families(text)
        for sample in found.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def samples(text: str) -> dict[str, float]:
    """Every sample keyed by exposition name plus its labels (without model_name/engine)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine")
            )
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """An engine's /metrics as `samples`."""
    async with http.get(f"{url}/metrics") as r:
        assert r.status == 200
        return samples(await r.text())

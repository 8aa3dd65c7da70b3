"""The name tables: version ranges and errors, their own consistency, and the router's signal catalogs built
from them (every signal source and alias is a name of the same engine type and versions, of a kind its
reading needs)."""

from __future__ import annotations

import pytest

from kvstack.engines.catalog import CATALOGS, MetricCatalog, Read, catalog_for
from kvstack.engines.names import ENGINE_NAMES, Kind, names_for, parse_version


def test_names_for_picks_by_type_and_version() -> None:
    newest = names_for("vllm")
    assert newest is names_for("vllm", "0.32.0") is names_for("vllm", "0.10") is names_for("vllm", "1.2")
    assert (newest.since, newest.until) == ("0.10", None)
    old = names_for("vllm", "0.9.1")
    assert (old.since, old.until, old.versions) == (None, "0.10", "< 0.10")
    assert "vllm:gpu_cache_usage_perc" in old.metrics and "vllm:gpu_cache_usage_perc" not in newest.metrics
    assert "vllm:kv_cache_usage_perc" in newest.metrics
    for engine_type in ("sglang", "trtllm", "triton"):
        assert names_for(engine_type, "9.9").engine_type == engine_type
    assert names_for("sglang").metrics["sglang:cache_config_info"].kind is Kind.INFO
    assert names_for("sglang").metrics["sglang:cache_config_info"].labels == {"page_size", "num_pages"}


def test_names_for_errors_name_what_is_known() -> None:
    with pytest.raises(
        ValueError, match=r"unknown engine type 'tgi'; known engine types: sglang, triton, trtllm, vllm"
    ):
        names_for("tgi")
    with pytest.raises(ValueError, match="cannot read engine version 'abc'"):
        names_for("vllm", "abc")
    assert parse_version("0.10.0") == (0, 10)


def test_vllm_0_32_families() -> None:
    table = names_for("vllm", "0.32.0").metrics
    assert table["vllm:prefix_cache_queries"].kind is Kind.COUNTER
    assert table["vllm:e2e_request_latency_seconds"].kind is Kind.HISTOGRAM
    assert table["vllm:cache_config_info"].kind is Kind.INFO
    assert {"block_size", "num_gpu_blocks", "engine"} <= table["vllm:cache_config_info"].labels
    assert table["vllm:request_success"].labels == {"model_name", "engine", "finished_reason"}
    assert table["vllm:admission_rejections"].labels == {"model_name", "reason"}
    assert table["vllm:estimated_flops_per_gpu"].kind is Kind.COUNTER  # defined as ..._total in vLLM's source
    assert table["vllm:spec_decode_num_drafts"].when == "speculative decoding configured"
    assert table["vllm:kv_block_lifetime_seconds"].when == "--kv-cache-metrics"
    assert table["vllm:lora_requests_info"].when and table["vllm:lora_requests_info"].kind is Kind.INFO
    assert table["vllm:num_requests_running"].when == ""
    assert not any(m.hidden for m in table.values())  # vLLM 0.32.0 hides no family


def test_tables_are_consistent() -> None:
    for table in ENGINE_NAMES:
        where = f"{table.engine_type} {table.versions}"
        for name, metric in table.metrics.items():
            assert metric.name == name, where
            assert not name.endswith(("_bucket", "_created")), (where, name)
            if metric.kind is Kind.COUNTER:
                assert not name.endswith("_total"), (where, name)  # counters are listed without it
        for name, retired in table.retired.items():
            assert retired.name == name and name not in table.metrics, (where, name)
            assert retired.replacement is None or retired.replacement in table.metrics, (where, name)
            assert retired.replacement is not None or retired.hint, (where, name)
            assert retired.source, (where, name)


def test_vllm_retired_names() -> None:
    retired = names_for("vllm").retired
    usage = retired["vllm:gpu_cache_usage_perc"]
    assert (usage.replacement, usage.deprecated_in, usage.removed_in) == (
        "vllm:kv_cache_usage_perc",
        "0.9.2",
        "0.11",
    )
    assert retired["vllm:gpu_prefix_cache_hits"].replacement == "vllm:prefix_cache_hits"
    assert retired["vllm:time_per_output_token_seconds"].replacement == "vllm:inter_token_latency_seconds"
    rate = retired["vllm:gpu_prefix_cache_hit_rate"]
    assert rate.replacement is None and "rate(vllm:prefix_cache_hits_total" in rate.hint
    assert retired["vllm:kv_offload_tiering_block_hits"].replacement == "vllm:kv_offload_tiering_chunk_hits"
    for name in ("vllm:num_requests_swapped", "vllm:cpu_cache_usage_perc", "vllm:cpu_prefix_cache_hit_rate"):
        assert retired[name].replacement is None and retired[name].hint


@pytest.mark.parametrize("catalog", CATALOGS, ids=lambda c: f"{c.engine_type} {c.versions}")
def test_router_catalogs_read_names_of_their_table(catalog: MetricCatalog) -> None:
    key = (catalog.engine_type, catalog.since, catalog.until)
    (table,) = [t for t in ENGINE_NAMES if (t.engine_type, t.since, t.until) == key]  # the same version range
    for signal, src in catalog.sources().items():
        metric = table.metrics.get(src.name)
        assert metric is not None, f"{catalog.engine_type} {signal}: {src.name} not in {table.versions}"
        expected = {Read.COUNTER: {Kind.COUNTER}, Read.LABEL: {Kind.INFO}, Read.GAUGE: {Kind.GAUGE}}[src.read]
        assert metric.kind in expected, (signal, src.name, metric.kind)
        if src.label is not None:
            assert src.label in metric.labels, (signal, src.name, src.label)
        for alias in src.aliases:
            retired = table.retired.get(alias.name)
            assert retired is not None and retired.replacement == src.name, (signal, alias.name)
            assert alias.renamed_in == retired.deprecated_in


def test_every_rename_of_a_read_name_is_an_alias() -> None:
    vllm = catalog_for("vllm")
    read = {src.name: src for src in vllm.sources().values()}
    for retired in names_for("vllm").retired.values():
        if retired.replacement in read:
            assert retired.name in {a.name for a in read[retired.replacement].aliases}

"""Exposition rules: the series names each kind of family is scraped as, and lookups across catalogs."""

from __future__ import annotations

from kvstack.board.catalogs import Catalog
from kvstack.board.series import SeriesIndex, exposed, split_suffix
from kvstack.engines.names import Kind, MetricName
from support.board_catalogs import VLLM_NEW, VLLM_OLD


def test_series_names_per_kind() -> None:
    assert exposed(MetricName("c", Kind.COUNTER)) == {"c_total": "_total", "c_created": "_created"}
    assert exposed(MetricName("c_total", Kind.COUNTER)) == {"c_total": "_total", "c_created": "_created"}
    assert exposed(MetricName("g", Kind.GAUGE)) == {"g": ""}
    assert exposed(MetricName("i_info", Kind.INFO)) == {"i_info": ""}
    assert list(exposed(MetricName("h_total", Kind.HISTOGRAM))) == [
        "h_total_bucket",
        "h_total_sum",
        "h_total_count",
        "h_total_created",
    ]
    assert list(exposed(MetricName("s", Kind.SUMMARY))) == ["s", "s_sum", "s_count", "s_created"]
    assert split_suffix("a_bucket") == ("a", "_bucket")
    assert split_suffix("_total") == ("_total", "")


def test_index_lookups() -> None:
    index = SeriesIndex([VLLM_NEW, VLLM_OLD])
    running = index.lookup("vllm:num_requests_running")
    assert [s.catalog.label for s in running] == ["vllm 0.32", "vllm 0.8"]
    (bucket,) = index.lookup("vllm:time_to_first_token_seconds_bucket")
    assert bucket.suffix == "_bucket" and "le" in bucket.labels()
    assert index.lookup("vllm:prompt_tokens") == []
    assert [c.label for c, _ in index.family("vllm:prompt_tokens")] == ["vllm 0.32", "vllm 0.8"]
    assert [c.label for c, _ in index.retired("vllm:gpu_cache_usage_perc")] == ["vllm 0.32"]
    assert index.series_name("vllm:prompt_tokens", "", VLLM_NEW) == "vllm:prompt_tokens_total"
    counter_total = Catalog("x", "engine", {"x_total": MetricName("x_total", Kind.COUNTER)})
    assert SeriesIndex([counter_total]).family("x")[0][1].name == "x_total"

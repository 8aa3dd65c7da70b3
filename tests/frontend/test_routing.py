"""What routing reads from a request (kvstack.frontend.routing): its id, its body's media type."""

from __future__ import annotations

import random
import re

import pytest

from kvstack.engines.state import Endpoint
from kvstack.frontend.registry import EngineRegistry
from kvstack.frontend.routing import REQUEST_ID_MAX, parse_route, request_id
from kvstack.openai.errors import OpenAIError


def test_a_short_printable_client_id_is_kept() -> None:
    assert request_id({"x-request-id": "abc-123"}) == "abc-123"


def test_a_missing_long_or_unprintable_id_is_replaced_by_24_hex_digits() -> None:
    for given in (None, "", "x" * (REQUEST_ID_MAX + 1), "tab\there", "caf\u00e9"):
        made = request_id({} if given is None else {"x-request-id": given})
        assert re.fullmatch(r"kvs-[0-9a-f]{24}", made), made


def test_a_new_id_is_the_generators_next_96_bits_zero_padded() -> None:
    state = random.getstate()
    try:
        random.seed(7)
        bits = random.getrandbits(96)
        random.seed(7)
        assert request_id({}) == f"kvs-{bits:024x}"
    finally:
        random.setstate(state)


def _registry() -> EngineRegistry:
    """One engine serving model "m"."""
    registry = EngineRegistry()
    registry.upsert(Endpoint("http://127.0.0.1:1", models=frozenset({"m"})))
    return registry


@pytest.mark.parametrize(
    "content_type",
    [None, "", "application/json", "Application/JSON; charset=utf-8", " application/json ;x=1"],
)
def test_json_bodies_are_parsed_whatever_the_content_type_spelling(content_type: str | None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    route = parse_route("/v1/completions", headers, b'{"model":"m"}', "rid", _registry())
    assert route.model == "m" and route.request_id == "rid"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded; charset=utf-8"])
def test_other_media_types_are_refused(content_type: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        parse_route("/v1/completions", {"content-type": content_type}, b"{}", "rid", _registry())
    assert refused.value.status == 400 and "Unsupported Media Type" in str(refused.value)  # as vLLM answers

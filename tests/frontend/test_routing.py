"""The request id every proxied request carries (kvstack.frontend.routing.request_id)."""

from __future__ import annotations

import random
import re

from kvstack.frontend.routing import REQUEST_ID_MAX, request_id


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

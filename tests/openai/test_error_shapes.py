"""The OpenAI error bodies (`kvstack.openai.errors`): key order, status and type of each constructor,
parameter wording, and FastAPI's ``detail`` shape."""

from __future__ import annotations

import msgspec
import pytest

from kvstack.openai import errors
from kvstack.openai.errors import OpenAIError


def test_error_body_shape_and_key_order() -> None:
    err = errors.not_found_model("nope", ["tiny"])
    assert list(err.body()["error"]) == ["message", "type", "param", "code"]
    assert err.to_json() == (
        b'{"error":{"message":"The model `nope` does not exist. Valid aliases: tiny.",'
        b'"type":"NotFoundError","param":"model","code":404}}'
    )


@pytest.mark.parametrize(
    ("err", "status", "err_type"),
    [
        (errors.bad_request("x"), 400, "BadRequestError"),
        (errors.invalid_parameter("x", "p", 1), 400, "BadRequestError"),
        (errors.invalid_json(3, "Expecting value"), 400, "Bad Request"),
        (errors.unsupported_media_type(), 400, "Bad Request"),
        (errors.too_long_prompt(2100, 2048), 400, "BadRequestError"),
        (errors.engine_overloaded(), 503, "Service Unavailable"),
        (errors.rate_limited("slow down"), 429, "RateLimitError"),
        (errors.internal_error(), 500, "InternalServerError"),
        (errors.service_unavailable(), 503, "ServiceUnavailableError"),
        (errors.gateway_timeout("engine http://e:8000 did not answer in 30s"), 504, "GatewayTimeoutError"),
    ],
)
def test_error_constructors(err: OpenAIError, status: int, err_type: str) -> None:
    assert (err.status, err.err_type) == (status, err_type)
    assert err.body()["error"]["code"] == status
    msgspec.json.decode(err.to_json())


def test_invalid_parameter_wording() -> None:
    assert errors.invalid_parameter("m", "p", 0).message == "m (parameter=p, value=0)"
    assert errors.invalid_parameter("m", "p").message == "m (parameter=p)"
    assert errors.invalid_parameter("m").message == "m"


def test_http_detail_errors() -> None:
    assert errors.http_detail(404).body() == {"detail": "Not Found"}
    assert errors.http_detail(405).body() == {"detail": "Method Not Allowed"}

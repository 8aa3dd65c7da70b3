"""OpenAI-shaped errors, matching what vLLM 0.32 returns for each kind of bad request.

Every error is an `OpenAIError` whose `body()` is ``{"error": {"message", "type", "param", "code"}}``
(vLLM's key order). The `type` string follows vLLM's two conventions, which tell a client which layer
refused the request:

- vLLM's serving code, and kvstack's router for its own decisions, use class-style names:
  ``BadRequestError`` (400), ``NotFoundError`` (404), ``UnprocessableEntityError`` (422), ``RateLimitError``
  (429, router only), ``InternalServerError`` (500), ``NotImplementedError`` (501),
  ``ServiceUnavailableError`` (503), ``GatewayTimeoutError`` (504, router only);
- the HTTP framework (body validation, bad JSON, wrong content type) and vLLM's admission control use the
  HTTP status phrase: ``Bad Request``, ``Service Unavailable``.

A few framework errors (unknown route, wrong method, undecodable body) are not OpenAI-shaped in vLLM at all:
they are ``{"detail": "..."}``; `http_detail` builds those.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import msgspec

_encoder = msgspec.json.Encoder()


class OpenAIError(Exception):
    """An HTTP error response in vLLM's OpenAI error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        err_type: str,
        param: str | None = None,
        *,
        detail_only: bool = False,
    ) -> None:
        # A message echoing a lone surrogate from the request would make the body unencodable.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.err_type = err_type
        self.param = param
        # FastAPI's own HTTP errors bypass vLLM's handlers and keep the {"detail": ...} shape.
        self.detail_only = detail_only

    def body(self) -> dict[str, Any]:
        """The JSON response body."""
        if self.detail_only:
            return {"detail": self.message}
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }

    def to_json(self) -> bytes:
        """The response body encoded compactly, as vLLM's JSONResponse does."""
        return _encoder.encode(self.body())

    def __repr__(self) -> str:
        return f"OpenAIError({self.status}, {self.message!r}, {self.err_type!r}, {self.param!r})"


def _with_parameter(message: str, param: str | None, value: object) -> str:
    # vLLM's VLLMValidationError appends "(parameter=..., value=...)" for whichever is not None.
    extras = []
    if param is not None:
        extras.append(f"parameter={param}")
    if value is not None:
        extras.append(f"value={value}")
    return f"{message} ({', '.join(extras)})" if extras else message


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    """400 BadRequestError with the message as given (vLLM's plain ValueError path)."""
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, "BadRequestError", param)


def invalid_parameter(message: str, param: str | None = None, value: object = None) -> OpenAIError:
    """400 BadRequestError for a rejected request parameter, worded like vLLM's VLLMValidationError."""
    return OpenAIError(
        HTTPStatus.BAD_REQUEST, _with_parameter(message, param, value), "BadRequestError", param
    )


def request_validation(errors: list[str], param: str | None) -> OpenAIError:
    """400 ``Bad Request`` for body validation failures, one rendered line per error, as FastAPI+vLLM."""
    if not errors:
        return OpenAIError(HTTPStatus.BAD_REQUEST, "Validation error", "Bad Request", param)
    count = len(errors)
    label = "error" if count == 1 else "errors"
    # vLLM bounds the dump so one malformed body cannot amplify into a huge response.
    shown = errors[:10]
    message = f"{count} validation {label}:\n" + "".join(f"  {line}\n" for line in shown)
    if count > len(shown):
        message += f"  ...and {count - len(shown)} more {label}\n"
    return OpenAIError(HTTPStatus.BAD_REQUEST, message.rstrip(), "Bad Request", param)


def invalid_json(pos: int, reason: str) -> OpenAIError:
    """400 for a body that is not valid JSON; `pos` is the character offset where decoding failed."""
    entry = {
        "type": "json_invalid",
        "loc": f"body.{pos}",
        "msg": "JSON decode error",
        "input": "<dict of 0 items>",
        "ctx": {"error": reason},
    }
    return request_validation([str(entry)], f"body.{pos}")


def unsupported_media_type() -> OpenAIError:
    """400 (not 415: vLLM reports it as a validation error) for a Content-Type other than JSON."""
    return request_validation(["Unsupported Media Type: Only 'application/json' is allowed"], None)


def not_found_model(name: str, valid: list[str] | tuple[str, ...]) -> OpenAIError:
    """404 for a `model` that is not one of the served names."""
    message = f"The model `{name}` does not exist. Valid aliases: {', '.join(valid)}."
    return OpenAIError(HTTPStatus.NOT_FOUND, message, "NotFoundError", "model")


def too_long_prompt(prompt_len: int, max_model_len: int, *, at_least: bool = False) -> OpenAIError:
    """400 for a prompt longer than the context; `at_least` when the count was cut off by truncation."""
    qualifier = "at least " if at_least else ""
    message = (
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
        f"contains {qualifier}{prompt_len} input tokens, which exceeds this limit even without any "
        f"output tokens. Please reduce the length of the input prompt."
    )
    return invalid_parameter(message, "input_tokens", prompt_len)


def http_detail(status: int, message: str | None = None) -> OpenAIError:
    """A framework-level error in FastAPI's ``{"detail": ...}`` shape (404 route, 405 method, bad body)."""
    phrase = HTTPStatus(status).phrase
    return OpenAIError(status, message or phrase, phrase, None, detail_only=True)


def unparsable_body() -> OpenAIError:
    """400 for a body FastAPI cannot even decode (e.g. invalid UTF-8)."""
    return http_detail(HTTPStatus.BAD_REQUEST, "There was an error parsing the body")


def engine_overloaded() -> OpenAIError:
    """503 as vLLM's admission control sends when its request queue is full."""
    message = (
        "The engine is currently busy and cannot accept new requests. "
        "Please try again later or on a different instance."
    )
    return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, message, HTTPStatus.SERVICE_UNAVAILABLE.phrase, None)


def rate_limited(message: str) -> OpenAIError:
    """429 RateLimitError, for the router's own admission limits."""
    return OpenAIError(HTTPStatus.TOO_MANY_REQUESTS, message, "RateLimitError", None)


def internal_error(message: str = "Internal server error") -> OpenAIError:
    """500 InternalServerError (vLLM's wording for a failed generation)."""
    return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, message, "InternalServerError", None)


def service_unavailable(message: str = "Request failed; please retry") -> OpenAIError:
    """503 ServiceUnavailableError: a transient failure that is safe to retry (vLLM's default wording)."""
    return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, message, "ServiceUnavailableError", None)


def gateway_timeout(message: str) -> OpenAIError:
    """504 GatewayTimeoutError, for an upstream engine that did not answer in time."""
    return OpenAIError(HTTPStatus.GATEWAY_TIMEOUT, message, "GatewayTimeoutError", None)

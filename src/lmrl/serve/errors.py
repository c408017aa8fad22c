"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the
status OpenAI answers the same fault with, so an agent's client raises the exception it
already handles (``openai.BadRequestError`` for 400, ``AuthenticationError`` for 401,
``NotFoundError`` for 404, ``RateLimitError`` for 429, ``InternalServerError`` for 5xx)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "APIError",
    "bad_request",
    "not_found",
    "over_context",
    "stopping",
    "too_large",
    "unauthorized",
]


class APIError(Exception):
    """A request the endpoint refuses: its HTTP status and OpenAI's error fields.

    Attributes:
        status: the HTTP status (400, 401, 404, 413, 429, 503...).
        message: one line naming the problem and the fix.
        type: OpenAI's error type (``invalid_request_error``, ``server_error``...).
        param: the request field at fault, or None.
        code: OpenAI's error code (``invalid_api_key``, ``model_not_found``,
            ``context_length_exceeded``...), or None.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key")


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, param=param, code=code)


def too_large(message: str) -> APIError:
    return APIError(413, message, code="request_too_large")


def over_context(message: str, param: str = "messages") -> APIError:
    return APIError(400, message, param=param, code="context_length_exceeded")


def stopping(message: str = "the server is stopping: no new requests are taken") -> APIError:
    return APIError(503, message, type="server_error", code="server_stopping")

"""One error hierarchy for the whole request path.

Every error a client can see is a `GatewayError`. Each subclass carries an
HTTP status and an OpenAI error `type`; `server/errors.py` renders them as
OpenAI error JSON, or as an SSE error event once a stream has begun.

    GatewayError
    ├── InvalidRequest          400 invalid_request_error
    │   └── ContextLengthExceeded 400 (code context_length_exceeded)
    ├── AuthenticationError     401 authentication_error
    ├── PermissionDenied        403 permission_error
    ├── ModelNotFound           404 not_found_error (code model_not_found)
    ├── NotFound                404 not_found_error
    ├── RequestTooLarge         413 invalid_request_error
    ├── RateLimited             429 rate_limit_error   (Retry-After)
    │   └── QueueFull           429 (code queue_full)
    ├── RequestTimeout          504 timeout_error
    ├── EngineError             500 internal_server_error
    └── ServiceUnavailable      503 service_unavailable (Retry-After)
        ├── QueueTimeout        503 (code queue_timeout)
        ├── EngineDead          503 (code engine_dead)
        └── ShuttingDown        503 (code shutting_down)
"""

from __future__ import annotations


class GatewayError(Exception):
    status: int = 500
    type: str = "internal_server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after = retry_after
        self.headers = dict(headers or {})

    def to_dict(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class AuthenticationError(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(GatewayError):
    status = 403
    type = "permission_error"
    code = "model_not_allowed"


class NotFound(GatewayError):
    status = 404
    type = "not_found_error"


class ModelNotFound(NotFound):
    code = "model_not_found"


class RequestTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class QueueFull(RateLimited):
    code = "queue_full"


class RequestTimeout(GatewayError):
    status = 504
    type = "timeout_error"
    code = "request_timeout"


class EngineError(GatewayError):
    status = 500
    type = "internal_server_error"
    code = "engine_error"


class ServiceUnavailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "service_unavailable"


class QueueTimeout(ServiceUnavailable):
    code = "queue_timeout"


class EngineDead(ServiceUnavailable):
    code = "engine_dead"


class ShuttingDown(ServiceUnavailable):
    code = "shutting_down"

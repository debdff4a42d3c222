"""What can go wrong on the request path, as kinds.

Every error a client can see is a `GatewayError`. A kind says what happened
and nothing about HTTP: `server/errors.py` holds the one table from kind to
status, API error type and `Retry-After`, for JSON bodies and SSE error
events alike. Routers decide fallback on the kind (`fallback_reason`).

    GatewayError                  (an internal error)
    ├── InvalidRequest            the request cannot be served as sent
    │   ├── ContextLengthExceeded
    │   ├── UnsupportedMediaType
    │   └── MethodNotAllowed
    ├── AuthenticationError       no key or an unknown key
    ├── PermissionDenied          the key may not do this
    ├── NotFound
    │   └── ModelNotFound
    ├── RequestTooLarge           the body is over the limit
    ├── UpstreamRejected          an upstream node's 4xx (relayed as is)
    ├── RateLimited               a per-key limit, or an upstream's 429
    │   ├── QueueFull             the model's queue is full
    │   └── DeadlineUnmeetable    its time-to-first-token deadline cannot be met
    ├── RequestTimeout            the request ran past its deadline
    ├── EngineError               the engine failed this request
    └── ServiceUnavailable        nothing can serve it now (retry later)
        ├── QueueTimeout          waited too long for an engine slot
        ├── EngineDead            no live engine (restarting)
        └── ShuttingDown          the server is draining
"""

from __future__ import annotations


class GatewayError(Exception):
    code: str | None = None  # a machine-readable detail, e.g. "queue_full"

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


class InvalidRequest(GatewayError):
    pass


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class UnsupportedMediaType(InvalidRequest):
    code = "unsupported_media_type"


class MethodNotAllowed(InvalidRequest):
    code = "method_not_allowed"


class AuthenticationError(GatewayError):
    code = "invalid_api_key"


class PermissionDenied(GatewayError):
    code = "model_not_allowed"


class NotFound(GatewayError):
    pass


class ModelNotFound(NotFound):
    code = "model_not_found"


class RequestTooLarge(GatewayError):
    code = "request_too_large"


class UpstreamRejected(GatewayError):
    """An upstream node refused the request (a 4xx): its status and body
    are relayed to the client as they are."""

    code = "upstream_rejected"

    def __init__(self, message: str, *, status: int, body: bytes, content_type: str = "application/json") -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.content_type = content_type


class RateLimited(GatewayError):
    code = "rate_limit_exceeded"


class QueueFull(RateLimited):
    code = "queue_full"


class DeadlineUnmeetable(RateLimited):
    """The request's time-to-first-token deadline cannot be met: the wait
    estimated at arrival is longer, or it passed while the request queued."""

    code = "deadline_unmeetable"


class RequestTimeout(GatewayError):
    code = "request_timeout"


class EngineError(GatewayError):
    code = "engine_error"


class ServiceUnavailable(GatewayError):
    code = "service_unavailable"


class QueueTimeout(ServiceUnavailable):
    code = "queue_timeout"


class EngineDead(ServiceUnavailable):
    code = "engine_dead"


class ShuttingDown(ServiceUnavailable):
    code = "shutting_down"


def fallback_reason(e: GatewayError) -> str | None:
    """Why a request that failed on one target (before its first token) may
    move to the next one, or None when no other target would do better: the
    request itself is bad, the key is over a limit, the deadline passed or
    the server is draining."""
    if isinstance(e, QueueFull):
        return "queue_full"
    if isinstance(e, QueueTimeout):
        return "queue_timeout"
    if isinstance(e, ShuttingDown | RequestTimeout):
        return None
    if isinstance(e, ServiceUnavailable):
        return "unavailable"
    if isinstance(e, RateLimited):  # an upstream's 429: another target may have room
        return "queue_full"
    if isinstance(e, EngineError) or type(e) is GatewayError:
        return "error"
    return None


def target_failed(e: GatewayError) -> bool:
    """Whether `e` says the target itself failed (for canary windows), as
    opposed to the request, the key, the queue or a shutdown."""
    if isinstance(e, QueueTimeout | ShuttingDown):
        return False
    return isinstance(e, EngineError | ServiceUnavailable) or type(e) is GatewayError

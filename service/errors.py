"""The service's exceptions, each carrying its HTTP status and the stable ``error_type`` of the JSON error envelope.

These classes are the one statement of which failure answers which status: the exception handlers in
:mod:`service.http.app`, the engine's error events and the routes all read ``status_code`` and ``error_type`` from the
error itself (:func:`http_status`), never from a table of their own. Errors of the planner and the loader (a plan
that cannot work, a broken checkpoint) are the request's inputs at fault and answer 422. Anything else is a 500
without its traceback.
"""

from __future__ import annotations

from planner.errors import LoadmasterError


class ServiceError(LoadmasterError):
    """Base of the errors the service answers to clients on purpose."""

    error_type = "generation"
    status_code = 500


class RequestValidationError(ServiceError, ValueError):
    """The request is malformed or outside the limits: fix the request."""

    error_type = "validation"
    status_code = 422


class OverloadedError(ServiceError):
    """Too many requests in flight; retry after ``retry_after`` seconds."""

    error_type = "overloaded"
    status_code = 429

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


#: Seconds a 503 (loading, draining) asks a client to wait before it retries (the ``Retry-After`` header).
NOT_READY_RETRY_AFTER_S = 5


class NotReadyError(ServiceError):
    """The model is still loading (or failed to load, or the server is shutting down)."""

    error_type = "not_ready"
    status_code = 503


class GenerationError(ServiceError):
    """Generation failed inside the engine (out of memory in a step, a model error)."""

    error_type = "generation"
    status_code = 500


class AuthError(ServiceError):
    """Missing or wrong API key."""

    error_type = "authentication"
    status_code = 401


class NotFoundError(ServiceError):
    """A model or resource named by the request does not exist (or is outside the allowed roots)."""

    error_type = "validation"
    status_code = 404

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code  # OpenAI's error code (model_not_found) under /v1


#: The status of the planner's and the loader's errors (:class:`LoadmasterError` outside the service's own): they
#: name what in the request's model, memory or checkpoint cannot work, which the client must change.
DOMAIN_ERROR_STATUS = 422


def http_status(exc: BaseException) -> int:
    """The HTTP status an exception answers with, read from its class."""
    if isinstance(exc, ServiceError):
        return exc.status_code
    if isinstance(exc, LoadmasterError):
        return DOMAIN_ERROR_STATUS
    return GenerationError.status_code


def openai_status(status: int, error_type: str) -> int:
    """OpenAI's clients expect 400 where loadmaster's own routes answer 422 for a request that fails validation."""
    return (
        400
        if error_type == RequestValidationError.error_type and status == RequestValidationError.status_code
        else status
    )

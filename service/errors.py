"""The service's exceptions, each with the ``error_type`` that goes into the JSON error envelope.

Routes raise these; one exception handler in :mod:`service.app` turns them into ``{"error", "error_type"}`` (or
OpenAI's shape under ``/v1``) with the status below. Anything else becomes a 500 without its traceback.
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

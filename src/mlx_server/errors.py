"""The exception tree. Each protocol maps these to its own error envelope in one place.

ServerError                      (500, api_error)
├── InvalidRequest               (400, invalid_request_error)
│   ├── ContextLengthExceeded    (400, code context_length_exceeded)
│   └── UnsupportedFeature       (400)
├── AuthenticationFailed         (401, authentication_error)
├── Forbidden                    (403, permission_error: a Host or web page not allowed)
├── NotFound                     (404, not_found_error)
├── MethodNotAllowed             (405)
├── RequestTooLarge              (413, request_too_large)
├── UnsupportedMediaType         (415: a web page's non-JSON body)
└── Overloaded                   (503, overloaded: queue full or shutting down; 529 on
                                  Anthropic's routes)
"""

from __future__ import annotations


class ServerError(Exception):
    status = 500
    kind = "api_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(ServerError):
    status = 400
    kind = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        prompt_tokens: int | None = None,
        max_tokens: int = 0,
    ):
        super().__init__(message, param=param)
        # The measured request, so a protocol can word its own message without measuring
        # the prompt again.
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens


class UnsupportedFeature(InvalidRequest):
    code = "unsupported"


class AuthenticationFailed(ServerError):
    status = 401
    kind = "authentication_error"
    code = "unauthorized"


class Forbidden(ServerError):
    status = 403
    kind = "permission_error"
    code = "forbidden"


class UnsupportedMediaType(ServerError):
    status = 415
    kind = "invalid_request_error"
    code = "unsupported_media_type"


class NotFound(ServerError):
    status = 404
    kind = "not_found_error"


class MethodNotAllowed(ServerError):
    status = 405
    kind = "invalid_request_error"


class RequestTooLarge(ServerError):
    status = 413
    kind = "request_too_large"


class Overloaded(ServerError):
    status = 503
    kind = "overloaded_error"

    def __init__(self, message: str, *, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after

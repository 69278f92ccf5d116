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
    """A request that does not fit the context. Carries llama.cpp's ``n_prompt_tokens`` and
    ``n_ctx``, which the error envelopes pass on: clients size their retry from them."""

    code = "context_length_exceeded"

    def __init__(
        self, message: str, *, param: str | None = None, n_prompt_tokens: int = 0, n_ctx: int = 0
    ):
        super().__init__(message, param=param)
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx

    @classmethod
    def overflow(
        cls, n_prompt: int, max_tokens: int | None, n_ctx: int, *, param: str, subject: str = ""
    ) -> ContextLengthExceeded:
        """The error for ``n_prompt`` tokens plus ``max_tokens`` (None: at least one token
        to generate) over ``n_ctx``; ``subject`` names the prompt when there are several."""
        return cls(
            overflow_message(n_prompt, max_tokens, n_ctx, subject),
            param=param,
            n_prompt_tokens=n_prompt,
            n_ctx=n_ctx,
        )

    def with_param(self, param: str | None, message: str | None = None) -> ContextLengthExceeded:
        """The same overflow, reported against another parameter (or worded otherwise)."""
        return ContextLengthExceeded(
            message or self.message,
            param=param,
            n_prompt_tokens=self.n_prompt_tokens,
            n_ctx=self.n_ctx,
        )


def overflow_message(n_prompt: int, max_tokens: int | None, n_ctx: int, subject: str = "") -> str:
    """One sentence that every common context-overflow detector recognises: llama.cpp's
    ``the request exceeds the available context size`` (Jan reloads with a larger context on
    it), OpenAI's ``maximum context length is`` and its code ``context_length_exceeded``."""
    about = f"{subject}: " if subject else ""
    if max_tokens is None:
        need = f"{about}prompt {n_prompt} tokens leaves no room to generate within context {n_ctx} tokens"
    else:
        need = (
            f"{about}prompt {n_prompt} tokens + max_tokens {max_tokens} = "
            f"{n_prompt + max_tokens} > context {n_ctx} tokens"
        )
    return (
        f"the request exceeds the available context size ({need}), try increasing it; "
        f"this server's maximum context length is {n_ctx} tokens (context_length_exceeded)"
    )


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


class ModelUnavailable(ServerError):
    """The model cannot compute: its first token failed after the readiness line (kernels
    still being built when the line came, ``EngineConfig.ready_after_s``)."""

    status = 503


class Overloaded(ServerError):
    status = 503
    kind = "overloaded_error"

    def __init__(self, message: str, *, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


def article(word: str) -> str:
    """The indefinite article before ``word`` in a message ("an embedding", "a rerank")."""
    return "an" if word[:1].lower() in ("a", "e", "i", "o", "u") else "a"

"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

Client mistakes (bad JSON, wrong types, unknown fields or models, values out of range) are 4xx
naming the field; only a bug in the server is a 500 (sent by `guard.Gate`, which keeps the
worker and the connection alive). FastAPI is imported only by the functions that use it, so
that `swiftlm deploy` without the serve extra can say which extra to install.
"""

# HTTP status -> OpenAI's error `type` for it.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "timeout_error",
}


class APIError(Exception):
    """A request that cannot be served, answered with `status` and an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    # A message may quote the client's input; what cannot be UTF-8 (an unpaired surrogate)
    # is escaped, or sending the error itself would fail.
    message, param = _encodable(message), _encodable(param)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _encodable(text: str | None) -> str | None:
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
):
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(status, message, param, code), status, headers=headers)


# Errors the request schemas raise themselves (serve.schemas): their message is a phrase that
# follows the field's name ("must be a string or ..."), and their context's "at" continues the
# location past what pydantic knows (".content", "[2]").
FORM_ERROR = "wrong_form"
# Tags of the schemas' unions (serve.schemas.one_of) start with it; pydantic puts the tag of
# the member it tried in an error's location, which means nothing to a client.
UNION_TAG = "="


def describe_validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """The first pydantic error as one sentence naming the field (`messages[0].content`), and
    the field's path as `param` (`messages.0.content`)."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    location = [
        part
        for part in first.get("loc", ())
        if part != "body" and not (isinstance(part, str) and part.startswith(UNION_TAG))
    ]
    param = ".".join(str(part) for part in location) or None
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in location).lstrip(".")
    kind, message = first.get("type", ""), first.get("msg", "invalid value")
    if kind == "extra_forbidden":
        return f"unknown field '{where}': it is not part of this API", param
    if kind == "json_invalid":
        return "the request body is not valid JSON", None
    if kind == "missing":
        return f"'{where}' is required", param
    if kind == FORM_ERROR:
        at = str((first.get("ctx") or {}).get("at", ""))  # ".content", "[2]", "[1][3]"
        where += at
        param = (param or "") + at.replace("[", ".").replace("]", "")
        return f"'{where}' {message}", param.lstrip(".") or None
    if param is None:
        return f"the request body is invalid: {message}", None
    return f"'{where}': {message}", param


def install_error_handlers(app) -> None:
    """Every error leaves the server as an OpenAI error object."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError):
        message, param = describe_validation_error(list(exc.errors()))
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        # Unknown routes (404) and wrong methods (405) come from the router.
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

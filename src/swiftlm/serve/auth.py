"""API keys: `Authorization: Bearer <key>`, compared in constant time."""

import hmac

# /health: what a load balancer or orchestrator probes without credentials. /: the chat page,
# which holds no secret; a browser cannot send a Bearer header when it opens a page, so the page
# asks for the key and sends it with each of its API calls.
PUBLIC_PATHS = frozenset({"/health", "/"})


def bearer_token(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def key_is_valid(token: str | None, keys: tuple[str, ...]) -> bool:
    """True when `token` equals one of `keys`. Every key is compared, each in constant time, so
    the answer's timing says nothing about how much of a key was right, nor which one."""
    if token is None:
        return False
    given = token.encode("utf-8")
    matches = [hmac.compare_digest(given, key.encode("utf-8")) for key in keys]
    return any(matches)

"""API keys (``--api-key``, ``CUTEINFER_API_KEY``): Bearer auth in front of every route but the
open ones, and the per-key prefix-cache namespace.

    Authorization: Bearer <key>  -> a key matches -> scope["state"]["key_salt"] -> the handler
    no key, or a wrong one       -> 401 in OpenAI's error JSON (code "invalid_api_key")

Open without a key, as vLLM leaves them: /health, /ping, /version and the OpenAPI schema and docs;
/metrics too unless ``--metrics-require-key``. Every other path needs a key, unknown ones included
(a stranger learns no route names), and the check runs before the body is read or a stream
starts. The middleware is pure ASGI, outside the body limit: a stranger's 50 MB body is refused
without being read.

Comparison: keys are kept as SHA-256 digests; the presented key is hashed and compared with every
digest by ``hmac.compare_digest`` (all of them, whatever matched), so the time taken tells neither
which key matched nor anything about a key's length or prefix.

Cache isolation: with keys in use (and ``--no-cache-isolation-per-key`` not given), each key gets
its own prefix-cache namespace, a salt derived from the key's digest (never the key itself: the
salt travels to the engine core). A client's right guess of another key's prompt is then computed
afresh: ``cached_tokens`` 0 and no faster first token. A request's own ``cache_salt`` (vLLM's
field) narrows the namespace further.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable, Iterable, Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from engine.server.protocol import APIError

# always open; /metrics joins them unless --metrics-require-key
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/openapi.json", "/docs",
                        "/docs/oauth2-redirect", "/redoc"})
_SALT_DOMAIN = b"cuteinfer prefix-cache namespace\0"


def parse_api_keys(values: Iterable[str] | None) -> list[str]:
    """Keys from repeated ``--api-key`` values (or the environment variable), each possibly a
    comma-separated list; blanks dropped, order kept, duplicates once."""
    keys: list[str] = []
    for value in values or ():
        for key in value.split(","):
            key = key.strip()
            if key and key not in keys:
                keys.append(key)
    return keys


class APIKeys:
    """The accepted keys, as digests. ``match`` -> the key's cache salt, or None."""

    def __init__(self, keys: Sequence[str], isolate_cache: bool = True) -> None:
        if not keys:
            raise ValueError("APIKeys needs at least one key")
        for k in keys:
            if not k.isascii() or not k.isprintable() or " " in k:
                raise ValueError("an API key must be printable ASCII without spaces (it travels "
                                 "in an HTTP header); choose another key")
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]
        self._salts = [
            "key:" + hashlib.sha256(_SALT_DOMAIN + d).hexdigest()[:32] if isolate_cache else ""
            for d in self._digests]

    def __len__(self) -> int:
        return len(self._digests)

    def match(self, authorization: bytes | None) -> str | None:
        """The cache salt of the key in an ``Authorization: Bearer <key>`` header value ("" with
        cache isolation off), or None when it names no accepted key."""
        if authorization is None:
            return None
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        presented = hashlib.sha256(token.strip()).digest()
        found = None
        for digest, salt in zip(self._digests, self._salts, strict=True):  # no early exit
            if hmac.compare_digest(presented, digest):
                found = salt
        return found


def request_salt(key_salt: str | None, cache_salt: str | None) -> str | None:
    """The prefix-cache salt of a request: its key's namespace, then its own ``cache_salt``."""
    if not key_salt:
        return cache_salt
    return key_salt if cache_salt is None else f"{key_salt}\0{cache_salt}"


class APIKeyAuth:
    """Pure ASGI middleware: a request to a path outside ``open_paths`` without an accepted key
    is answered 401 before the app (or the body limit) sees it."""

    def __init__(self, app: ASGIApp, keys: APIKeys, open_paths: frozenset[str] = OPEN_PATHS,
                 on_refuse: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = open_paths
        self.on_refuse = on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
                break
        salt = self.keys.match(header)
        if salt is None:
            await self._refuse(send, header is None)
            return
        scope.setdefault("state", {})["key_salt"] = salt
        await self.app(scope, receive, send)

    async def _refuse(self, send: Send, missing: bool) -> None:
        if self.on_refuse is not None:
            self.on_refuse(401)
        message = ("no API key provided: send it in an 'Authorization: Bearer <key>' header"
                   if missing else "incorrect API key provided (the Authorization header's "
                   "Bearer key is not one this server accepts)")
        body = json.dumps(APIError(message, 401, code="invalid_api_key").body(),
                          separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

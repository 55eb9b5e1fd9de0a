"""Bearer-token access control for the whole app, as one ASGI middleware.

Rules (``Settings.write_tokens`` / ``Settings.read_tokens``; for ``graphdeck serve`` they come
from ``GRAPHDECK_WRITE_TOKENS`` and ``GRAPHDECK_READ_TOKENS``, comma-separated):

* A **write** is any request whose method is not ``GET``, ``HEAD`` or ``OPTIONS`` — every route,
  present or added later, is covered because the check sits in front of the router, not in each
  handler. With write tokens configured a write needs ``Authorization: Bearer <write token>``:
  none → 401 (with ``WWW-Authenticate: Bearer``), a wrong one → 403. With **no** write tokens the
  server keeps its single-user behaviour for loopback clients (``127.0.0.0/8``, ``::1``) and
  answers 403 to writes from any other address, naming ``GRAPHDECK_WRITE_TOKENS``.
* A **read** is open unless read tokens are configured; then an API read (anything but the
  dashboard page ``/`` and its ``/static/`` assets) needs a read or a write token, as the bearer
  header or as the ``graphdeck_token`` cookie. ``GET /?token=<t>`` with a valid token sets that
  cookie (HttpOnly, SameSite=Strict) so the browser dashboard works. The cookie never
  authorises a write (no cross-site request can write).
* Tokens are compared with :func:`hmac.compare_digest` against every configured token (no early
  exit on the first match), as bytes.

Errors are the app's one error shape, ``{"ok": false, "error": ..., "status": ...}``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
from collections.abc import Iterable, Mapping
from http.cookies import SimpleCookie
from urllib.parse import parse_qs

log = logging.getLogger(__name__)

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
COOKIE_NAME = "graphdeck_token"
WRITE_TOKENS_ENV = "GRAPHDECK_WRITE_TOKENS"
READ_TOKENS_ENV = "GRAPHDECK_READ_TOKENS"
DATA_DIR_ENV = "GRAPHDECK_DATA_DIR"
#: Paths readable without a token even when reads need one (the page and its assets hold no data).
PUBLIC_READ_PREFIXES = ("/static/",)
PUBLIC_READ_PATHS = frozenset({"/", "/api/health"})


def tokens_from_env(environ: Mapping[str, str] | None = None) -> dict[str, tuple[str, ...]]:
    """``{"write_tokens": (...), "read_tokens": (...)}`` from ``GRAPHDECK_WRITE_TOKENS`` /
    ``GRAPHDECK_READ_TOKENS`` (comma-separated; blanks dropped), to pass to ``Settings``."""
    env = os.environ if environ is None else environ

    def split(name: str) -> tuple[str, ...]:
        return tuple(t.strip() for t in env.get(name, "").split(",") if t.strip())

    return {"write_tokens": split(WRITE_TOKENS_ENV), "read_tokens": split(READ_TOKENS_ENV)}


#: Operator limits read from the environment: variable → (``Settings`` field, type).
LIMIT_ENVS = {
    "GRAPHDECK_MAX_UPLOAD_BYTES": ("max_upload_bytes", int),
    "GRAPHDECK_MAX_DECOMPRESSED_BYTES": ("max_decompressed_bytes", int),
    "GRAPHDECK_MAX_DECOMPRESS_RATIO": ("max_decompress_ratio", float),
    "GRAPHDECK_UPLOAD_TTL_S": ("upload_ttl_s", float),
}


def settings_from_env(environ: Mapping[str, str] | None = None) -> dict:
    """The ``Settings`` fields ``graphdeck serve`` takes from the environment: the two token
    lists (:func:`tokens_from_env`), ``data_dir`` from ``GRAPHDECK_DATA_DIR`` and the limits of
    :data:`LIMIT_ENVS`, each when set.

    Raises:
        UsageError: a limit variable that is not a positive number (named in the message).
    """
    from graphdeck.errors import UsageError

    env = os.environ if environ is None else environ
    out: dict = dict(tokens_from_env(env))
    if env.get(DATA_DIR_ENV):
        out["data_dir"] = env[DATA_DIR_ENV]
    for name, (field, kind) in LIMIT_ENVS.items():
        raw = env.get(name, "").strip()
        if not raw:
            continue
        try:
            value = kind(raw)
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise UsageError(f"${name}={raw!r} is not a positive {'integer' if kind is int else 'number'}")
        out[field] = value
    return out


def token_matches(given: str | None, tokens: Iterable[str]) -> bool:
    """Whether ``given`` equals one of ``tokens``, compared in constant time per token."""
    if not given:
        return False
    given_b = given.encode("utf-8", "surrogateescape")
    ok = False
    for token in tokens:
        ok |= hmac.compare_digest(given_b, token.encode("utf-8", "surrogateescape"))
    return ok


def is_loopback(host: str | None) -> bool:
    """Whether the client address is on the loopback interface (``None``: unknown, so no)."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def bearer_token(headers: Mapping[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else ``None``."""
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def cookie_token(headers: Mapping[str, str]) -> str | None:
    cookie = SimpleCookie()
    try:
        cookie.load(headers.get("cookie", ""))
    except Exception:  # a malformed Cookie header is simply no cookie
        return None
    morsel = cookie.get(COOKIE_NAME)
    return morsel.value if morsel is not None else None


class TokenAuthMiddleware:
    """ASGI middleware enforcing the rules in the module docstring for ``settings``."""

    def __init__(self, app, settings):
        self.app = app
        self.write_tokens = tuple(settings.write_tokens)
        self.read_tokens = tuple(settings.read_tokens)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        method = scope.get("method", "GET").upper()
        path = scope.get("path", "/")
        denial = self._check(method, path, headers, (scope.get("client") or (None, None))[0])
        if denial is not None:
            status, message, extra = denial
            return await _send_error(send, status, message, extra)
        if method == "GET" and path == "/" and self.read_tokens:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            token = (query.get("token") or [None])[0]
            if token_matches(token, self.read_tokens + self.write_tokens):
                return await self.app(scope, receive, _setting_cookie(send, token))
        return await self.app(scope, receive, send)

    def _check(self, method: str, path: str, headers: dict, client_host: str | None):
        """``None`` when allowed, else ``(status, message, extra headers)``."""
        if method not in SAFE_METHODS:
            if not self.write_tokens:
                if is_loopback(client_host):
                    return None
                return (403, f"writes from {client_host or 'an unknown address'} are refused: this server has no "
                             f"write tokens ({WRITE_TOKENS_ENV}) and takes writes only from loopback", {})
            token = bearer_token(headers)
            if token is None:
                return (401, "this write needs a token: send 'Authorization: Bearer <token>' with one of the "
                             f"server's write tokens ({WRITE_TOKENS_ENV})", {"www-authenticate": "Bearer"})
            if not token_matches(token, self.write_tokens):
                return (403, "the bearer token is not a write token of this server", {})
            return None
        if not self.read_tokens or path in PUBLIC_READ_PATHS or path.startswith(PUBLIC_READ_PREFIXES):
            return None
        token = bearer_token(headers) or cookie_token(headers)
        if token is None:
            return (401, "reads on this server need a token: send 'Authorization: Bearer <token>' or open "
                         "/?token=<token> once in the browser", {"www-authenticate": "Bearer"})
        if not token_matches(token, self.read_tokens + self.write_tokens):
            return (403, "the token is not a read or write token of this server", {})
        return None


async def _send_error(send, status: int, message: str, extra: dict[str, str]) -> None:
    body = json.dumps({"ok": False, "error": message, "status": status}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in extra.items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _setting_cookie(send, token: str):
    cookie = SimpleCookie()
    cookie[COOKIE_NAME] = token
    cookie[COOKIE_NAME]["httponly"] = True
    cookie[COOKIE_NAME]["samesite"] = "Strict"
    cookie[COOKIE_NAME]["path"] = "/"
    header = cookie[COOKIE_NAME].OutputString().encode("latin-1")

    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", header)]}
        await send(message)

    return wrapped


def install(app, settings) -> None:
    """Put :class:`TokenAuthMiddleware` in front of ``app`` (called by ``create_app``)."""
    app.add_middleware(TokenAuthMiddleware, settings=settings)


def warn_if_exposed(host: str, settings) -> str | None:
    """A warning line when ``host`` is not loopback and no write tokens are set (writes from other
    hosts will be refused), else ``None``; ``graphdeck serve`` prints it."""
    if settings.write_tokens or host in ("localhost",) or is_loopback(host):
        return None
    return (f"warning: serving on {host} without write tokens: writes from other hosts will be refused "
            f"(set {WRITE_TOKENS_ENV}=<token>[,<token>...] to accept uploads from ranks on other hosts)")

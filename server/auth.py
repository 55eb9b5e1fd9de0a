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
* **Cross-site writes** (NOTE: [No simple writes]): a write (to a route that takes it) must be a
  request no page on another site can send: one with ``X-Graphdeck-Client: <any>`` (graphdeck's
  CLI and capture send ``1``), a bearer token, a method other than ``POST``, or a
  ``Content-Type`` outside the three a form can send (``application/json`` and
  ``application/gzip`` are fine; no ``Content-Type``, ``text/plain``,
  ``multipart/form-data`` and ``application/x-www-form-urlencoded`` are not) → else 403 naming
  the header. A write whose ``Origin`` is not this server's ``Host`` (``null`` included), or
  whose ``Sec-Fetch-Site`` is ``cross-site`` / ``same-site``, is a 403 whatever it carries.
* **Host names** (NOTE: [DNS rebinding]): a request that reached the server over loopback (its
  socket's local address is ``127.0.0.0/8`` or ``::1``) without a valid token must name a loopback
  host in ``Host``: ``localhost`` / ``*.localhost``, a loopback address (``127.0.0.1``, ``[::1]``),
  this machine's host name, or one of ``Settings.allowed_hosts`` (``GRAPHDECK_ALLOWED_HOSTS``,
  ``graphdeck serve --allowed-host``) → else 400 naming that setting. A server with both read and
  write tokens holds nothing a token-less request may reach, so it skips the check.
* **Body cap**: a write's body is capped at ``Settings.max_upload_bytes`` plus
  :data:`BODY_ENVELOPE_BYTES` (multipart framing): a larger ``Content-Length`` is a 413 before
  anything is read, and a body without one is counted as it arrives and refused (413) as soon as
  it passes the cap, so no route reads, spools or stores more than that.

Errors are the app's one error shape, ``{"ok": false, "error": ..., "status": ...}``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import socket
from collections.abc import Iterable, Mapping
from http.cookies import SimpleCookie
from urllib.parse import parse_qs, urlsplit

from fastapi.exceptions import HTTPException

log = logging.getLogger(__name__)

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
COOKIE_NAME = "graphdeck_token"
WRITE_TOKENS_ENV = "GRAPHDECK_WRITE_TOKENS"
READ_TOKENS_ENV = "GRAPHDECK_READ_TOKENS"
DATA_DIR_ENV = "GRAPHDECK_DATA_DIR"
ALLOWED_HOSTS_ENV = "GRAPHDECK_ALLOWED_HOSTS"
#: Paths readable without a token even when reads need one (the page and its assets hold no data).
PUBLIC_READ_PREFIXES = ("/static/",)
PUBLIC_READ_PATHS = frozenset({"/", "/api/health"})
#: The header graphdeck's own clients send on every write (any value; they send ``1``).
CLIENT_HEADER = "X-Graphdeck-Client"
#: Content types a page may send to another origin without a CORS preflight (the Fetch standard's
#: CORS-safelisted ``Content-Type`` values), compared by MIME essence.
SIMPLE_CONTENT_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data", "text/plain"})
#: ``Sec-Fetch-Site`` values of a request a page on another origin made (ports do not make a site).
CROSS_SITE = frozenset({"cross-site", "same-site"})
#: Room over ``max_upload_bytes`` for a write's body (multipart boundaries and part headers).
BODY_ENVELOPE_BYTES = 1 << 20


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
    "GRAPHDECK_LINK_GBPS": ("link_gbps", float),
}


def settings_from_env(environ: Mapping[str, str] | None = None) -> dict:
    """The ``Settings`` fields ``graphdeck serve`` takes from the environment: the two token
    lists (:func:`tokens_from_env`), ``allowed_hosts`` from ``GRAPHDECK_ALLOWED_HOSTS``
    (comma-separated), ``data_dir`` from ``GRAPHDECK_DATA_DIR`` and the limits of
    :data:`LIMIT_ENVS`, each when set.

    Raises:
        UsageError: a limit variable that is not a positive number (named in the message).
    """
    from graphdeck.errors import UsageError

    env = os.environ if environ is None else environ
    out: dict = dict(tokens_from_env(env))
    hosts = tuple(h.strip() for h in env.get(ALLOWED_HOSTS_ENV, "").split(",") if h.strip())
    if hosts:
        out["allowed_hosts"] = hosts
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
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is 127.0.0.1
    return (mapped or addr).is_loopback


def host_name(value: str | None) -> str | None:
    """The host name of a ``Host`` header value (``name[:port]``, ``[v6][:port]``), lower case,
    without a trailing dot; ``None`` for an empty or malformed one."""
    try:
        name = urlsplit("//" + (value or "").strip()).hostname
    except ValueError:  # bad port, bad brackets
        return None
    return name.rstrip(".").lower() if name else None


def loopback_host_allowed(value: str | None, allowed: Iterable[str]) -> bool:
    """Whether the ``Host`` header ``value`` names this machine by a name no other site can
    point at it (NOTE: [DNS rebinding]): ``localhost`` or ``*.localhost`` (RFC 6761: resolved to
    loopback by every browser), a loopback address literal, this machine's host name, or one of
    ``allowed`` (names, compared without case and port). No ``Host`` at all (HTTP/1.0, never a
    browser) is allowed."""
    if value is None:
        return True
    name = host_name(value)
    if name is None:
        return False
    if name == "localhost" or name.endswith(".localhost") or is_loopback(name):
        return True
    return name in {host_name(a) for a in allowed} | {socket.gethostname().rstrip(".").lower()}


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
        self.body_cap = int(settings.max_upload_bytes) + BODY_ENVELOPE_BYTES
        self.allowed_hosts = tuple(getattr(settings, "allowed_hosts", ()))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        method = scope.get("method", "GET").upper()
        path = scope.get("path", "/")
        denial = self._host_denial(scope, headers)
        if denial is None:
            denial = self._check(method, path, headers, (scope.get("client") or (None, None))[0])
        if denial is None and method not in SAFE_METHODS and _has_route(scope):
            denial = cross_site_denial(method, headers)
        if denial is None and method not in SAFE_METHODS:
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > self.body_cap:
                denial = (413, f"a request body of {length} bytes is larger than this server's {self.body_cap}-byte "
                               "limit (max_upload_bytes plus room for multipart framing)", {})
            receive = _capped(receive, self.body_cap)
        if denial is not None:
            status, message, extra = denial
            return await _send_error(send, status, message, extra)
        if method == "GET" and path == "/" and self.read_tokens:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            token = (query.get("token") or [None])[0]
            if token_matches(token, self.read_tokens + self.write_tokens):
                return await self.app(scope, receive, _setting_cookie(send, token))
        return await self.app(scope, receive, send)

    def _host_denial(self, scope, headers: dict):
        """NOTE: [DNS rebinding] A page of ``http://rebind.example:PORT`` whose name the attacker
        re-points at 127.0.0.1 is same-origin with this server as far as the browser knows: it
        may send any header (``X-Graphdeck-Client``, an ``Origin`` equal to ``Host``) and read the
        answers. What it cannot change is the ``Host`` its requests carry, so a request that came
        in over loopback must name this machine (:func:`loopback_host_allowed`) unless it holds a
        valid token (a rebinding page has none: the cookie was set for the real host name)."""
        if self.write_tokens and self.read_tokens:
            return None
        local = (scope.get("server") or (None, None))[0]
        if not is_loopback(local if isinstance(local, str) else None):
            return None
        host = headers.get("host")
        if loopback_host_allowed(host, self.allowed_hosts):
            return None
        given = bearer_token(headers) or cookie_token(headers)
        if given is not None and token_matches(given, self.read_tokens + self.write_tokens):
            return None
        return (400, f"the Host {host[:200]!r} is not a name of this machine: a loopback server answers only "
                     "localhost, 127.0.0.1, [::1], its host name and the names in its allowed hosts (a page "
                     "of another site re-pointed at 127.0.0.1 would send its own name); add the name with "
                     f"'graphdeck serve --allowed-host NAME' or {ALLOWED_HOSTS_ENV}=NAME[,NAME...]", {})

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


def cross_site_denial(method: str, headers: Mapping[str, str]):
    """``None`` when a write could not have been sent by a page on another origin, else
    ``(403, message, {})``; ``headers`` keyed in lower case.

    NOTE: [No simple writes] With no write tokens a loopback client may write, and a browser on
    this machine is a loopback client: any page it shows (another origin, another port of
    localhost) could POST a form or a ``fetch(..., {mode: "no-cors"})`` here, and that request
    does not need CORS to be *sent* — only to read the answer. What such a page cannot send
    without a CORS preflight (which this server never grants: it has no CORS headers) is a
    "non-simple" request: a method other than GET/HEAD/POST, a header outside the safelist
    (``X-Graphdeck-Client``, ``Authorization``), or a ``Content-Type`` other than the three a form
    can send (a ``no-cors`` fetch silently drops any other, so no ``Content-Type`` is as simple as
    ``text/plain``). So every write must be non-simple; the ``Origin`` / ``Sec-Fetch-Site``
    checks catch what browsers announce on top.
    """
    origin = headers.get("origin")
    if origin is not None and not _same_origin(origin, headers):
        return (403, f"a write from a page of another origin ({origin[:200]}) is refused: this server "
                     f"({headers.get('host', '?')[:200]}) takes writes only from its own clients", {})
    if headers.get("sec-fetch-site", "").lower() in CROSS_SITE:
        return (403, "a write a page of another site made (Sec-Fetch-Site: "
                     f"{headers['sec-fetch-site'][:40]}) is refused", {})
    if method != "POST" or headers.get(CLIENT_HEADER.lower()) or "authorization" in headers:
        return None
    content_type = headers.get("content-type")
    essence = (content_type or "").split(";", 1)[0].strip().lower()
    if content_type is not None and essence not in SIMPLE_CONTENT_TYPES:
        return None
    what = f"Content-Type {essence!r}" if content_type is not None else "no Content-Type"
    return (403, f"this write ({what}, no {CLIENT_HEADER} header) is a request any web page could send, so it "
                 f"is refused: send the header '{CLIENT_HEADER}: 1' (graphdeck's CLI and capture do)", {})


def _same_origin(origin: str, headers: Mapping[str, str]) -> bool:
    """Whether ``origin`` (scheme://host[:port]) names the host and port this request was sent to
    (its ``Host``, or the ``X-Forwarded-Host`` a proxy in front of the server set); ``null`` never."""
    try:
        o = urlsplit(origin.strip())
        default = {"http": 80, "https": 443}.get(o.scheme.lower())
        want = (o.hostname, o.port or default)
        if not o.hostname or not default:
            return False
        for name in ("host", "x-forwarded-host"):
            value = headers.get(name, "").split(",", 1)[0].strip()
            if value:
                h = urlsplit("//" + value)
                if (h.hostname, h.port or default) == want:
                    return True
    except ValueError:  # a malformed Origin or Host (bad port, bad brackets) is no match
        return False
    return False


def _has_route(scope) -> bool:
    """Whether a route of the app takes this method and path (else the router answers 404/405 and
    nothing is written, so the cross-site rule stays out of the way of those answers)."""
    from starlette.routing import Match

    router = getattr(scope.get("app"), "router", None)
    try:
        return router is None or any(route.matches(scope)[0] == Match.FULL for route in router.routes)
    except Exception:  # noqa: BLE001 - a router this check cannot ask: the rule applies
        return True


class BodyTooLarge(HTTPException):
    """413 raised from ``receive`` as a write's body passes the cap: an ``HTTPException``, so
    FastAPI lets it out of a form parse (any other error there becomes a bare 400) and the app
    renders it in its error shape."""

    def __init__(self, cap: int):
        super().__init__(413, f"the request body is larger than this server's {cap}-byte limit (max_upload_bytes "
                              "plus room for multipart framing); nothing of it was kept")


def _capped(receive, cap: int):
    """``receive`` counting ``http.request`` body bytes, raising :class:`BodyTooLarge` on the
    message that passes ``cap`` (before its bytes reach the app)."""
    seen = 0

    async def wrapped():
        nonlocal seen
        message = await receive()
        if message.get("type") == "http.request":
            seen += len(message.get("body", b""))
            if seen > cap:
                raise BodyTooLarge(cap)
        return message

    return wrapped


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

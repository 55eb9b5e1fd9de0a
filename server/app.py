"""The graphdeck web app: ``create_app(settings)`` builds it, ``serve(store)`` runs it.

Nothing is created at import time: each app opens its own engines on ``settings.store``, so a
test can point one at its own SQLite file. The store is created (empty, current schema) when it
does not exist yet, then reopened read-only for every GET.

Every error leaves the app as ``{"ok": false, "error": message, "status": code, ...details}``
with the HTTP status ``code``: :class:`~graphdeck.errors.GraphdeckError` (its ``status_code``),
request validation errors (422, with ``problems``: ``[{"loc": [...], "msg": ...}]``), unknown
routes (404) and unexpected failures (500). Never an error with status 200.

Routes (see ``/openapi.json``): ``/api/runs…`` and ``/api/graphs…`` always; trace, validation
and compile-event routes when those modules are installed; ``/`` (the dashboard), ``/static/*``
(its assets) and ``/static/vendor/plotly.min.js`` (the copy shipped in the ``plotly`` package,
so the dashboard needs no network). The server never imports torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

import graphdeck
from graphdeck.errors import GraphdeckError, NotFoundError
from graphdeck.server import auth
from graphdeck.server.render.svg import SvgCache
from graphdeck.server.routes import graphs, runs
from graphdeck.server.settings import Settings
from graphdeck.store.db import open_engine

log = logging.getLogger(__name__)

#: The API's routers by resource (each module has a ``router``), all part of the package.
ROUTERS = (
    "graphdeck.server.routes.traces",
    "graphdeck.server.routes.validation",
    "graphdeck.server.routes.compile",
    "graphdeck.server.routes.ranks",
    "graphdeck.server.routes.memory",
    "graphdeck.server.routes.imports",
    "graphdeck.server.routes.replay",
    "graphdeck.server.routes.executor",
    "graphdeck.server.routes.uploads",
    "graphdeck.server.routes.parallel_map",
    "graphdeck.server.routes.cost",
    "graphdeck.server.routes.layout",
    "graphdeck.server.routes.compile_health",
    "graphdeck.server.routes.parity",
    "graphdeck.server.routes.diff",
    "graphdeck.server.routes.export",
    "graphdeck.server.routes.summary",
    "graphdeck.server.routes.heatmap",
    "graphdeck.server.routes.live",
)


def create_app(settings: Settings) -> FastAPI:
    """Build the app serving ``settings.store``.

    Creates the store if it is missing (so a fresh server can take uploads), then keeps two
    engines on ``app.state``: ``engine`` (read/write, the one writer) and ``read_engine``
    (``PRAGMA query_only``). Uploads are capped at ``settings.max_upload_bytes`` by the routes
    that take them.

    Raises:
        StoreError: the store exists but is not a graphdeck store of this schema version.
    """
    app = FastAPI(
        title="graphdeck",
        version=graphdeck.__version__,
        description="A debugger for compiled graphs in distributed PyTorch training.",
        docs_url=None,  # served by _add_docs from local files: the dashboard works offline
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.engine = open_engine(settings.store)
    app.state.read_engine = open_engine(settings.store, read_only=True)
    app.state.svg_cache = SvgCache()
    auth.install(app, settings)  # token checks in front of every route (graphdeck.server.auth)

    _add_error_handlers(app)
    app.include_router(runs.router)
    app.include_router(graphs.router)
    for module_name in ROUTERS:
        app.include_router(importlib.import_module(module_name).router)
    frontend_dir = settings.frontend_dir or _package_dir("graphdeck.frontend")
    if frontend_dir is None:
        raise NotFoundError("the graphdeck.frontend package is not installed")
    _add_docs(app)
    _add_frontend(app, frontend_dir)
    return app


def _add_docs(app: FastAPI) -> None:
    """``/docs``: Swagger UI 5 from the ``swagger-ui-py`` package's static files (no CDN: the
    dashboard works offline). FastAPI emits OpenAPI 3.1, which Swagger UI reads from version 5 on
    (the 4.x of ``swagger-ui-bundle`` showed "Unable to render this definition"). Without the
    package, ``/docs`` says which package to install instead of loading a page that cannot render."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.responses import PlainTextResponse

    swagger_dir = swagger_ui_dir()

    if swagger_dir is not None:
        app.mount("/static/swagger", StaticFiles(directory=swagger_dir), name="swagger")

    @app.get("/docs", include_in_schema=False)
    def docs():
        if swagger_dir is None:
            return PlainTextResponse("API docs need the swagger-ui-py package (pip install swagger-ui-py); "
                                     f"the schema itself is at {app.openapi_url}", status_code=503)
        return get_swagger_ui_html(openapi_url=app.openapi_url, title="graphdeck API",
                                   swagger_js_url="/static/swagger/swagger-ui-bundle.js",
                                   swagger_css_url="/static/swagger/swagger-ui.css",
                                   swagger_favicon_url="/static/swagger/favicon-32x32.png")


def swagger_ui_dir() -> Path | None:
    """The folder of Swagger UI's built files shipped by ``swagger-ui-py`` (``swagger_ui/static``),
    or None when that package (or a Swagger UI 5 in it) is missing."""
    try:
        import swagger_ui
    except ImportError:
        return None
    folder = Path(swagger_ui.__file__).parent / "static"
    bundle = folder / "swagger-ui-bundle.js"
    return folder if bundle.exists() else None


def serve(store: str | Path, *, host: str = "127.0.0.1", port: int = 8765, log_level: str = "warning",
          announce=None, **overrides) -> None:
    """Serve ``store`` on ``host:port`` until interrupted (the CLI's ``graphdeck serve``).

    Settings come from the environment (:func:`auth.settings_from_env`), then ``overrides``
    (``Settings`` fields). ``announce()`` is called once the socket is bound, so nothing says
    "dashboard at ..." for a store that is refused or a port that is taken.
    """
    import uvicorn

    settings = Settings(store=store, **{**auth.settings_from_env(), **overrides})
    app = create_app(settings)  # a newer store is refused here, before anything is printed
    warning = auth.warn_if_exposed(host, settings)
    if warning:
        print(warning, flush=True)

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started and announce is not None:
                announce()

    _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level)).run()


def error_body(message: str, status: int, **details) -> dict:
    """The one error shape: ``{"ok": false, "error": message, "status": status, **details}``."""
    return {**jsonable_encoder(details), "ok": False, "error": message, "status": status}


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(GraphdeckError)
    async def graphdeck_error(_request: Request, exc: GraphdeckError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.status_code, **exc.details), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [{"loc": list(e.get("loc", ())), "msg": e.get("msg")} for e in exc.errors()]
        message = "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in problems) or "invalid request"
        return JSONResponse(error_body(message, 422, problems=problems), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail), exc.status_code), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def unexpected_error(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", 500), status_code=500)


def _package_dir(package: str) -> Path | None:
    """Where ``package`` is installed, found without importing it; ``None`` if it is not."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _add_frontend(app: FastAPI, frontend_dir: Path) -> None:
    plotly_dir = _package_dir("plotly")
    plotly_js = plotly_dir / "package_data" / "plotly.min.js" if plotly_dir else None

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        page = frontend_dir / "index.html"
        if not page.is_file():
            raise NotFoundError(f"dashboard not installed: {page} is missing; the JSON API is under /api")
        return FileResponse(page, media_type="text/html")

    @app.get("/static/vendor/plotly.min.js", include_in_schema=False)
    def plotly_bundle() -> FileResponse:
        if plotly_js is None or not plotly_js.is_file():
            raise NotFoundError("plotly.min.js not found: the plotly package is not installed on the server")
        return FileResponse(plotly_js, media_type="text/javascript")

    app.mount("/static", StaticFiles(directory=frontend_dir), name="static")

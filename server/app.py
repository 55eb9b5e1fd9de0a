"""The FastAPI app: JSON API, SVG graph views, Plotly timelines and the dashboard.

``create_app(settings)`` builds everything; nothing is created at import time, so a test can
point an app at its own SQLite file. The app never imports torch.

Errors: every :class:`~graphdeck.errors.GraphdeckError` (and FastAPI's validation and 404
errors) is rendered by one handler as ``{"ok": false, "error": message, "status": code, ...}``.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from graphdeck import __version__
from graphdeck.errors import GraphdeckError
from graphdeck.server.settings import Settings
from graphdeck.store.db import open_engine

#: Routers, one per resource; each module exposes ``router``.
ROUTERS = ("runs", "graphs", "traces", "validation", "compile")


def error_body(message: str, status: int, **details) -> dict:
    return {"ok": False, "error": message, "status": status, **details}


def _frontend_dir(settings: Settings) -> Path:
    if settings.frontend_dir is not None:
        return settings.frontend_dir
    import graphdeck.frontend

    return Path(graphdeck.frontend.__file__).parent


def _plotly_js() -> Path | None:
    """plotly.min.js as shipped inside the plotly Python package (no CDN at run time)."""
    try:
        import plotly
    except ImportError:
        return None
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return path if path.exists() else None


def create_app(settings: Settings) -> FastAPI:
    """Build the app over ``settings.store`` (created, empty, if missing)."""
    app = FastAPI(title="graphdeck", version=__version__,
                  description="Compiled graphs, traces and gradient paths of distributed PyTorch runs.")
    app.state.settings = settings
    app.state.engine = open_engine(settings.store)  # the one writer (uploads)
    app.state.read_engine = open_engine(settings.store, read_only=True)

    @app.exception_handler(GraphdeckError)
    async def _graphdeck_error(_request: Request, exc: GraphdeckError):
        details = {k: v for k, v in exc.details.items()}
        return JSONResponse(error_body(exc.message, exc.status_code, **details), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError):
        problems = [{"loc": list(e.get("loc", ())), "msg": e.get("msg")} for e in exc.errors()]
        message = "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in problems) or "invalid request"
        return JSONResponse(error_body(message, 422, problems=problems), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code)

    for name in ROUTERS:
        module = importlib.import_module(f"graphdeck.server.routes.{name}")
        app.include_router(module.router)

    frontend = _frontend_dir(settings)
    plotly_js = _plotly_js()

    @app.get("/static/vendor/plotly.min.js", include_in_schema=False)
    def plotly_bundle():
        if plotly_js is None:
            raise GraphdeckError("plotly is not installed on the server (pip install plotly)")
        return FileResponse(plotly_js, media_type="application/javascript")

    app.mount("/static", StaticFiles(directory=frontend), name="static")

    @app.get("/", include_in_schema=False)
    def index():
        return FileResponse(frontend / "index.html", media_type="text/html")

    return app


def serve(store: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 8765) -> None:
    """Run the app with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(create_app(Settings(store=Path(store))), host=host, port=port, log_level="warning")

"""The FastAPI app: routers, API-key check, body limits, /openapi.json, and errors in the shape
of the API that was called."""

from __future__ import annotations

import secrets

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from ... import __version__
from . import anthropic, control, openai, responses
from .core import ARRIVAL, ServerState
from .errors import ApiError, body_for, send_error
from .limits import BodyLimit
from .openapi_doc import document

# Answered without a key, for load balancers and `ft-run ctl`. /openapi.json is not among them:
# it names the served model and is read by tools, which can send the key as clients do.
OPEN_PATHS = {"/health"}
# The routes that submit a generation (`Arrivals` counts their requests; /v1/cache/rebuild, say,
# waits for the scheduler's safe point and must not hold its passes).
GENERATING = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}


def _key_of(headers: Headers) -> str | None:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return headers.get("x-api-key")


class KeyCheck:
    """ASGI middleware: a request to a path outside OPEN_PATHS without the server's key gets a
    401 in the called API's shape, before its body is read. Plain ASGI, as BodyLimit: Starlette's
    `@app.middleware("http")` runs the route in another task and passes every streamed chunk
    through a memory stream between the two."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            key = _key_of(Headers(scope=scope))
            if key is None or not secrets.compare_digest(key.encode(), self.key):
                what = "missing" if key is None else "invalid"
                await send_error(scope, send, ApiError(401, f"{what} API key (send 'Authorization: Bearer KEY' or "
                                                            f"'x-api-key: KEY')", code="invalid_api_key"))
                return
        await self.app(scope, receive, send)


class Arrivals:
    """ASGI middleware: a POST to a GENERATING route is on its way to the scheduler
    (`Scheduler.arrival`) from its first byte until its Job is submitted (`ARRIVAL`) or it ends,
    so that requests sent together are prefilled in one forward. Plain ASGI: the route runs in
    this task and sees `ARRIVAL`. A pass waits for it at most ARRIVAL_WAIT_S, so a client that
    sends its body slowly delays no one by more."""

    def __init__(self, app, scheduler):
        self.app, self.scheduler = app, scheduler

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATING:
            await self.app(scope, receive, send)
            return
        arrived = self.scheduler.arrival()
        token = ARRIVAL.set(arrived)
        try:
            await self.app(scope, receive, send)
        finally:
            ARRIVAL.reset(token)
            arrived()


def create_app(state: ServerState) -> FastAPI:
    # No /docs or /redoc: their pages load scripts from a CDN, which a loopback server should not need.
    app = FastAPI(title="ftkit", version=__version__, docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  description="OpenAI- and Anthropic-compatible API of ft-run serve")
    app.state.server = state

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = document(app, state, OPEN_PATHS)
        return app.openapi_schema

    app.openapi = openapi

    def error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(body_for(request.url.path, e), status_code=e.status)

    # Inside the key check (added first, so it runs second): a client without the key never has
    # its body read.
    app.add_middleware(BodyLimit, max_bytes=state.max_body)
    if state.api_key:
        app.add_middleware(KeyCheck, key=state.api_key)
    app.add_middleware(Arrivals, scheduler=state.scheduler)  # outermost: counted from the first byte

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return error(request, e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        """Routing's own errors (no such route, a method the route does not take) in the API's shape."""
        path = request.url.path
        message = {404: f"no route {path}: see /openapi.json for the endpoints",
                   405: f"{request.method} is not allowed on {path}"}.get(e.status_code, str(e.detail))
        return JSONResponse(body_for(path, ApiError(e.status_code, message)), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        return error(request, ApiError(500, f"internal error: {type(e).__name__}: {e}"))

    for module in (openai, responses, anthropic, control):
        app.include_router(module.router(state))
    return app

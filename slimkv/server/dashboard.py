"""The live KV cache dashboard: ``GET /dashboard`` and the JSON it polls.

The page (``slimkv/static/dashboard.{html,css,js}``, no build step, nothing fetched from
elsewhere) polls ``GET /dashboard/state`` once a second; that is ``GET /v1/cache/state``
under the dashboard's authentication. Each poll asks the backend for a snapshot: one engine
builds it on its engine thread between two steps (``AsyncEngine.cache_state``), so no
handler reads engine state that the engine is changing; a cluster asks every replica.

With ``--api-key`` set, the API (``/v1/cache/state`` included) wants ``Authorization:
Bearer <key>``. A browser cannot send that on navigation, so the dashboard routes also take
HTTP Basic with the key as the password (any user name) and answer 401 with a Basic
challenge: the browser asks once and resends the credentials with every poll. The CSS and
JS are the project's source and carry no data, so they are served without a key.
"""

from __future__ import annotations

import base64
import binascii
import secrets
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.responses import HTMLResponse

from slimkv.server.backend import Backend
from slimkv.server.errors import APIError

ASSETS = {"dashboard.css": "text/css; charset=utf-8",
          "dashboard.js": "text/javascript; charset=utf-8"}
REALM = 'Basic realm="slimkv dashboard", charset="UTF-8"'


def presented_key(request: Request) -> str | None:
    """The key from ``Authorization: Bearer <key>`` or ``Basic base64(<user>:<key>)``."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return token.strip()
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2]
    return None


def dashboard_auth(api_key: str | None):
    """A dependency for the dashboard routes: Bearer or Basic, with a Basic challenge."""
    async def check(request: Request) -> None:
        if api_key is None:
            return
        key = presented_key(request)
        if key is None or not secrets.compare_digest(key, api_key):
            raise APIError(401, "missing or invalid API key (send Authorization: Bearer <key>, "
                           "or log in with the key as the password)", "invalid_api_key",
                           headers={"WWW-Authenticate": REALM})
    return check


def static_text(name: str) -> str:
    return resources.files("slimkv").joinpath("static", name).read_text(encoding="utf-8")


def install_dashboard(app: FastAPI, v1: APIRouter, backend: Backend,
                      api_key: str | None) -> None:
    """Register the routes; ``v1`` is the API router (with its Bearer check), which the
    caller includes in the app after this."""
    async def state(blocks: bool = True) -> dict[str, Any]:
        return await backend.cache_state(blocks)

    v1.get("/cache/state", summary="KV cache state (schema: docs/serving.md)")(state)
    page = APIRouter(prefix="/dashboard")
    protected = [Depends(dashboard_auth(api_key))]
    page.get("/state", dependencies=protected, include_in_schema=False)(state)

    @page.get("", dependencies=protected, response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(static_text("dashboard.html"),
                            headers={"Cache-Control": "no-store"})

    @page.get("/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            raise APIError(404, f"no dashboard file {name!r}", "not_found")
        return Response(static_text(name), media_type=ASSETS[name])

    app.include_router(page)

"""The FastAPI app of `swiftlm web`: the page, its JSON API, and the live dashboard of each run.

Routes (all but /login need the key when --api_key is set: `Authorization: Bearer <key>` or
the cookie that the login form sets; a missing or wrong key is 401):
- `GET /`: the UI (static/index.html); `GET /login`, `POST /login`: the key form;
- `GET /api/form/{command}`: the form, from the flags' own documentation;
- `POST /api/command`, `POST /api/preview`: the command line and the data preview of a form;
- `GET|POST /api/runs`, `GET /api/runs/{name}`, `POST /api/runs/{name}/stop|resume`;
- `GET /runs/{name}/dashboard/` and `.../data`: the observability dashboard of a run;
- `GET /api/models`, `GET|POST /api/chat`, `POST /api/chat/unload`, `POST /api/chat/completions`
  (streamed);
- `GET /api/jobs/{kind}`, `POST /api/jobs/{kind}`: export and evaluation.
Bad input (a flag value, a missing dataset, a bad run name) is swiftlm's own message with
status 400, never a 500.
"""

import hmac
from importlib.resources import files
from pathlib import Path
from urllib.parse import parse_qs

from swiftlm.errors import SwiftLMError
from swiftlm.web.api import build_api
from swiftlm.web.runs import Registry

COOKIE = "swiftlm_web_key"
PUBLIC = frozenset({"/login"})


def static_text(name: str) -> str:
    return (files("swiftlm.web") / "static" / name).read_text(encoding="utf-8")


def key_given(request) -> str | None:
    """The key of a request: its Bearer header, else the login cookie."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.cookies.get(COOKIE)


def create_app(runs_dir: Path, api_key: str | None = None):
    """The UI over the runs of `runs_dir`; with `api_key`, every route but /login needs it."""
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse

    app = FastAPI(title="swiftlm web", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.registry = Registry(runs_dir)

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        if api_key is None or request.url.path in PUBLIC:
            return await call_next(request)
        given = key_given(request)
        if given is not None and hmac.compare_digest(given.encode(), api_key.encode()):
            return await call_next(request)
        if request.url.path.startswith("/api/") or request.method != "GET":
            return JSONResponse({"error": "a valid API key is required"}, status_code=401)
        return HTMLResponse(login_page("Enter the key of this swiftlm web."), status_code=401)

    @app.exception_handler(SwiftLMError)
    async def bad_input(request: Request, exc: SwiftLMError):
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.get("/login", response_class=HTMLResponse)
    def login_form():
        return login_page("Enter the key of this swiftlm web.")

    @app.post("/login")
    async def login(request: Request):
        # A form post, read by hand: FastAPI's Form needs python-multipart, another dependency.
        fields = parse_qs((await request.body()).decode("utf-8", errors="replace"))
        key = fields.get("key", [""])[0]
        if api_key is not None and not hmac.compare_digest(key.encode(), api_key.encode()):
            return HTMLResponse(login_page("Wrong key; try again."), status_code=401)
        reply = RedirectResponse("/", status_code=303)
        reply.set_cookie(COOKIE, key, httponly=True, samesite="strict")
        return reply

    @app.get("/", response_class=HTMLResponse)
    def index():
        return static_text("index.html")

    @app.get("/static/{name}")
    def static(name: str):
        kinds = {"app.js": "text/javascript", "style.css": "text/css"}
        if name not in kinds:
            return PlainTextResponse("not found", status_code=404)
        return PlainTextResponse(static_text(name), media_type=kinds[name])

    app.include_router(build_api(app.state.registry))
    return app


def login_page(message: str) -> str:
    return static_text("login.html").replace("{{MESSAGE}}", message)

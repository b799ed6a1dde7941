"""GET /: the chat page (static/chat.html), public (serve.auth.PUBLIC_PATHS): it holds no
secret, and asks for the API key to send with its calls."""

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

CHAT_PAGE = resources.files("swiftlm.serve").joinpath("static/chat.html").read_text("utf-8")


def page_router() -> APIRouter:
    router = APIRouter()

    @router.get("/")
    async def chat_page():
        return HTMLResponse(CHAT_PAGE)

    return router

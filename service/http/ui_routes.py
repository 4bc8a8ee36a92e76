"""The web page's routes: ``GET /ui`` (and ``GET /`` from a browser) serve the page; ``POST /ui/picture`` draws a plan.

``POST /`` stays TGI's generate route (:mod:`service.http.tgi_routes`); ``GET /`` without ``text/html`` in ``Accept``
answers 405 as it did before the page existed. The page itself is open (it holds no data and must load to ask
for the key); everything it fetches goes through the API-key check.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.errors import RequestValidationError
from service.schemas.openapi_responses import BODY_ERRORS, errors, json_content, plain_content
from service.ui.page import page_html
from service.ui.plan_picture import render_svg_dict

router = APIRouter(tags=["page"])


def _page(request: Request) -> HTMLResponse:
    settings = request.app.state.settings
    return HTMLResponse(page_html(needs_key=bool(settings.api_key)), headers={"Cache-Control": "no-cache"})


@router.get(
    "/ui",
    summary="The web page: plan in force, live figures, what-if planning, playground",
    response_class=HTMLResponse,
    responses={**plain_content("text/html", "The page."), **errors(*BODY_ERRORS)},
)
async def ui(request: Request) -> HTMLResponse:
    return _page(request)


@router.get("/", include_in_schema=False)
async def root(request: Request) -> Response:
    if "text/html" in request.headers.get("accept", ""):
        return _page(request)
    raise StarletteHTTPException(405, "Method Not Allowed", headers={"Allow": "POST"})


@router.post(
    "/ui/picture",
    summary="The SVG picture of a plan (the body is a Plan as /plan or /info answers it)",
    response_class=Response,
    responses={**plain_content("image/svg+xml", "The picture."), **errors(401, *BODY_ERRORS)},
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "A Plan, as POST /plan answers it (or 'plan' in GET /info).",
            "content": json_content({"type": "object"}),
        }
    },
)
async def picture(request: Request) -> Response:
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise RequestValidationError(f"The body is not JSON ({exc}); send a Plan as /plan answers it.") from None
    if not isinstance(body, dict):
        raise RequestValidationError("The body must be a JSON object: a Plan as /plan or /info ('plan') answers it.")
    try:
        svg = render_svg_dict(body)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RequestValidationError(
            f"The body is not a Plan ({type(exc).__name__}: {exc}); send the JSON /plan answers, unchanged."
        ) from None
    return Response(svg, media_type="image/svg+xml")

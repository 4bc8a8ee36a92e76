"""The web page as one self-contained HTML document: ``ui/page.html`` with its CSS and JS inlined.

One document, no other requests for assets, nothing from a CDN: it works on a machine with no network, and the
same document saved by ``loadmaster plan --html`` works from a file with the plan embedded. Standard library
only (the CLI imports this without torch or FastAPI).
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from service.ui.plan_picture import render_svg_dict


def _asset(name: str) -> str:
    return resources.files("service.ui").joinpath(name).read_text(encoding="utf-8")


def _script_json(value: Any) -> str:
    """JSON safe inside ``<script type="application/json">`` (no ``</script>`` or ``<!--`` can end it early)."""
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def page_html(*, needs_key: bool = False, plan: dict[str, Any] | None = None) -> str:
    """The page. With ``plan`` it is an offline copy: that plan and its picture embedded, no server calls.

    ``needs_key`` tells the page to ask for the API key before its first call, so no request is refused first.
    """
    boot: dict[str, Any] = {"needs_key": needs_key, "offline": plan is not None}
    if plan is not None:
        boot["plan"] = plan
        boot["svg"] = render_svg_dict(plan)
    html = _asset("page.html")
    html = html.replace("/*PAGE_CSS*/", _asset("page.css"))
    html = html.replace("/*PAGE_JS*/", _asset("page.js"))
    return html.replace("/*PAGE_BOOT*/", _script_json(boot))

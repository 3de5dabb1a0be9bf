"""The views of the trace data (engine/trace.py): the self-contained `pagedserve trace` report and the live
dashboard page. Both inline the same CSS and JS from static/ and render with `PagedTrace.render(data)`.
"""

from __future__ import annotations

import json
import os
from importlib import resources


def static_text(name: str) -> str:
    return resources.files("pagedserve.entrypoints.dashboard").joinpath("static", name).read_text(encoding="utf-8")


def _inline_json(data: dict) -> str:
    # Inside <script type="application/json">: only "</" (and U+2028/9 for old parsers) need escaping.
    text = json.dumps(data, separators=(",", ":"))
    return text.replace("</", "<\\/").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def render_html(data: dict, title: str = "pagedserve trace") -> str:
    """One self-contained page: CSS, JS and data inline; no network access needed."""
    page = static_text("trace.html")
    # The title goes in first: the data and scripts inserted later must not be searched for placeholders.
    page = page.replace("__TITLE__", title.replace("&", "&amp;").replace("<", "&lt;"))
    parts = {
        "/*__TRACE_CSS__*/": static_text("trace.css"),
        "/*__TRACE_JS__*/": static_text("trace.js"),
        "__TRACE_DATA__": _inline_json(data),
    }
    for key, value in parts.items():
        page = page.replace(key, value, 1)
    return page


def dashboard_html() -> str:
    """The live dashboard page (polls ./dashboard/state for engine_trace_data JSON), assets inline."""
    page = static_text("dashboard.html")
    return page.replace("/*__TRACE_CSS__*/", static_text("trace.css"), 1).replace(
        "/*__TRACE_JS__*/", static_text("trace.js"), 1)


def write_report(
    data: dict, html_path: str, json_path: str | None = None, title: str = "pagedserve trace"
) -> str:
    json_path = json_path or os.path.splitext(html_path)[0] + ".json"
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(render_html(data, title))
    return json_path

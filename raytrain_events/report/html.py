"""Static, self-contained HTML for the run report: inline CSS, no scripts, PNGs next to it."""

from __future__ import annotations

import html
import json
from typing import Any, List, Sequence

__all__ = ["page", "table", "image", "pre", "escape"]

escape = html.escape

_STYLE = """
body { font-family: -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1040px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.9em; } td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
th { background: #f4f4f4; } tr.best td { font-weight: bold; background: #fff8dc; }
img { max-width: 100%; border: 1px solid #eee; } pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
.muted { color: #777; font-size: 0.85em; }
"""


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return html.escape(json.dumps(value, default=str))
    return html.escape("" if value is None else str(value))


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], highlight: Sequence[bool] = ()) -> str:
    """An HTML table; rows with a true ``highlight`` are bold."""
    marks = list(highlight) + [False] * (len(rows) - len(highlight))
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        ('<tr class="best">' if mark else "<tr>") + "".join(f"<td>{_cell(c)}</td>" for c in row) + "</tr>"
        for row, mark in zip(rows, marks)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def image(src: str, alt: str) -> str:
    return f'<p><img src="{html.escape(src)}" alt="{html.escape(alt)}"></p>'


def pre(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


def page(title: str, sections: List[str], note: str = "") -> str:
    """The whole document."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        + (f'<p class="muted">{html.escape(note)}</p>' if note else "")
        + "\n".join(sections)
        + "</body></html>\n"
    )

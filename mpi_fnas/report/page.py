"""A small document model (headings, paragraphs, lists, tables, figures) rendered twice: as Markdown that links
its figures, and as one self-contained HTML page with the figures inline (base64 PNG data URIs), readable offline:
no script, no stylesheet or font from elsewhere, no external link.

Text may hold ``code`` spans (backticks); everything else is plain text, escaped for the format.
"""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

FIGURES_DIR = "figures"
_CODE = re.compile(r"`([^`]+)`")


@dataclass(frozen=True)
class Heading:
    """A heading of the page (level 2 by default)."""
    text: str
    level: int = 2


@dataclass(frozen=True)
class Paragraph:
    """A paragraph of Markdown text."""
    text: str


@dataclass(frozen=True)
class Bullets:
    """A bulleted list."""
    items: tuple[str, ...]


@dataclass(frozen=True)
class Table:
    """A table: its header and rows of cell texts."""
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Image:
    """A figure: ``figures/<name>`` next to report.md, inline in report.html."""

    name: str
    caption: str


Block = Heading | Paragraph | Bullets | Table | Image


def render_markdown(blocks: Sequence[Block]) -> str:
    """The blocks as GitHub-flavoured Markdown; figures as ``![caption](figures/<name>)``."""
    out: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            out.append(f"{'#' * block.level} {block.text}")
        elif isinstance(block, Paragraph):
            out.append(block.text)
        elif isinstance(block, Bullets):
            out.append("\n".join(f"- {item}" for item in block.items))
        elif isinstance(block, Table):
            lines = [_md_row(block.header), "|" + "|".join("---" for _ in block.header) + "|"]
            lines += [_md_row(row) for row in block.rows]
            out.append("\n".join(lines))
        elif isinstance(block, Image):
            out.append(f"![{block.caption}]({FIGURES_DIR}/{block.name})")
    return "\n\n".join(out) + "\n"


def render_html(blocks: Sequence[Block], images: Mapping[str, bytes], title: str) -> str:
    """The blocks as one HTML5 page; every Image is embedded from `images` (name → PNG bytes)."""
    body: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            level = min(max(block.level, 1), 6)
            body.append(f"<h{level}>{_inline(block.text)}</h{level}>")
        elif isinstance(block, Paragraph):
            body.append(f"<p>{_inline(block.text)}</p>")
        elif isinstance(block, Bullets):
            body.append("<ul>" + "".join(f"<li>{_inline(item)}</li>" for item in block.items) + "</ul>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{_inline(cell)}</th>" for cell in block.header)
            rows = "".join("<tr>" + "".join(f"<td>{_inline(cell)}</td>" for cell in row) + "</tr>"
                           for row in block.rows)
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif isinstance(block, Image):
            data = base64.b64encode(images[block.name]).decode("ascii")
            body.append(f'<figure><img alt="{html.escape(block.caption)}" src="data:image/png;base64,{data}">'
                        f"<figcaption>{_inline(block.caption)}</figcaption></figure>")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{html.escape(title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
        + "\n".join(body) + "\n</body>\n</html>\n"
    )


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _inline(text: str) -> str:
    """Escape for HTML, then turn `code` spans into <code> (backticks survive escaping unchanged)."""
    return _CODE.sub(lambda m: f"<code>{m.group(1)}</code>", html.escape(text))


_STYLE = (
    "body{font-family:sans-serif;max-width:70em;margin:1em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:0.5em 0;font-size:0.9em}"
    "th,td{border:1px solid #bbb;padding:0.2em 0.5em;text-align:left}th{background:#eee}"
    "code{background:#f3f3f3;padding:0 0.2em;word-break:break-all}"
    "figure{margin:1em 0}img{max-width:100%;height:auto;border:1px solid #ddd}"
    "figcaption{font-size:0.85em;color:#555}"
)

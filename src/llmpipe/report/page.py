"""The report card as one self-contained HTML page: the markdown rendered by Python-Markdown (tables, fenced code),
every image embedded as a base64 data URI, a declared charset and no script or network address."""

from __future__ import annotations

import base64
import re
from pathlib import Path

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; display: block; overflow-x: auto; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
img { max-width: 100%; border: 1px solid #eee; }
code, pre { font-family: ui-monospace, monospace; font-size: 0.9em; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; }
"""

_IMG = re.compile(r'<img([^>]*?) src="([^"]+)"')
_MD_IMG = re.compile(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)")


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def markdown_with_images(report: Path) -> str:
    """The markdown of `report` with its relative PNG links made data URIs: one self-contained text for a viewer
    that cannot follow links, such as a Prefect artifact.

    Raises:
        FileNotFoundError: `report`, or an image it links to, does not exist.
    """
    text = report.read_text()
    return _MD_IMG.sub(lambda m: f"![{m.group(1)}]({_data_uri(report.parent / m.group(2))})", text)


def embed_images(body: str, base: Path) -> str:
    """`body` with every ``<img src="relative.png">`` replaced by a ``data:image/png;base64`` URI of the file under
    `base`.

    Raises:
        FileNotFoundError: An image the page links to does not exist (the page would show it as missing).
    """

    def inline(match: re.Match[str]) -> str:
        return f'<img{match.group(1)} src="{_data_uri(base / match.group(2))}"'

    return _IMG.sub(inline, body)


def render(markdown_text: str, base: Path, title: str) -> str:
    """The HTML page of `markdown_text`, images (paths relative to `base`) embedded."""
    import markdown

    body = markdown.markdown(markdown_text, extensions=["tables", "fenced_code"], output_format="html")
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{title}</title>\n'
            f"<style>{STYLE}</style>\n</head>\n<body>\n{embed_images(body, base)}\n</body>\n</html>\n")

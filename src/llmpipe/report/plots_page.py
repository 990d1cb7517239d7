"""The page template of `dvc plots show` / `dvc plots diff` that works offline: DVC's own page loads vega, vega-lite
and vega-embed from a CDN (blank with no network) and declares no charset (a minus sign shows as mojibake).

The template inlines the three libraries, bundled by ``vl-convert-python`` (a PyPI package that ships them; about
0.9 MB of JavaScript, so the template is generated at install time, `make install`, into a git-ignored file rather
than committed). ``.dvc/config`` points DVC at it (``plots.html_template``). It has no ``{scripts}`` placeholder, so
DVC adds no CDN script tags.

Usage: python -m llmpipe.report.plots_page [PATH]   (default .dvc/plots_page.html)
"""

from __future__ import annotations

import sys
from pathlib import Path

from llmpipe.core.io import atomic_file

TEMPLATE_NAME = "plots_page.html"
"""The template's file name in ``.dvc/`` (``plots.html_template`` is resolved against that folder)."""

VEGA_LITE_VERSION = "5.20"
"""The vega-lite bundled: DVC's templates are vega-lite v5 specs."""

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
{refresh_tag}
<title>DVC plots</title>
<style>body {{ font-family: system-ui, sans-serif; }} table {{ border-spacing: 15px; }}</style>
<script>
{bundle}
</script>
</head>
<body>
{plot_divs}
</body>
</html>
"""
"""DVC fills ``{refresh_tag}`` and ``{plot_divs}``; ``{bundle}`` is filled here."""


def page() -> str:
    """The template's text: vega, vega-lite and vega-embed inlined (they set ``window.vegaEmbed``, which DVC's plot
    divs call)."""
    import vl_convert

    bundle = vl_convert.javascript_bundle(vl_version=VEGA_LITE_VERSION).replace("</script", "<\\/script")
    for placeholder in ("{plot_divs}", "{refresh_tag}", "{scripts}"):
        # DVC replaces these strings anywhere in the page: the bundle must not contain them
        assert placeholder not in bundle, f"{placeholder} in the vega bundle"
    return PAGE.format(refresh_tag="{refresh_tag}", plot_divs="{plot_divs}", bundle=bundle)


def write(path: Path) -> Path:
    """Write the template to `path` (atomically) and return it."""
    with atomic_file(path) as fh:
        fh.write(page())
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m llmpipe.report.plots_page [PATH]``: write the template (default ``.dvc/<TEMPLATE_NAME>``)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m llmpipe.report.plots_page", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", type=Path, default=Path(".dvc", TEMPLATE_NAME), help="where to write it")
    path = write(parser.parse_args(sys.argv[1:] if argv is None else argv).path)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB): the offline page of `dvc plots show`")
    return 0


if __name__ == "__main__":
    sys.exit(main())

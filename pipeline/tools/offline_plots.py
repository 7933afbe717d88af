"""The page `dvc plots show` fills in (`.dvc/config` names it, `make setup` writes it).

DVC's own page loads Vega, Vega-Lite and Vega-Embed from a CDN, so on a machine without network, or when the
HTML is opened years later, every plot is blank. This page carries the three libraries inline, bundled by
vl-convert (a PyPI package), and leaves out DVC's `{scripts}` slot, which holds the CDN tags.

    python -m kiln.pipeline.tools.offline_plots .dvc/plots/offline.html
"""

from __future__ import annotations

import sys
from pathlib import Path

from kiln.pipeline.outputs import atomic_write_bytes

# The Vega-Lite line DVC's templates are written for ("$schema": ".../vega-lite/v5.json").
VEGA_LITE = "5.21"

PAGE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>kiln: DVC plots</title>
    <script type="text/javascript">
__BUNDLE__
    </script>
    <style>
        body { font-family: sans-serif; }
        table { border-spacing: 15px; }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def page() -> str:
    import vl_convert

    bundle = vl_convert.javascript_bundle(vl_version=VEGA_LITE)
    # DVC fills the page with str.replace on these slots, so the bundle must not contain one.
    for slot in ("{plot_divs}", "{refresh_tag}", "{scripts}", "</script"):
        if slot in bundle:
            raise ValueError(f"the Vega bundle contains {slot!r}; it cannot be inlined into the page")
    return PAGE.replace("__BUNDLE__", bundle)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kiln.pipeline.tools.offline_plots OUT.html", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, page().encode())
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): `dvc plots show` works offline")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

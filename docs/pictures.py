"""Regenerate the documentation's pictures and the demo's evaluation record from one demo bundle.

    make demo && .venv/bin/python docs/pictures.py --store .demo/store [--ui] && make docs

From ``<store>/bundle@production``:

- writes ``docs/results/eval_demo.json`` (``benchmarks/eval_demo.py``'s record of that bundle; its ``bundle`` key is
  the bundle version),
- draws ``docs/images/explain_attribution.png`` (``lexiflow explain``'s attribution picture of :data:`TEXT`), its
  PNG text chunks holding ``lexiflow:bundle_version`` and ``lexiflow:explain`` (the text, label, probability and
  threshold it was drawn for, as JSON), no timestamp and no ``Software`` key, so the same bundle gives the same bytes
  (a CJK font is required: installed, or a file given with ``--font``),
- rewrites the caption blocks ``<!-- pictures:explain -->`` ... ``<!-- /pictures:explain -->`` of the README and
  ``docs/api.md`` with that text, label and probability,
- with ``--ui`` only: the Prefect UI screenshots in ``docs/ui/`` (``docs/ui/shoot.py --full``: a Prefect server,
  a full demo run into a temporary store and headless Chromium; minutes, and never part of ``make test``), each
  stamped with the bundle version its run built, which must equal the demo's.

``tests/test_pictures.py`` checks, without running anything, that every stamped picture under ``docs/`` names the
bundle of ``docs/results/eval_demo.json`` and that the captions say what the picture shows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import models.numerics  # noqa: E402,F401,I001  (pins the CPU kernels before NumPy loads, as the CLI)

# the review the explain picture is drawn for (docs/api.md's `lexiflow explain` example)
TEXT = "酒店有些老，设施一般，早餐一般。位置位于火车站附近，但是周边环境有些乱。"
VERSION_KEY = "lexiflow:bundle_version"
EXPLAIN_KEY = "lexiflow:explain"
# pictures drawn from the demo bundle (repository-relative) -> what draws them
DRAWN = {"docs/images/explain_attribution.png": "explain"}
# pages carrying the explain picture's caption block
CAPTION_PAGES = ("README.md", "docs/api.md")
RESULTS = "docs/results/eval_demo.json"
_CAPTION = re.compile(r"(<!-- pictures:explain -->\n)(?P<body>.*?)(<!-- /pictures:explain -->)", re.S)


def explain_caption(meta: dict, version: str) -> str:
    """The caption under the explain picture: the text, the label and probability it was drawn for, the bundle."""
    rule = "arg-max" if meta["threshold"] is None else f"threshold {meta['threshold']:.3f}"
    return (f"*The review 「{meta['text']}」 explained by the demo bundle `{version}`: label {meta['label']}, "
            f"p = {meta['prob']:.3f} ({rule}); drawn by `docs/pictures.py`.*\n")


def set_captions(text: str, caption: str) -> str:
    """``text`` with the body of its ``pictures:explain`` block replaced by ``caption``; ValueError without one."""
    if not _CAPTION.search(text):
        raise ValueError("no <!-- pictures:explain --> ... <!-- /pictures:explain --> block")
    return _CAPTION.sub(lambda m: m.group(1) + caption + m.group(3), text)


def caption_of(text: str) -> str:
    """The body of the page's ``pictures:explain`` block."""
    m = _CAPTION.search(text)
    if m is None:
        raise ValueError("no <!-- pictures:explain --> ... <!-- /pictures:explain --> block")
    return m.group("body")


def draw_explain(model, text: str = TEXT) -> tuple[bytes, dict]:
    """The attribution picture of ``text`` (PNG bytes, stamped) and what it was drawn for."""
    from tasks.common.plots import stamp_png

    ex = model.explain(text)
    meta = {"text": ex.text, "label": ex.label, "prob": round(float(ex.prob), 6),
            "prob_forward": round(float(ex.prob_forward), 6),
            "threshold": None if ex.threshold is None else round(float(ex.threshold), 6)}
    png = stamp_png(ex.pngs()["attribution.png"],
                    {VERSION_KEY: model.version, EXPLAIN_KEY: json.dumps(meta, ensure_ascii=True, sort_keys=True)})
    return png, meta


def use_cjk_font(paths: list[str]) -> str:
    """Make the font files in ``paths`` known to matplotlib and return the CJK family the pictures will use;
    SystemExit when there is none (the docs would show boxes instead of characters)."""
    from matplotlib import font_manager

    from tasks.inference.explain import cjk_font

    for path in paths:
        font_manager.fontManager.addfont(path)
    family = cjk_font()
    if family is None:
        raise SystemExit("error: no CJK font: `apt-get install fonts-noto-cjk`, or pass --font <file.ttc>")
    return family


def shoot_ui(inputs: str, version: str) -> None:
    """Run ``docs/ui/shoot.py --full`` (it stamps its screenshots) and check it built the demo's bundle."""
    out = subprocess.run([sys.executable, str(REPO / "docs" / "ui" / "shoot.py"), "--inputs", inputs, "--full"],
                         cwd=REPO, check=True, stdout=subprocess.PIPE, text=True).stdout
    print(out, end="")
    shot = json.loads(out.strip().splitlines()[-1])
    if shot["bundle"] != version:
        raise SystemExit(f"error: the screenshots' run built bundle {shot['bundle']}, the demo store holds {version}: "
                         "the pipeline is not reproducible here; docs/ui/ now shows another bundle")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=".demo/store", help="the demo store (make demo)")
    ap.add_argument("--inputs", help="the sample inputs for --ui (default: the store's sibling inputs/)")
    ap.add_argument("--ui", action="store_true", help="also the Prefect UI screenshots (Chromium, minutes)")
    ap.add_argument("--font", action="append", default=[],
                    help="a CJK font file to draw with when none is installed (e.g. NotoSansCJK-Regular.ttc)")
    args = ap.parse_args()
    use_cjk_font(args.font)

    from benchmarks._numerics_ab import write_results
    from benchmarks.eval_demo import record
    from lexiflow.scoring import load_bundle

    model = load_bundle(f"{args.store}/bundle@production")
    rec = record(args.store, model.version)
    # the record names the command; a --font file is where this machine keeps it, not part of the command
    sys.argv = [a for i, a in enumerate(sys.argv) if a != "--font" and (i == 0 or sys.argv[i - 1] != "--font")]
    write_results(str(REPO / RESULTS), "eval_demo", rec)
    print(f"{RESULTS}  {rec['last_line']}")

    png, meta = draw_explain(model)
    (REPO / "docs" / "images").mkdir(exist_ok=True)
    (REPO / "docs" / "images" / "explain_attribution.png").write_bytes(png)
    caption = explain_caption(meta, model.version)
    for page in CAPTION_PAGES:
        path = REPO / page
        path.write_text(set_captions(path.read_text(encoding="utf-8"), caption), encoding="utf-8")
    print(f"docs/images/explain_attribution.png  label {meta['label']} p={meta['prob']:.3f}")

    if args.ui:
        inputs = args.inputs or os.path.join(os.path.dirname(os.path.normpath(args.store)), "inputs")
        shoot_ui(inputs, model.version)
    print(f"pictures of bundle {model.version}")


if __name__ == "__main__":
    main()

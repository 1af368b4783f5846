"""The documentation's pictures name the bundle they were drawn from, and it is the one docs/results/eval_demo.json
records (both written by docs/pictures.py); the captions say what the explain picture shows. Nothing is run."""

from __future__ import annotations

import importlib.util
import json
import struct
import zlib
from pathlib import Path

import pytest

from tasks.common.plots import png_text, stamp_png

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("docs_pictures", REPO / "docs" / "pictures.py")
pictures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pictures)

# Prefect UI screenshots taken before screenshots were stamped; `docs/pictures.py --ui` stamps them when it retakes
# them (needs Chromium and a Prefect server), after which they are checked like the rest. No new entries.
UNSTAMPED_UI = {"docs/ui/finetune-curves.png", "docs/ui/finetune-explain.png", "docs/ui/finetune-report.png",
                "docs/ui/pipeline-run-graph.png", "docs/ui/pretrain-curves.png"}


def _doc_pngs() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.png"))


def _demo_bundle() -> str:
    return json.loads((REPO / pictures.RESULTS).read_text(encoding="utf-8"))["bundle"]


@pytest.mark.parametrize("rel", _doc_pngs())
def test_every_docs_png_names_the_evaluated_bundle(rel):
    meta = png_text((REPO / rel).read_bytes())
    if rel in UNSTAMPED_UI and pictures.VERSION_KEY not in meta:
        pytest.skip(f"{rel}: shot before stamping; retaken by docs/pictures.py --ui")
    assert pictures.VERSION_KEY in meta, f"{rel} carries no {pictures.VERSION_KEY}: draw it with docs/pictures.py"
    assert meta[pictures.VERSION_KEY] == _demo_bundle(), (
        f"{rel} shows bundle {meta[pictures.VERSION_KEY]}, {pictures.RESULTS} evaluates {_demo_bundle()}: "
        "run docs/pictures.py on the demo store")
    assert "Software" not in meta and "Creation Time" not in meta  # stamped pictures depend on their pixels alone


def test_drawn_pictures_exist_and_record_what_they_show():
    for rel in pictures.DRAWN:
        meta = png_text((REPO / rel).read_bytes())
        assert meta.get(pictures.VERSION_KEY) == _demo_bundle()
    explain = json.loads(png_text((REPO / "docs/images/explain_attribution.png").read_bytes())[pictures.EXPLAIN_KEY])
    assert explain["text"] == pictures.TEXT
    assert explain["label"] in (0, 1) and 0.0 <= explain["prob"] <= 1.0
    # the label follows from the probability and the threshold, as the labeller decides it
    assert explain["label"] == int(explain["prob"] >= explain["threshold"])


@pytest.mark.parametrize("page", pictures.CAPTION_PAGES)
def test_captions_say_what_the_explain_picture_shows(page):
    explain = json.loads(png_text((REPO / "docs/images/explain_attribution.png").read_bytes())[pictures.EXPLAIN_KEY])
    caption = pictures.caption_of((REPO / page).read_text(encoding="utf-8"))
    assert caption == pictures.explain_caption(explain, _demo_bundle())
    assert explain["text"] in caption and f"label {explain['label']}," in caption
    assert f"p = {explain['prob']:.3f}" in caption


def _tiny_png(text_chunks: dict[str, str]) -> bytes:
    """A 1x1 grey PNG with the given tEXt chunks and a tIME chunk, built by hand."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    texts = [chunk(b"tEXt", k.encode() + b"\0" + v.encode()) for k, v in text_chunks.items()]
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"tIME", bytes(7)) + b"".join(texts)
            + chunk(b"IDAT", zlib.compress(b"\x00\x80")) + chunk(b"IEND", b""))


def test_stamp_replaces_text_and_time_and_keeps_the_pixels():
    a = _tiny_png({"Software": "Matplotlib version3.11.2", "Creation Time": "today"})
    b = _tiny_png({"Software": "Chromium"})
    sa, sb = stamp_png(a, {"z": "2", "lexiflow:bundle_version": "abc"}), stamp_png(b, {"lexiflow:bundle_version": "abc",
                                                                                          "z": "2"})
    assert sa == sb  # same pixels, same stamp: same bytes, whatever tool wrote the file
    assert png_text(sa) == {"lexiflow:bundle_version": "abc", "z": "2"}
    assert stamp_png(sa, {"lexiflow:bundle_version": "abc", "z": "2"}) == sa
    assert stamp_png(a, {"lexiflow:bundle_version": "abd"}) != sa
    assert b"tIME" not in sa and b"IDAT" in sa and sa.endswith(b"IEND\xaeB`\x82")


def test_png_text_rejects_what_is_no_png():
    with pytest.raises(ValueError, match="signature"):
        png_text(b"GIF89a")
    with pytest.raises(ValueError, match="truncated"):
        png_text(_tiny_png({})[:-6])


def test_caption_block_is_required():
    with pytest.raises(ValueError, match="pictures:explain"):
        pictures.set_captions("no block here", "x\n")
    page = "a\n<!-- pictures:explain -->\nold\n<!-- /pictures:explain -->\nb\n"
    assert pictures.set_captions(page, "new\n") == "a\n<!-- pictures:explain -->\nnew\n<!-- /pictures:explain -->\nb\n"

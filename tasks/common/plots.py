"""PNG plots for stage artifacts (matplotlib, Agg backend; no timestamps in the file)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np


def _pyplot():
    """matplotlib's pyplot on the Agg backend, imported on first use (about 0.9 s: only stages that draw pay it)."""
    import matplotlib  # noqa: PLC0415 - see the docstring

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - after the backend is chosen

    return plt


def subplots(ncols: int, figsize: tuple[float, float] = (10, 3.6)):
    """A figure of ``ncols`` side-by-side axes at 100 dpi (Agg backend)."""
    return _pyplot().subplots(1, ncols, figsize=figsize, dpi=100)


def to_png(fig, title: str) -> bytes:
    """Title, tight layout, PNG bytes with no 'Software' stamp, figure closed."""
    plt = _pyplot()
    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def line_panels(x, panels, xlabel: str, title: str, vline: tuple[float, str] | None = None) -> bytes:
    """PNG: side-by-side panels of lines against ``x``.

    ``panels``: ``[(y label, [(ys, legend, plot kwargs), ...]), ...]``; ``vline = (x, legend)``
    marks one x (dashed grey) on every panel. Each panel gets axis labels, a light grid and a legend."""
    fig, axes = subplots(len(panels))
    axes = axes if len(panels) > 1 else [axes]
    for ax, (ylabel, lines) in zip(axes, panels):
        for ys, legend, style in lines:
            ax.plot(x, ys, label=legend, **style)
        if vline is not None:
            ax.axvline(vline[0], color="grey", ls="--", lw=1, label=vline[1])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    return to_png(fig, title)


def drawable(text: str) -> bool:
    """Whether matplotlib's bundled DejaVu Sans has a glyph for every character of ``text`` (CJK: no)."""
    _pyplot()
    from matplotlib import font_manager  # noqa: PLC0415 - matplotlib loads on first use (_pyplot)
    from matplotlib.ft2font import FT2Font  # noqa: PLC0415 - as above

    font = FT2Font(font_manager.findfont(font_manager.FontProperties(family="DejaVu Sans"), fallback_to_default=True))
    return all(font.get_char_index(ord(c)) for c in text)


def confusion_png(matrix, classes: list[str], title: str) -> bytes:
    """PNG: a confusion matrix (rows: true class, columns: predicted), each cell's count written in it. Drawn with
    matplotlib's bundled font only, so the bytes do not depend on the fonts a machine has: class names it cannot
    draw (CJK) are shown by their index, in the order of ``model_config.json``'s ``classes``."""
    m = np.asarray(matrix, np.int64)
    k = len(classes)
    names = all(drawable(c) for c in classes)
    ticks = list(classes) if names else [str(i) for i in range(k)]
    side = max(4.0, 0.6 * k + 2.0)
    fig, ax = subplots(1, figsize=(side, side))
    ax.imshow(m, cmap="Blues")
    ax.set_xticks(range(k), ticks, rotation=45 if names else 0, ha="right" if names else "center")
    ax.set_yticks(range(k), ticks)
    ax.set_xlabel("predicted" + ("" if names else " (class index: model_config.json classes)"))
    ax.set_ylabel("true")
    top = m.max() if m.size else 0
    for i in range(k):
        for j in range(k):
            ax.text(j, i, str(m[i, j]), ha="center", va="center", fontsize=8,
                    color="white" if top and m[i, j] > top / 2 else "black")
    return to_png(fig, title)


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """A PNG's chunks as ``(type, payload)`` in file order; ValueError when it is no PNG or a chunk is cut."""
    if not data.startswith(_PNG_SIGNATURE):
        raise ValueError("not a PNG (bad signature)")
    chunks, pos = [], len(_PNG_SIGNATURE)
    while pos < len(data):
        if pos + 8 > len(data):
            raise ValueError("truncated PNG chunk header")
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        if pos + 12 + n > len(data):
            raise ValueError(f"truncated PNG chunk {kind!r}")
        chunks.append((kind, data[pos + 8:pos + 8 + n]))
        pos += 12 + n
    return chunks


def png_text(data: bytes) -> dict[str, str]:
    """The ``tEXt`` key/value pairs of a PNG (latin-1, as the PNG specification has them)."""
    out = {}
    for kind, payload in _png_chunks(data):
        if kind == b"tEXt":
            key, _, value = payload.partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
    return out


def stamp_png(data: bytes, text: dict[str, str]) -> bytes:
    """The same picture with ``text`` as its only ``tEXt`` chunks (sorted by key, right after the header): any
    other text chunk (matplotlib's ``Software``, a browser's) and any ``tIME`` stamp is dropped, so the bytes depend
    on the pixels and ``text`` alone. Values must be latin-1 (escape anything else, e.g. ``json.dumps``)."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    kept = [(k, p) for k, p in _png_chunks(data) if k not in (b"tEXt", b"zTXt", b"iTXt", b"tIME")]
    stamps = [chunk(b"tEXt", k.encode("latin-1") + b"\0" + v.encode("latin-1")) for k, v in sorted(text.items())]
    out = [_PNG_SIGNATURE, chunk(*kept[0]), *stamps, *(chunk(k, p) for k, p in kept[1:])]
    return b"".join(out)

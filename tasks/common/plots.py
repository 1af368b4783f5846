"""PNG plots for stage artifacts (matplotlib, Agg backend; no timestamps in the file)."""

from __future__ import annotations

import io


def subplots(ncols: int, figsize: tuple[float, float] = (10, 3.6)):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=figsize, dpi=100)


def to_png(fig, title: str) -> bytes:
    """Title, tight layout, PNG bytes with no 'Software' stamp, figure closed."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()

"""What a fine-tuned classifier looks at for one text: attention per layer and head, a per-character attribution
for the predicted label, and the lexicon words matched at each character with the adapter's weights; as DataFrames
and PNG heatmaps; and the fine-tuning stage's explained dev examples.

The pictures come from a plain fp32 forward pass of the encoder with autograd on; the probability shown is the
caller's (the labeller's for a bundle: :mod:`tasks.inference.explain_bundle`; the stage's dev probability during
fine-tuning). The forward pass's own probability, ``prob_forward``, is reported beside it.

Attribution: gradient x input on the character (token) embeddings, summed over the hidden size, for the predicted
label's logit (``+z`` when the label is 1, ``-z`` when it is 0; with K > 2 classes the arg-max class's logit minus
the mean of the K logits, as the softmax ignores a shift of all K), so a positive value pushed the text towards the
label it got. One backward pass, deterministic (no sampling, no baseline). For a classifier that stacks the TF-IDF
baseline only the encoder's part of the shipped logit is attributed (the encoder's logits weighted as the blend
weighs them).

Attention: each block's softmax(QK^T / sqrt(hd)) recomputed from the block's input by a forward hook (the model
runs fused scaled_dot_product_attention, which does not return its weights); only the blocks the classifier runs
(``use_layers``). Positions include [CLS] and [SEP]. The adapter's weights are its ``last_attention``.
"""

from __future__ import annotations

import io
import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from models.numerics import torch_threads
from storage.artifacts import open_artifact
from tasks.common import ui
from tasks.common.config import THREADS
from tasks.common.text import normalize_text
from tasks.text.numbers import NUM_CHAR
from tasks.text.vocab import parse_vocab

log = logging.getLogger("lexiflow")

# CJK fonts tried in order (matplotlib family names): Noto from fonts-noto-cjk, then common desktop ones
CJK_FONTS = ("Noto Sans CJK SC", "Noto Sans CJK JP", "Noto Sans CJK TC", "Noto Serif CJK SC", "Source Han Sans SC",
             "Source Han Sans CN", "WenQuanYi Zen Hei", "WenQuanYi Micro Hei", "SimHei", "Microsoft YaHei",
             "PingFang SC", "Heiti SC", "AR PL UMing CN", "Droid Sans Fallback")
CJK_FILE_HINTS = ("cjk", "sourcehan", "wqy", "simhei", "msyh", "pingfang", "droidsansfallback", "uming")
MAX_PLOT_TOKENS = 96  # a picture shows at most this many characters (the DataFrames hold them all)
REPORT_TOKENS = 40  # ... and in the fine-tuning stage's report


# ============================================================================= computing


@dataclass
class Explanation:
    """One text explained. ``tokens``: the characters the model saw (normalised, #NUM# for a number, truncated as the
    labeller truncates), without [CLS]/[SEP]. DataFrames:

    - ``attention``: ``layer, head, query, key, query_char, key_char, weight`` (positions 0 = [CLS], len+1 = [SEP])
    - ``attribution``: ``position, char, attribution`` (one row per token, position 0-based in ``tokens``)
    - ``words``: ``position, char, word, slot, weight`` (one row per lexicon word matched at a character)"""

    text: str
    tokens: list[str]
    prob: float  # the labeller's probability (K > 2 classes: of the predicted class)
    prob_forward: float  # the explained (plain fp32, autograd) forward pass's probability
    label: int | str  # 0/1, or the class name (K > 2 classes: the arg-max)
    threshold: float | None  # None: K > 2 classes
    bundle_version: str
    attention: pd.DataFrame
    attribution: pd.DataFrame
    words: pd.DataFrame
    layers: int = 0
    heads: int = 0
    blended: bool = False  # the bundle stacks the TF-IDF baseline: the attribution is of the encoder's part only
    _pngs: dict[tuple[int, float, int], dict[str, bytes]] = field(default_factory=dict, repr=False)

    def pngs(self, dpi: int = 110, scale: float = 1.0, max_tokens: int = MAX_PLOT_TOKENS) -> dict[str, bytes]:
        """The pictures as PNG bytes: ``attention_layer<n>.png`` per layer (mean over heads), ``attribution.png``,
        ``words.png`` (rendered once per settings; see :func:`render`)."""
        key = (dpi, scale, max_tokens)
        if key not in self._pngs:
            self._pngs[key] = render(self, dpi, scale, max_tokens=max_tokens)
        return self._pngs[key]

    def save(self, out_dir: str, dpi: int = 110) -> list[str]:
        """Write the PNGs and the three tables (CSV) into ``out_dir`` (created); returns the PNG paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, png in self.pngs(dpi).items():
            (out / name).write_bytes(png)
            paths.append(str(out / name))
        for name in ("attention", "attribution", "words"):
            getattr(self, name).to_csv(out / f"{name}.csv", index=False)
        return paths

    def summary(self) -> dict[str, Any]:
        """The explanation's figures, without the tables and pictures."""
        return {"text": self.text, "prob": self.prob, "prob_forward": self.prob_forward, "label": self.label,
                "threshold": self.threshold, "bundle_version": self.bundle_version, "tokens": len(self.tokens),
                "layers": self.layers, "heads": self.heads, "words_matched": len(self.words), "blended": self.blended}


@dataclass
class Scoring:
    """What explaining needs of a classifier, as a bundle holds it: the fine-tuning stage's model before bundling."""

    version: str
    featurizer: Any  # tasks.text.featurize.Featurizer
    model: Any  # models.LebertClassifier
    threshold: float | None  # None: K > 2 classes (the label is the arg-max)
    classes: list[str] | None
    baseline: Any = None  # tasks.inference.blend.BaselineModel when the classifier stacks it
    blend: Any = None  # tasks.inference.blend.Blend | KBlend


def display_char(t: str) -> str:
    """A token as the tables show it (#NUM# for a number)."""
    return "#NUM#" if t == NUM_CHAR else t


def tick_char(t: str) -> str:
    """A token as an axis label: one character wide (a number, #NUM#, is "#"; the titles say so)."""
    return "#" if t in (NUM_CHAR, "#NUM#") else t


def bundle_words(uri: str) -> list[str]:
    """The word vocabulary (word id -> word) of a bundle or lexicon artifact (``words.txt``, checksum-verified)."""
    return parse_vocab(open_artifact(uri).read_verified("words.txt"))


def explain_text(bundle, text: str, words: Sequence[str], prob: float | np.ndarray) -> Explanation:
    """Explain ``text`` with ``bundle`` (anything with a bundle's ``featurizer``, ``model``, ``threshold``,
    ``classes``, ``version``, ``baseline``, ``blend``: :class:`Scoring` or :class:`tasks.inference.bundle.Bundle`);
    ``words``: word id -> word; ``prob``: the probability to show (K > 2 classes: the [K] probabilities)."""
    if not isinstance(text, str):
        raise ValueError(f"expected a text (str), got {type(text).__name__}")
    feat, model = bundle.featurizer, bundle.model
    tokens = list(feat.tokens(text))
    enc = feat.encode([text])[0]
    if len(enc.input_ids) <= 2:
        raise ValueError(f"text {text[:40]!r} is empty after normalisation: nothing to explain")
    blend = getattr(bundle, "blend", None)
    if bundle.threshold is None:  # K > 2 classes: the arg-max class (ties: the first, as the labeller)
        probs = np.asarray(prob, np.float32)
        c = int(probs.argmax())
        th, label, prob = None, bundle.classes[c], float(probs[c])
        k = len(probs)  # d(shipped logit c - mean of the K shipped logits) / d(encoder logits)
        per_class = np.stack([blend.encoder_weights(j) for j in range(k)]) if blend is not None else np.eye(k)
        direction = per_class[c] - per_class.mean(0)
    else:
        th = float(bundle.threshold)
        c = label = int(float(np.float32(prob)) >= th)  # as the labeller: from the stored float32 value
        direction = np.array([(1.0 if label == 1 else -1.0) * (float(blend.w_encoder) if blend is not None else 1.0)])
    with torch_threads(THREADS):
        att, grad_x, adapter_w, z = _forward(model, enc, direction)
    if blend is not None:
        shipped = blend.prob(z[None] if th is None else z, bundle.baseline.logits([normalize_text(text)]))
        prob_forward = float(shipped[0, c] if th is None else shipped[0])
    elif th is None:
        e = np.exp(z - z.max())
        prob_forward = float(e[c] / e.sum())
    else:
        prob_forward = float(1.0 / (1.0 + math.exp(-float(z[0]))))
    chars = ["[CLS]", *(display_char(t) for t in tokens), "[SEP]"]
    return Explanation(text, tokens, prob, prob_forward, label, th, str(bundle.version),
                       attention_frame(att, chars), attribution_frame(grad_x, tokens),
                       words_frame(enc.word_ids, adapter_w, tokens, words), layers=len(att),
                       heads=int(att[0].shape[0]) if att else 0, blended=blend is not None)


def _forward(model, enc, direction: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, np.ndarray | None, np.ndarray]:
    """One fp32 forward + backward of ``direction @ logits`` (``direction``: [1] for a one-logit head, [K]):
    (attention [nh,T,T] per layer run, gradient x input [T] on the token embeddings, adapter weights [T,W] or None,
    the encoder's logits float64 [1] or [K]). The model's mode and flags are restored."""
    dev = next(model.parameters()).device
    enc_mod = model.encoder
    blocks = list(enc_mod.blocks[: model.use_layers])
    attn: list[np.ndarray] = []
    emb: dict[str, Any] = {}

    def on_attention(mod, args, _out):
        x, key_mask = args[0], args[1]
        B, T, H = x.shape
        nh = mod.num_heads
        q, k, _ = mod.qkv(x).view(B, T, 3, nh, H // nh).permute(2, 0, 3, 1, 4)  # [B,nh,T,hd]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(H // nh)  # [B,nh,T,T]
        s = s.masked_fill(~key_mask, float("-inf"))
        attn.append(torch.softmax(s.float(), dim=-1)[0].detach().cpu().numpy())

    def on_embedding(_mod, _args, out):  # the token vectors become a leaf we take the gradient for
        leaf = out.detach().requires_grad_(True)
        emb["x"] = leaf
        return leaf

    adapter = enc_mod.adapter
    was_training, recorded = model.training, (adapter.record_attention if adapter is not None else False)
    hooks = [b.attn.register_forward_hook(on_attention) for b in blocks]
    hooks.append(enc_mod.embeddings.token.register_forward_hook(on_embedding))
    try:
        model.eval()
        if adapter is not None:
            adapter.record_attention, adapter.last_attention = True, None
        ids = torch.from_numpy(np.asarray(enc.input_ids, np.int64))[None].to(dev)
        wids = torch.from_numpy(np.asarray(enc.word_ids, np.int64))[None].to(dev)
        with torch.enable_grad():
            z = model(ids, attention_mask=ids != 0, word_ids=wids).float()[0].reshape(-1)  # [1] or [K]
            target = (torch.as_tensor(np.asarray(direction), dtype=z.dtype, device=z.device) * z).sum()
            (g,) = torch.autograd.grad(target, emb["x"])
        grad_x = (g * emb["x"]).sum(-1)[0].detach().cpu().numpy().astype(np.float64)  # [T]
        used = adapter is not None and model.uses_lexicon and adapter.last_attention is not None
        adapter_w = adapter.last_attention[0].float().cpu().numpy() if used else None
    finally:
        for h in hooks:
            h.remove()
        if adapter is not None:
            adapter.record_attention, adapter.last_attention = recorded, None
        model.train(was_training)
    return attn, grad_x, adapter_w, z.detach().cpu().numpy().astype(np.float64)


def attention_frame(att: list[np.ndarray], chars: list[str]) -> pd.DataFrame:
    """Long table of the attention weights: one row per (layer, head, query, key)."""
    if not att:
        return pd.DataFrame({c: [] for c in ("layer", "head", "query", "key", "query_char", "key_char", "weight")})
    nh, T, _ = att[0].shape
    L = len(att)
    layer, head, q, k = np.meshgrid(np.arange(1, L + 1), np.arange(nh), np.arange(T), np.arange(T), indexing="ij")
    ch = np.asarray(chars, dtype=object)
    return pd.DataFrame({"layer": layer.ravel(), "head": head.ravel(), "query": q.ravel(), "key": k.ravel(),
                         "query_char": ch[q.ravel()], "key_char": ch[k.ravel()],
                         "weight": np.stack(att).astype(np.float32).ravel()})


def attribution_frame(grad_x: np.ndarray, tokens: list[str]) -> pd.DataFrame:
    """One row per token (the [CLS]/[SEP] rows of the gradient are left out)."""
    return pd.DataFrame({"position": np.arange(len(tokens)), "char": [display_char(t) for t in tokens],
                         "attribution": grad_x[1 : 1 + len(tokens)]})


def words_frame(word_ids: np.ndarray, adapter_w: np.ndarray | None, tokens: list[str],
                words: Sequence[str]) -> pd.DataFrame:
    """One row per lexicon word matched at a character (word id != 0), with the adapter's weight for it (NaN when
    the classifier does not run the adapter)."""
    rows = []
    for pos in range(len(tokens)):
        for slot, wid in enumerate(word_ids[pos + 1].tolist()):
            if wid:
                w = float(adapter_w[pos + 1, slot]) if adapter_w is not None else float("nan")
                rows.append((pos, display_char(tokens[pos]), words[wid] if wid < len(words) else f"#{wid}", slot, w))
    return pd.DataFrame(rows, columns=["position", "char", "word", "slot", "weight"]).astype(
        {"position": "int64", "slot": "int64", "weight": "float64"})


# ============================================================================= pictures


_FONT_CACHE: dict[tuple[str, ...], str | None] = {}


def cjk_font(candidates: Sequence[str] = CJK_FONTS) -> str | None:
    """The first installed CJK font family among ``candidates`` (matplotlib's font list), or None with a warning
    (Chinese characters then render as boxes; install e.g. fonts-noto-cjk)."""
    key = tuple(candidates)
    if key not in _FONT_CACHE:
        from matplotlib import font_manager  # noqa: PLC0415 - matplotlib is slow to import; only drawing needs it

        installed = {f.name for f in font_manager.fontManager.ttflist}
        found = next((c for c in candidates if c in installed), None)
        if found is None:  # matplotlib's font cache may predate the font's install: add the files themselves
            for path in font_manager.findSystemFonts():
                if any(k in path.lower().rsplit("/", 1)[-1] for k in CJK_FILE_HINTS):
                    try:
                        font_manager.fontManager.addfont(path)
                    except (OSError, RuntimeError, ValueError) as e:
                        log.debug("font %s not usable: %s", path, e)
            installed = {f.name for f in font_manager.fontManager.ttflist}
            found = next((c for c in candidates if c in installed), None)
        if found is None:
            log.warning("no CJK font found (tried %s): Chinese characters in the explain pictures will show as "
                        "boxes; install one, e.g. `apt-get install fonts-noto-cjk`", ", ".join(candidates[:3]) + ", …")
        _FONT_CACHE[key] = found
    return _FONT_CACHE[key]


def _figure(width: float, height: float):
    """A figure and its axes without pyplot: no backend is chosen or changed (a notebook keeps its own)."""
    from matplotlib.figure import Figure  # noqa: PLC0415 - as in cjk_font

    fig = Figure(figsize=(width, height))
    return fig, fig.subplots()


def _fig_png(fig, dpi: int) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def render(ex: Explanation, dpi: int = 110, scale: float = 1.0, fonts: Sequence[str] = CJK_FONTS,
           max_tokens: int = MAX_PLOT_TOKENS) -> dict[str, bytes]:
    """Every picture of ``ex`` as PNG bytes, labels in the first of ``fonts`` installed (none: warned once, not per
    glyph). A text longer than ``max_tokens`` is drawn as the window of ``max_tokens`` characters centred on the
    largest attribution (the titles say which; the DataFrames hold everything)."""
    import matplotlib  # noqa: PLC0415 - as in cjk_font

    font = cjk_font(fonts)
    rc = {"font.family": "sans-serif", "font.sans-serif": [font, "DejaVu Sans"] if font else ["DejaVu Sans"],
          "axes.unicode_minus": False}
    lo, hi = plot_window(ex, max_tokens)
    out: dict[str, bytes] = {}
    with warnings.catch_warnings(), matplotlib.rc_context(rc):
        warnings.filterwarnings("ignore", message="Glyph .* missing from")  # said once by cjk_font
        for layer in range(1, ex.layers + 1):
            out[f"attention_layer{layer}.png"] = _fig_png(_attention_figure(ex, layer, lo, hi, scale), dpi)
        out["attribution.png"] = _fig_png(_attribution_figure(ex, lo, hi, scale), dpi)
        out["words.png"] = _fig_png(_words_figure(ex, lo, hi, scale), dpi)
    return out


def plot_window(ex: Explanation, max_tokens: int) -> tuple[int, int]:
    """Token positions [lo, hi) drawn: all, or ``max_tokens`` centred on the largest |attribution|."""
    n = len(ex.tokens)
    if n <= max_tokens:
        return 0, n
    peak = int(np.argmax(np.abs(ex.attribution["attribution"].to_numpy())))
    lo = int(np.clip(peak - max_tokens // 2, 0, n - max_tokens))
    return lo, lo + max_tokens


def _title(ex: Explanation, lo: int, hi: int) -> str:
    num = "  # = a number" if NUM_CHAR in ex.tokens[lo:hi] else ""
    part = f"  characters {lo + 1}-{hi} of {len(ex.tokens)}" if hi - lo < len(ex.tokens) else ""
    rule = "arg-max" if ex.threshold is None else f"threshold {ex.threshold:.3f}"
    return f"label {ex.label}  p={ex.prob:.3f}  ({rule}){num}{part}"


def _tick_size(n: int) -> float:
    return float(np.clip(11 - n / 12, 5, 10))


def _attention_figure(ex: Explanation, layer: int, lo: int, hi: int, scale: float):
    a = ex.attention[ex.attention["layer"] == layer]
    T = len(ex.tokens) + 2
    m = a.groupby(["query", "key"])["weight"].mean().to_numpy().reshape(T, T)  # mean over heads
    whole = hi - lo == len(ex.tokens)
    idx = np.arange(T) if whole else np.arange(lo + 1, hi + 1)  # [CLS]/[SEP] with the whole text only
    labels = (["[CLS]"] if whole else []) + [tick_char(t) for t in ex.tokens[lo:hi]] + (["[SEP]"] if whole else [])
    n = len(idx)
    side = float(np.clip(1.2 + 0.22 * n, 3.0, 14.0)) * scale
    fig, ax = _figure(side + 1.0 * scale, side)
    im = ax.imshow(m[np.ix_(idx, idx)], cmap="viridis", vmin=0.0, aspect="equal")
    fs = _tick_size(n)
    ax.set_xticks(range(n), labels, fontsize=fs)
    for tick in ax.get_xticklabels():  # characters upright, [CLS]/[SEP] turned
        tick.set_rotation(90 if len(tick.get_text()) > 1 else 0)
    ax.set_yticks(range(n), labels, fontsize=fs)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query")
    ax.set_title(f"layer {layer} attention, mean of {ex.heads} heads\n{_title(ex, lo, hi)}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03)
    return fig


def _attribution_figure(ex: Explanation, lo: int, hi: int, scale: float):
    vals = ex.attribution["attribution"].to_numpy()[lo:hi]
    n = hi - lo
    fig, ax = _figure(float(np.clip(1.5 + 0.28 * n, 4.0, 16.0)) * scale, 2.8 * scale)
    ax.bar(range(n), vals, color=["#2a9d4b" if v >= 0 else "#d1495b" for v in vals])
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xticks(range(n), [tick_char(t) for t in ex.tokens[lo:hi]], fontsize=_tick_size(n) + 1)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylabel("grad x input")
    part = ", encoder part of the stacked logit" if ex.blended else ""
    ax.set_title(f"attribution towards label {ex.label} (green: for, red: against{part})\n{_title(ex, lo, hi)}",
                 fontsize=9)
    return fig


def _words_figure(ex: Explanation, lo: int, hi: int, scale: float):
    w = ex.words[(ex.words["position"] >= lo) & (ex.words["position"] < hi)]
    n = hi - lo
    if w.empty:
        fig, ax = _figure(4.0 * scale, 1.2 * scale)
        ax.axis("off")
        ax.text(0.5, 0.5, "no lexicon word matched", ha="center", va="center")
        return fig
    vocab = list(dict.fromkeys(w.sort_values(["position", "slot"])["word"]))  # in order of first match
    grid = np.full((len(vocab), n), np.nan)
    row = {v: i for i, v in enumerate(vocab)}
    for p, word, weight in zip(w["position"], w["word"], w["weight"]):
        grid[row[word], p - lo] = weight
    fig, ax = _figure(float(np.clip(1.8 + 0.3 * n, 4.0, 16.0)) * scale,
                      float(np.clip(1.0 + 0.3 * len(vocab), 2.0, 12.0)) * scale)
    im = ax.imshow(np.nan_to_num(grid, nan=0.0), cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
    ax.imshow(np.where(np.isnan(grid), 1.0, np.nan), cmap="Greys", vmin=0.0, vmax=4.0, aspect="auto")  # unmatched
    fs = _tick_size(max(n, len(vocab)))
    ax.set_xticks(range(n), [tick_char(t) for t in ex.tokens[lo:hi]], fontsize=fs + 1)
    ax.set_yticks(range(len(vocab)), vocab, fontsize=fs + 1)
    if n <= 40 and scale >= 0.9:  # the weights written in the cells, where they fit
        for (r, c), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=6, color="white" if v > 0.6 else "black")
    ax.set_title(f"lexicon words at each character, adapter weight\n{_title(ex, lo, hi)}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.02)
    return fig


# ============================================================================= the fine-tuning stage's report


def pick_examples(labels: np.ndarray, prob: np.ndarray, threshold: float | None,
                  per_kind: int = 2) -> list[tuple[int, str]]:
    """Indices of the most confident right and the most confident wrong dev predictions (``per_kind`` each, fewer
    when there are fewer), as ``(index, "right"|"wrong")``; confidence = distance of the probability from the
    threshold (K > 2 classes, ``prob`` [N, K] and no threshold: the arg-max class's probability). Ties keep the
    input order."""
    labels, prob = np.asarray(labels).astype(int), np.asarray(prob, np.float64)
    if threshold is None:
        pred, conf = prob.argmax(1), prob.max(1)
    else:
        pred, conf = (prob >= threshold).astype(int), np.abs(prob - threshold)
    out: list[tuple[int, str]] = []
    for kind, sel in (("right", pred == labels), ("wrong", pred != labels)):
        idx = np.flatnonzero(sel)
        order = idx[np.argsort(-conf[idx], kind="stable")]
        out += [(int(i), kind) for i in order[:per_kind]]
    return out


def report_markdown(items: list[tuple[str, int | str, Explanation]], title: str) -> str:
    """Markdown with the pictures inline (data URIs): per example its text, gold label, labelled probability, the
    attribution and words pictures and the last layer's attention."""
    parts = [f"# {title}", "Most confident right and wrong dev predictions. Attribution: gradient x input on the "
             "character embeddings, for the predicted label (green for, red against). Attention: the last layer, "
             "mean of its heads. Words: the lexicon adapter's weight on each word matched at a character."]
    for kind, gold, ex in items:
        pngs = ex.pngs(dpi=72, scale=0.7, max_tokens=REPORT_TOKENS)
        last = f"attention_layer{ex.layers}.png"
        parts += [f"## {kind}: gold {gold}, predicted {ex.label} (p={ex.prob:.3f})", f"> {ex.text[:300]}"]
        parts += [ui.png_markdown(f"{kind} {name}", pngs[name]) for name in ("attribution.png", "words.png", last)
                  if name in pngs]
    return "\n\n".join(parts) + "\n"


def publish_dev_explanations(scoring, texts: Sequence[str], labels: np.ndarray, prob: np.ndarray, words: Sequence[str],
                             art, reporter: ui.Reporter = ui.PLAIN, per_kind: int = 1) -> str | None:
    """Explain a few dev examples (:func:`pick_examples`) with ``scoring`` (bundle-like: the stage's model,
    featurizer, threshold, blend) and publish them as the markdown artifact ``finetune-explain``; returns the
    markdown (None when there is nothing to explain). ``prob``: the stage's dev probabilities (shown as they are)."""
    threshold = None if scoring.threshold is None else float(scoring.threshold)
    picked = pick_examples(labels, prob, threshold, per_kind)
    classes = scoring.classes if threshold is None else None  # K > 2: gold as the class name
    items = []
    for i, kind in picked:
        gold = int(labels[i]) if classes is None else classes[int(labels[i])]
        p = float(prob[i]) if threshold is not None else np.asarray(prob[i], np.float32)
        try:
            items.append((kind, gold, explain_text(scoring, texts[i], words, prob=p)))
        except ValueError as e:  # an empty-after-normalisation dev text (cannot be: it was scored); said, skipped
            log.warning("finetune-explain: dev row %d not explained: %s", i, e)
    if not items:
        return None
    md = report_markdown(items, f"finetune `{art.manifest.version}`: what the model looks at")
    reporter.publish_markdown("finetune-explain", md, f"fine-tuning: {len(items)} dev examples explained")
    return md


def explain_dev(res, featurizer, lexicon_uri: str, art, reporter: ui.Reporter, per_kind: int = 1) -> str | None:
    """The fine-tuning stage's hook (its publish step, in a run only): explain the best epoch's most confident
    right and wrong dev predictions (``per_kind`` each; 1 keeps the stage's publish step cheap: two examples) with
    the trained model as it will be bundled; never fails the stage."""
    if not reporter.active or not len(res.dev):
        return None
    try:
        classes = getattr(res, "classes", None)
        if classes is not None and len(classes) > 2:  # K > 2 classes: the label is the arg-max, no threshold
            scoring = Scoring(art.manifest.version, featurizer, res.train.model, None, classes, res.baseline,
                              res.blend)
        else:
            scoring = Scoring(art.manifest.version, featurizer, res.train.model, float(res.threshold.threshold),
                              None, res.baseline, res.blend)
        texts = [r["text"] for r in res.data.dev]
        return publish_dev_explanations(scoring, texts, res.dev.labels, res.dev_prob, bundle_words(lexicon_uri), art,
                                        reporter, per_kind)
    except Exception as e:  # a convenience picture must not fail a committed stage; said, with what failed
        log.warning("finetune-explain for %s not published: %s: %s", art.uri, type(e).__name__, e)
        return None

"""ner: character NER on the pretrained LEBERT encoder (softmax or CRF head), plus the HMM baseline.

Data: character-per-line files read by :func:`tasks.ner.data.read_ner` (tags -> BIO), either given
``train_uri``/``dev_uri``(/``test_uri``) or one ``data_uri`` split by ``split``/``split_seed``.

Features (:func:`encode_sentences`): every input character maps to exactly one token, so tag i
belongs to character i. Per character: OpenCC t2s and full-width -> half-width (kept only when
the result is one character); an ASCII digit becomes the ``#NUM#`` id (the corpus never had
digits: every number was one ``#NUM#``), other characters their vocabulary id or ``[UNK]``. Words
come from the same matcher as :class:`tasks.train.featurize.Featurizer` (digits and multi-character
tokens never match, as in the corpus) over the *whole* sentence, top-k by rank, mapped with the
featuriser's ``rank_to_word``.

Long sentences: a sentence longer than ``max_len - 2`` characters is cut into consecutive chunks
of ``max_len - 2`` characters (each gets its own [CLS]/[SEP]; lexicon words are matched on the
whole sentence first, so a chunk keeps the words crossing its edge). Training uses every chunk as
one example (its tags re-read as BIO, so a chunk never starts with ``I-X``); prediction tags each
chunk and concatenates the tags, and metrics are computed on the re-joined sentences. An entity
crossing a cut may be split in two.

Training: AdamW (no decay on biases/LayerNorm/CRF), length-bucketed batches. After every epoch the
dev set is tagged and scored (entity P/R/F1, :mod:`tasks.ner.metrics`); the model is selected on
DEV F1 only (first epoch with the best value), ``patience`` non-improving epochs stop training,
and the best epoch's weights are then scored once on test.
"""

from __future__ import annotations

import io
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tasks.common.text import norm_char
from tasks.common.config import NerConfig
from tasks.train.featurize import Encoded, Featurizer
from tasks.train.finetune import EarlyStopper, bucket_batches, load_pretrained, resolve_device, subsample
from tasks.prepare.matcher import NUM_CHAR, find_matches, text_codepoints, top_k_ranks
from tasks.ner.data import read_ner, spans, split_sentences, to_bio
from tasks.ner.metrics import entity_prf
from tasks.prepare.vocab import CLS, NUM_ID, SEP, UNK

CODE_VERSION = "ner-1"
ENCODE_CHUNK = 4096  # sentences per matcher call


# ============================================================================= data


@dataclass
class NerSplits:
    train: list[dict[str, Any]]  # read_ner sentences {chars, tags (BIO), line}
    dev: list[dict[str, Any]]
    test: list[dict[str, Any]]
    rejects: list[dict[str, Any]]  # {source, line, reason, text}
    stats: dict[str, Any]  # {"in", "out", "rejected": {reason: n}} over every file read
    data: dict[str, Any]  # the readers' other counts, summed (repaired_i_start, multi_char, types ...)
    capped: dict[str, int]  # sentences left out by the caps, per split


def load_ner_splits(cfg: NerConfig) -> NerSplits:
    uris = [cfg.data_uri] if cfg.data_uri else [cfg.train_uri, cfg.dev_uri, cfg.test_uri]
    parts, rejects, agg = [], [], Counter()
    types: Counter = Counter()
    for uri in uris:
        if not uri:
            parts.append([])
            continue
        d = read_ner(uri, cfg.strip_suffix)
        parts.append(d.sentences)
        rejects += [{"source": uri, **r} for r in d.rejects]
        agg.update({k: v for k, v in d.stats.items() if isinstance(v, int)})
        agg.update({f"rejected.{k}": v for k, v in d.stats["rejected"].items()})
        types.update(d.stats["types"])
    train, dev, test = split_sentences(parts[0], cfg.split, cfg.split_seed) if cfg.data_uri else parts
    full = {"train": len(train), "dev": len(dev), "test": len(test)}
    train = subsample(train, cfg.max_train_sentences, cfg.split_seed + 1)
    dev = subsample(dev, cfg.max_eval_sentences, cfg.split_seed + 2)
    test = subsample(test, cfg.max_eval_sentences, cfg.split_seed + 3)
    capped = {k: full[k] - len(v) for k, v in (("train", train), ("dev", dev), ("test", test))}
    rejected = {k.split(".", 1)[1]: v for k, v in sorted(agg.items()) if k.startswith("rejected.")}
    stats = {"in": agg["in"], "out": agg["out"], "rejected": rejected}
    data = {k: v for k, v in sorted(agg.items()) if k not in ("in", "out") and not k.startswith("rejected.")}
    return NerSplits(train, dev, test, rejects, stats, {**data, "types": dict(sorted(types.items()))}, capped)


def tag_list(sentences: Sequence[dict[str, Any]]) -> list[str]:
    """``O``, then ``B-X``, ``I-X`` for every type in the (training) sentences, types sorted."""
    kinds = sorted({t[2:] for s in sentences for t in s["tags"] if t != "O"})
    return ["O"] + [f"{p}-{k}" for k in kinds for p in "BI"]


# ============================================================================= features


def _match_char(c: str) -> str:
    # what the lexicon matcher sees: digits are #NUM# (never inside a word), multi-char tokens a separator
    return NUM_CHAR if c in "0123456789" else (c if len(c) == 1 else "\x00")


def encode_sentences(sentences: Sequence[Sequence[str]], feat: Featurizer) -> list[Encoded]:
    """Character lists -> Encoded ([CLS] one id per character [SEP], word ids [n+2, k]); no truncation."""
    out: list[Encoded] = []
    vocab = feat.vocab_index
    for lo in range(0, len(sentences), ENCODE_CHUNK):
        batch = [[norm_char(c) for c in s] for s in sentences[lo : lo + ENCODE_CHUNK]]
        cps = text_codepoints("\x00".join("".join(_match_char(c) for c in s) for s in batch))
        starts, lengths, ranks = find_matches(cps, feat.ct, 2)
        wid = feat.rank_to_word[ranks] if len(ranks) else np.zeros(0, np.int64)
        keep = wid >= 0  # matched words outside the word vocabulary are ignored (as in Featurizer)
        top = top_k_ranks(len(cps), starts[keep], lengths[keep], ranks[keep], feat.k)
        top_ids = np.where(top >= 0, feat.rank_to_word[np.maximum(top, 0)], 0)
        off = 0
        for s in batch:
            n = len(s)
            ids = np.empty(n + 2, np.int64)
            ids[0], ids[-1] = CLS, SEP
            ids[1:-1] = [NUM_ID if c in "0123456789" else vocab.get(c, UNK) for c in s]
            w = np.zeros((n + 2, feat.k), np.int64)
            w[1:-1] = top_ids[off : off + n]
            out.append(Encoded(ids, w))
            off += n + 1
    return out


def encode_chars(chars: Sequence[str], feat: Featurizer) -> Encoded:
    """One sentence; ``len(input_ids) == len(chars) + 2`` always."""
    return encode_sentences([chars], feat)[0]


def chunk_bounds(n: int, size: int) -> list[tuple[int, int]]:
    """Consecutive ``[lo, hi)`` character ranges of at most ``size`` covering ``0..n``."""
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def _slice(e: Encoded, lo: int, hi: int) -> Encoded:
    ids = np.concatenate([[CLS], e.input_ids[1 + lo : 1 + hi], [SEP]]).astype(np.int64)
    w = np.zeros((hi - lo + 2, e.word_ids.shape[1]), np.int64)
    w[1:-1] = e.word_ids[1 + lo : 1 + hi]
    return Encoded(ids, w)


@dataclass
class ChunkSet:
    """Model inputs: one entry per chunk; ``owner[i]`` = index of chunk i's sentence (chunks in order)."""

    encoded: list[Encoded]
    tags: list[np.ndarray] | None  # int64 [n] tag ids per chunk (training only)
    owner: np.ndarray  # int64 [chunks]
    n_sentences: int

    def __post_init__(self):
        self.lengths = np.array([len(e.input_ids) for e in self.encoded], np.int64)

    def __len__(self) -> int:
        return len(self.encoded)


def build_chunks(sentences: Sequence[Sequence[str]], feat: Featurizer, max_len: int, tag_seqs=None, tag_index=None) -> ChunkSet:
    """Encode whole sentences, then cut into chunks of ``max_len - 2`` characters (see module doc)."""
    enc, tags, owner = [], ([] if tag_seqs is not None else None), []
    for i, e in enumerate(encode_sentences(sentences, feat)):
        for lo, hi in chunk_bounds(len(e.input_ids) - 2, max_len - 2):
            enc.append(_slice(e, lo, hi))
            owner.append(i)
            if tags is not None:
                tags.append(np.array([tag_index[t] for t in to_bio(tag_seqs[i][lo:hi])], np.int64))
    return ChunkSet(enc, tags, np.array(owner, np.int64), len(sentences))


def collate(ds: ChunkSet, idx: np.ndarray, device: torch.device, with_words: bool) -> dict[str, torch.Tensor]:
    """Dynamic padding; ``tag_mask`` marks characters (not [CLS]/[SEP]/padding), tags -100 elsewhere."""
    lens = ds.lengths[idx]
    B, T = len(idx), int(lens.max())
    ids = np.zeros((B, T), np.int64)
    words = np.zeros((B, T, ds.encoded[idx[0]].word_ids.shape[1]), np.int64) if with_words else None
    tags = np.full((B, T), -100, np.int64)
    for b, i in enumerate(idx):
        e = ds.encoded[i]
        ids[b, : len(e.input_ids)] = e.input_ids
        if with_words:
            words[b, : len(e.input_ids)] = e.word_ids
        if ds.tags is not None:
            tags[b, 1 : len(e.input_ids) - 1] = ds.tags[i]
    pos = np.arange(T)[None, :]
    out = {
        "input_ids": torch.from_numpy(ids).to(device),
        "attention_mask": torch.from_numpy(pos < lens[:, None]).to(device),
        "tag_mask": torch.from_numpy((pos >= 1) & (pos < lens[:, None] - 1)).to(device),
        "tags": torch.from_numpy(tags).to(device),
    }
    out["word_ids"] = torch.from_numpy(words).to(device) if with_words else None
    return out


@torch.no_grad()
def predict_chunks(model, ds: ChunkSet, batch_size: int, device: torch.device, with_words: bool) -> list[list[int]]:
    """Tag ids per sentence (chunks re-joined), batches sorted by length."""
    model.eval()
    per_chunk: list[list[int]] = [[] for _ in range(len(ds))]
    order = np.argsort(ds.lengths, kind="stable")
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        b = collate(ds, idx, device, with_words)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            paths = model.decode(b["input_ids"], b["attention_mask"], b["word_ids"], b["tag_mask"])
        for i, p in zip(idx, paths):
            per_chunk[i] = p
    out: list[list[int]] = [[] for _ in range(ds.n_sentences)]
    for i, o in enumerate(ds.owner.tolist()):
        out[o] += per_chunk[i]
    return out


# ============================================================================= training


@dataclass
class NerTrainResult:
    model: Any  # models.LebertTagger with the best epoch's weights (eval mode)
    log: list[dict[str, Any]]
    best_epoch: int
    best_dev_f1: float
    dev_pred: list[list[str]]  # best epoch's dev tags


def make_optimizer(model: torch.nn.Module, cfg: NerConfig) -> torch.optim.Optimizer:
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            decay = p.ndim >= 2 and not name.startswith("crf.")
            groups.setdefault((name.startswith("encoder."), decay), []).append(p)
    enc_lr = cfg.encoder_lr or cfg.lr
    return torch.optim.AdamW(
        [{"params": ps, "lr": enc_lr if enc else cfg.lr, "weight_decay": cfg.weight_decay if dec else 0.0}
         for (enc, dec), ps in sorted(groups.items(), key=lambda kv: kv[0])],  # head groups first
        lr=cfg.lr, fused=False,
    )


def train_tagger(cfg: NerConfig, train: ChunkSet, dev: ChunkSet, dev_gold: list[list[str]], tags: list[str], model_cfg,
                 encoder_state: dict[str, torch.Tensor] | None = None, progress: bool = False,
                 on_epoch: Callable[[dict[str, Any]], None] | None = None) -> NerTrainResult:
    """Train; the epoch with the best dev entity F1 is kept (never looks at test)."""
    from tqdm.auto import tqdm

    from models import LebertTagger

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    model = LebertTagger(model_cfg, len(tags), cfg.use_layers, cfg.dropout, cfg.use_crf)
    if encoder_state is not None:
        model.load_pretrained_encoder(encoder_state)
    model.to(device)
    with_words = cfg.use_adapter and model.uses_lexicon
    opt = make_optimizer(model, cfg)
    stopper = EarlyStopper(cfg.patience, 1.0)
    log: list[dict[str, Any]] = []
    best_state, best_pred = None, None
    n_chars = int(sum(len(t) for t in train.tags))
    for epoch in range(1, cfg.max_epochs + 1):
        model.train()
        loss_sum = 0.0
        batches = bucket_batches(train.lengths, cfg.batch_size, np.random.default_rng([cfg.seed, epoch]))
        for idx in tqdm(batches, desc=f"ner epoch {epoch}", unit="batch", disable=not progress, leave=False, mininterval=2):
            b = collate(train, idx, device, with_words)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = model.loss(b["input_ids"], b["attention_mask"], b["word_ids"], b["tags"], b["tag_mask"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            loss_sum += float(loss.detach()) * int(b["tag_mask"].sum())
        pred = [[tags[i] for i in p] for p in predict_chunks(model, dev, cfg.batch_size, device, with_words)]
        dev_m = entity_prf(dev_gold, pred)["overall"]
        improved, _, stop = stopper.update(dev_m["f1"])
        if improved:
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            best_pred = pred
        row = {"epoch": epoch, "train_loss": loss_sum / max(n_chars, 1), "dev_f1": dev_m["f1"], "dev_precision": dev_m["precision"],
               "dev_recall": dev_m["recall"], "lr": opt.param_groups[0]["lr"], "improved": improved}
        log.append(row)
        if on_epoch:
            on_epoch(row)
        if stop:
            break
    if best_state is None:
        raise RuntimeError("dev F1 was never finite; cannot pick an epoch")
    model.load_state_dict(best_state)
    model.eval()
    return NerTrainResult(model, log, stopper.best_epoch, stopper.best, best_pred)


def _round(d: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in d.items()}


@dataclass
class NerResult:
    train: NerTrainResult
    splits: NerSplits
    tags: list[str]
    test_pred: list[list[str]]
    metrics: dict[str, Any]
    max_len: int


def train_ner(cfg: NerConfig, feat: Featurizer, model_cfg, encoder_state=None, max_len: int | None = None,
              progress: bool = False, on_epoch=None) -> NerResult:
    """Read, encode, train (select on dev), tag test at the best epoch (no I/O out)."""
    t0 = time.perf_counter()
    max_len = min(max_len or cfg.max_len, model_cfg.max_len)
    sp = load_ner_splits(cfg)
    if not sp.train or not sp.dev:
        raise ValueError(f"ner needs non-empty train and dev splits (train {len(sp.train)}, dev {len(sp.dev)})")
    if model_cfg.use_adapter and len(feat.rank_to_word) and int(feat.rank_to_word.max()) >= model_cfg.word_vocab_size:
        raise ValueError("the lexicon's word ids exceed the model's word_vocab_size: lexicon and pretrain artifacts do not match")
    tags = tag_list(sp.train)
    tag_index = {t: i for i, t in enumerate(tags)}
    chars = lambda ss: [s["chars"] for s in ss]  # noqa: E731
    train_ds = build_chunks(chars(sp.train), feat, max_len, [s["tags"] for s in sp.train], tag_index)
    dev_ds, test_ds = build_chunks(chars(sp.dev), feat, max_len), build_chunks(chars(sp.test), feat, max_len)
    tr = train_tagger(cfg, train_ds, dev_ds, [s["tags"] for s in sp.dev], tags, model_cfg, encoder_state, progress, on_epoch)
    device = next(tr.model.parameters()).device
    with_words = cfg.use_adapter and tr.model.uses_lexicon
    test_pred = [[tags[i] for i in p] for p in predict_chunks(tr.model, test_ds, cfg.batch_size, device, with_words)]
    test = entity_prf([s["tags"] for s in sp.test], test_pred) if sp.test else None
    best = tr.log[tr.best_epoch - 1]
    metrics = {
        **({f"test_{k}": round(test["overall"][k], 6) for k in ("precision", "recall", "f1")} if test else
           dict.fromkeys(("test_precision", "test_recall", "test_f1"))),
        "test_support": test["overall"]["support"] if test else 0,
        "test_per_type": {k: _round(v) for k, v in test["per_type"].items()} if test else {},
        "best_epoch": tr.best_epoch,
        "dev_f1": round(best["dev_f1"], 6),
        "dev_precision": round(best["dev_precision"], 6),
        "dev_recall": round(best["dev_recall"], 6),
        "epochs_run": len(tr.log),
        "selected_on": "dev",
        "n_train": len(sp.train), "n_dev": len(sp.dev), "n_test": len(sp.test),
        "n_train_chunks": len(train_ds),
        "capped": sp.capped,
        "data": sp.data,
        "num_tags": len(tags),
        "use_crf": cfg.use_crf,
        "use_adapter": cfg.use_adapter,
        "uses_lexicon": with_words,
        "use_layers": tr.model.use_layers,
        "max_len": max_len,
        "seed": cfg.seed,
        "device": str(device),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    return NerResult(tr, sp, tags, test_pred, metrics, max_len)


def plot_epochs(log: list[dict[str, Any]], title: str = "ner") -> bytes:
    """PNG: dev entity P/R/F1 and train loss against epoch; the selected (best dev F1) epoch marked."""
    from tasks.common.plots import subplots, to_png

    ep = [r["epoch"] for r in log]
    best = max(log, key=lambda r: (r["dev_f1"], -r["epoch"]))["epoch"] if log else None
    fig, (a, b) = subplots(2)
    for key in ("dev_f1", "dev_precision", "dev_recall"):
        a.plot(ep, [r[key] for r in log], marker="o", ms=3, label=key.replace("_", " "))
    b.plot(ep, [r["train_loss"] for r in log], marker="o", ms=3, label="train loss (per char)")
    for ax, name in ((a, "entity score"), (b, "loss")):
        if best is not None:
            ax.axvline(best, color="grey", ls="--", lw=1, label=f"best dev epoch {best}")
        ax.set_xlabel("epoch")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend()
    return to_png(fig, title)


# ============================================================================= stage


def write_ner_outputs(writer, res: NerResult, cfg: NerConfig, feat: Featurizer) -> dict[str, int]:
    """Model, config, tags, epoch log + plot, test predictions, rejects and the featuriser files
    (``vocab.txt``, ``rank_to_word.npy``, ``compiled.npz``) so the artifact is self-contained."""
    import pyarrow as pa
    from safetensors.torch import save as st_save

    from storage.parquet import write_table
    from tasks.prepare.vocab import vocab_bytes

    model = res.train.model
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    writer.write_bytes("model.safetensors", st_save(sd, metadata={"format": "pt"}))
    mc = {"model": model.cfg.model_dump(), "num_tags": len(res.tags), "tags": res.tags, "use_layers": model.use_layers,
          "dropout": cfg.dropout, "use_crf": cfg.use_crf, "use_adapter": cfg.use_adapter, "max_len": res.max_len,
          "max_word_num": feat.k}
    writer.write_bytes("model_config.json", json.dumps(mc, indent=1, sort_keys=True, ensure_ascii=False).encode())
    writer.write_bytes("tags.json", json.dumps(res.tags, ensure_ascii=False).encode())
    writer.write_bytes("vocab.txt", vocab_bytes(sorted(feat.vocab_index, key=feat.vocab_index.__getitem__)))
    buf = io.BytesIO()
    np.save(buf, feat.rank_to_word)
    writer.write_bytes("rank_to_word.npy", buf.getvalue())
    writer.write_bytes("compiled.npz", feat.ct.to_bytes())
    rows = {"epochs.parquet": write_table(writer, "epochs.parquet", pa.Table.from_pylist(res.train.log))}
    writer.write_bytes("curves.png", plot_epochs(res.train.log, f"ner (best dev epoch {res.train.best_epoch})"))
    strs = pa.list_(pa.string())
    test = pa.table({
        "sentence": pa.array(range(len(res.splits.test)), pa.int64()),
        "line": pa.array([s["line"] for s in res.splits.test], pa.int64()),
        "chars": pa.array([s["chars"] for s in res.splits.test], strs),
        "gold": pa.array([s["tags"] for s in res.splits.test], strs),
        "pred": pa.array(res.test_pred, strs),
    })
    rows["test_predictions.parquet"] = write_table(writer, "test_predictions.parquet", test)
    schema = pa.schema([("source", pa.string()), ("line", pa.int64()), ("reason", pa.string()), ("text", pa.string())])
    rows["rejected.parquet"] = write_table(writer, "rejected.parquet", pa.Table.from_pylist(res.splits.rejects, schema=schema))
    return rows


def run_ner_stage(writer, cfg: NerConfig, pretrain_uri: str, lexicon_uri: str, progress: bool = True, on_epoch=None) -> dict[str, Any]:
    """Load the pretrained encoder and the featuriser, train, write every output into ``writer``."""
    from storage.artifacts import open_artifact

    model_cfg, state = load_pretrained(pretrain_uri)
    max_len = min(cfg.max_len, model_cfg.max_len)
    feat = Featurizer.from_artifacts(open_artifact(lexicon_uri), max_len)
    res = train_ner(cfg, feat, model_cfg, state, max_len, progress, on_epoch)
    rows = write_ner_outputs(writer, res, cfg, feat)
    return {"log": res.train.log, "metrics": res.metrics, "stats": res.splits.stats, "rows": rows}


@dataclass
class NerModel:
    """A trained tagger with its featuriser, loaded from a committed ner artifact (checksum-verified)."""

    model: Any  # models.LebertTagger, eval mode
    tags: list[str]
    featurizer: Featurizer
    max_len: int
    with_words: bool
    batch_size: int = 64

    @classmethod
    def load(cls, uri: str, device: str = "cpu") -> "NerModel":
        from safetensors.torch import load as st_load

        from models import LebertTagger, ModelConfig
        from storage.artifacts import open_artifact
        from tasks.prepare.matcher import CompiledTrie
        from tasks.prepare.vocab import parse_vocab

        art = open_artifact(uri)
        mc = json.loads(art.read_verified("model_config.json"))
        tags = json.loads(art.read_verified("tags.json"))
        vocab = parse_vocab(art.read_verified("vocab.txt"))
        ct = CompiledTrie.from_bytes(art.read_verified("compiled.npz"))
        r2w = np.load(io.BytesIO(art.read_verified("rank_to_word.npy")))
        feat = Featurizer({t: i for i, t in enumerate(vocab)}, ct, r2w, int(mc["max_word_num"]), int(mc["max_len"]))
        model = LebertTagger(ModelConfig.model_validate(mc["model"]), len(tags), mc["use_layers"], mc["dropout"], mc["use_crf"])
        model.load_state_dict(st_load(art.read_verified("model.safetensors")))
        model.to(torch.device(device)).eval()
        return cls(model, tags, feat, int(mc["max_len"]), bool(mc["use_adapter"]) and model.uses_lexicon)

    def predict_tags(self, sentences: Sequence[Sequence[str]]) -> list[list[str]]:
        """BIO tags per character of each sentence (a list of characters)."""
        ds = build_chunks(sentences, self.featurizer, self.max_len)
        device = next(self.model.parameters()).device
        return [[self.tags[i] for i in p] for p in predict_chunks(self.model, ds, self.batch_size, device, self.with_words)]

    def predict_entities(self, texts: Sequence[str]) -> list[list[dict[str, Any]]]:
        """Per text: ``[{type, start, end, text}]`` with ``text == texts[i][start:end]`` (end exclusive)."""
        tags = self.predict_tags([list(t) for t in texts])
        return [[{"type": k, "start": a, "end": b, "text": t[a:b]} for k, a, b in spans(tg)] for t, tg in zip(texts, tags)]


class NerScorer:
    """Plugs a ner artifact into the streaming labeller (``tasks.label.label_stream``): same
    sharding, resume, rejects and reconciliation as sentiment labelling; part files hold
    ``row_id, entities (list of {type, start, end, text}), n_entities, model_version``."""

    positive_column = "n_entities"
    SCHEMA = None  # built lazily (pyarrow import)

    def __init__(self, uri: str, device: str = "cpu", batch_size: int = 64):
        from storage.artifacts import open_artifact

        art = open_artifact(uri)
        if art.manifest.stage != "ner":
            raise ValueError(f"{uri} is a {art.manifest.stage!r} artifact, not a ner model")
        self.ref = art.ref
        self.model = NerModel.load(uri, device)
        self.model.batch_size = batch_size

    def score(self, texts: list[str]) -> tuple[list[Any], set[int]]:
        empty = {i for i, t in enumerate(texts) if not t.strip()}
        ents = self.model.predict_entities([t for i, t in enumerate(texts) if i not in empty])
        return ents, empty

    def part_table(self, ids: list[str], outputs: list[Any]):
        import pyarrow as pa

        ent = pa.struct([("type", pa.string()), ("start", pa.int32()), ("end", pa.int32()), ("text", pa.string())])
        schema = pa.schema([("row_id", pa.string()), ("entities", pa.list_(ent)), ("n_entities", pa.int32()), ("model_version", pa.string())])
        return pa.table(
            {"row_id": ids, "entities": outputs, "n_entities": [len(e) for e in outputs], "model_version": [self.ref.version] * len(ids)},
            schema=schema,
        )

    def metrics(self) -> dict[str, Any]:
        return {"model_version": self.ref.version}


# ============================================================================= HMM baseline


def run_hmm_eval(train: Sequence[dict[str, Any]], dev: Sequence[dict[str, Any]], test: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Fit :class:`tasks.ner.hmm.HMM` on train; entity P/R/F1 on dev and test (``None`` for an empty split)."""
    from tasks.ner.hmm import HMM

    hmm = HMM().fit(train)

    def score(ss):
        return entity_prf([s["tags"] for s in ss], hmm.predict_many([s["chars"] for s in ss])) if ss else None

    d, t = score(dev), score(test)
    flat = {f"{name}_{k}": (round(m["overall"][k], 6) if m else None) for name, m in (("dev", d), ("test", t)) for k in ("precision", "recall", "f1")}
    return {**flat, "dev": d, "test": t}


def publish_epochs(log: list[dict[str, Any]], art=None) -> None:
    """Prefect UI: the epoch log as a table artifact (a no-op outside a run)."""
    from prefect.artifacts import create_table_artifact
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return
    keep = ("epoch", "train_loss", "dev_f1", "dev_precision", "dev_recall", "lr", "improved")
    desc = "NER training, one row per epoch (selected on dev F1)" + (f"\n\n`{art.uri}`" if art is not None else "")
    try:
        create_table_artifact(key="ner-epochs", table=[{k: r.get(k) for k in keep} for r in log], description=desc)
    except Exception as e:  # convenience only
        import logging

        logging.getLogger("lexiflow").debug("could not publish ner epochs: %s", e)


# ============================================================================= Prefect wrapper
from prefect import task  # noqa: E402
from prefect.cache_policies import NONE  # noqa: E402


@task(name="ner-train", cache_policy=NONE)
def ner_task(store_uri: str, version: str, cfg: NerConfig, pretrain_uri: str, lexicon_uri: str, progress: bool = True) -> dict[str, Any]:
    """Run the stage into the staging directory that the flow's StageRun already began."""
    from storage.artifacts import ArtifactStore
    from tasks.common.stage import Progress

    store = ArtifactStore(store_uri)
    bar = Progress("ner", cfg.max_epochs)
    return run_ner_stage(store.attach("ner", version), cfg, pretrain_uri, lexicon_uri, progress, lambda row: bar.step())

"""A real, tiny ``bundle`` artifact for label tests: real files, real commit, no mocks.

``make_tiny_bundle(store_uri)`` writes every file ``tasks.inference.bundle.load_bundle`` reads (the names in
``tasks.bundle.bundle.FILES``) through ``begin(ArtifactStore, "bundle", version).commit(...)``: a small
character vocabulary, a lexicon trie over a few words with ``rank_to_word``, seeded word vectors
and a seeded random-init ``LebertClassifier`` (hidden 32, 2 layers, 4 heads, ffn 64).
"""

from __future__ import annotations

import io
import json
import pickle

import numpy as np

from tests.staging import begin

# characters of the test sentences (anything else maps to [UNK])
CHARS = list(
    "这家酒店服务很好房间干净早餐不错位置方便但是隔音太差了前台态度冷淡"
    "下次还会再来价格便宜环境一般我们非常满意失望"
)
# embedding words in "frequency" order: trie rank = index here
EMB_WORDS = [
    "酒店", "服务", "房间", "干净", "早餐", "不错", "位置", "方便", "但是", "隔音", "前台", "态度",
    "冷淡", "下次", "价格", "便宜", "环境", "一般", "我们", "非常", "满意", "失望", "服务很好",
]
# the word vocabulary the model knows ([PAD] = id 0); "服务很好" is matched but unknown -> ignored
WORDS = ["[PAD]", "[UNK]", *EMB_WORDS[:-1]]
SEED = 0
THRESHOLD = 0.8  # the random head puts most probabilities in 0.75..0.87: labels come out mixed


def _state_dict(model) -> dict:
    seen, out = set(), {}
    for k, v in model.state_dict().items():
        if v.data_ptr() in seen and v.numel():
            continue
        seen.add(v.data_ptr())
        out[k] = v.detach().contiguous().cpu()
    return out


BLEND = {"w_encoder": 0.8, "w_baseline": 1.5, "bias": -0.2}  # the stacked variant's weights (``blend=True``)


def make_tiny_bundle(store_uri: str, blend: bool = False, reference: bool = False,
                     classes: list[str] | None = None) -> str:
    """Build (once per store) and commit the tiny bundle; returns its URI. ``blend``: the bundle also ships a
    TF-IDF baseline fitted on its held-out texts and :data:`BLEND`, as a stacking finetune stage writes them.
    ``reference``: it also carries a monitoring ``reference.json`` (:func:`tiny_reference`) built from
    :data:`DEV_ROWS` seeded dev texts whose labels are drawn from a known probability of the model's score.
    ``classes``: a K-class bundle (K > 2: a softmax head, no threshold; the arg-max labels)."""
    import torch

    from models import LebertClassifier, ModelConfig
    from storage.artifacts import ArtifactStore, compute_version
    from tasks.bundle import bundle as bundle_mod
    from tasks.text.featurize import Featurizer
    from tasks.text.matcher import build_trie, compile_trie
    from tasks.text.vocab import SPECIALS

    max_len, k, use_layers, dropout = 48, 3, 2, 0.4
    threshold = None if classes is not None and len(classes) > 2 else THRESHOLD
    config = {"fixture": "tiny-bundle-1", "seed": SEED, "max_len": max_len, "max_word_num": k, "threshold": threshold}
    if blend:
        config["blend"] = BLEND
    if reference:
        config["reference"] = DEV_ROWS
    if classes is not None:
        config["classes"] = list(classes)
    store = ArtifactStore(store_uri)
    version = compute_version("bundle", bundle_mod.CODE_VERSION, config, [])
    if store.is_committed("bundle", version):
        return store.artifact_uri("bundle", version)

    vocab = list(SPECIALS) + sorted(set(CHARS))
    trie = build_trie(EMB_WORDS)
    ct = compile_trie(trie)
    feat = Featurizer.build(vocab, EMB_WORDS, WORDS, ct, k, max_len)
    rng = np.random.default_rng(SEED)
    vectors = rng.normal(size=(len(WORDS), 8)).astype(np.float32)
    vectors[0] = 0.0

    cfg = ModelConfig(
        vocab_size=len(vocab), hidden_size=32, num_layers=2, num_heads=4, ffn_size=64, max_len=max_len,
        word_vocab_size=len(WORDS), word_dim=8, max_word_num=k, adapter_layer=1,
    )
    torch.manual_seed(SEED)
    num_labels = len(classes) if classes is not None and len(classes) > 2 else 1
    model = LebertClassifier(cfg, use_layers=use_layers, dropout=dropout, num_labels=num_labels)
    model.encoder.load_word_vectors(vectors)
    with torch.no_grad():  # a wider head than init_weights gives, so probabilities spread around 0.5
        model.head.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(SEED))
        model.head.bias.zero_()

    w = begin(store, "bundle", version)
    model_config = {"model": cfg.model_dump(), "use_layers": use_layers, "dropout": dropout, "max_len": max_len}
    info = {"max_len": max_len, "max_word_num": k, "threshold": threshold, "metrics": {}, "fixture": config}
    if classes is not None:
        model_config["classes"] = info["classes"] = list(classes)
    extra = {}
    if reference:
        from tasks.inference.reference import REFERENCE_FILE, reference_bytes

        extra[REFERENCE_FILE] = reference_bytes(tiny_reference(model, feat, threshold, classes))
    write_bundle(w, config, model, model_config, info, vocab, WORDS, vectors, feat.rank_to_word, trie, ct, blend,
                 extra)
    return store.artifact_uri("bundle", version)


DEV_ROWS = 400  # the tiny bundle's seeded dev texts, for its reference


def dev_texts(n: int = DEV_ROWS, seed: int = SEED + 1) -> list[str]:
    """``n`` seeded texts of 4..30 characters of :data:`CHARS` (the tiny bundle's dev split)."""
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(CHARS, size=int(rng.integers(4, 31)))) for _ in range(n)]


def true_probability(probs: np.ndarray, threshold: float | None) -> np.ndarray:
    """[N, K]: the fixture's ground truth, a known function of the model's output: two classes
    ``P(y = 1) = sigmoid(40 (prob - threshold))``; K > 2 classes, the softmax of 3 x the model's log-probabilities."""
    p = np.asarray(probs, np.float64)
    if p.ndim == 1:
        q = 1 / (1 + np.exp(-40 * (p - threshold)))
        return np.stack([1 - q, q], 1)
    z = 3 * np.log(np.clip(p, 1e-12, 1))
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def draw_labels(probs: np.ndarray, threshold: float | None, seed: int) -> np.ndarray:
    """Labels drawn from :func:`true_probability` (seeded)."""
    q = true_probability(probs, threshold)
    u = np.random.default_rng(seed).random(len(q))
    return (u[:, None] > np.cumsum(q, 1)).sum(1).astype(np.int64)


def tiny_reference(model, feat, threshold: float | None, classes: list[str] | None) -> dict:
    """The tiny bundle's ``reference.json``: :func:`dev_texts` scored by the model as labelling scores them, with
    labels drawn from :func:`true_probability` (so the calibration has a known answer)."""
    from types import SimpleNamespace

    from tasks.inference.reference import build_reference, name_words
    from tasks.inference.sentiment import score_texts

    texts = dev_texts()
    model.eval()
    probs = score_texts(SimpleNamespace(model=model, featurizer=feat, blend=None), texts)
    ref = build_reference(texts, draw_labels(probs, threshold, SEED + 2), probs, feat, threshold, classes)
    return name_words(ref, WORDS)  # as the bundle stage names them from words.txt


def write_bundle(w, config: dict, model, model_config: dict, info: dict, vocab, words, vectors, rank_to_word, trie, ct,
                 blend: bool = False, extra: dict[str, bytes] | None = None):
    """Write every file of a bundle (``tasks.bundle.bundle.FILES``) into the writer ``w`` and commit it
    with ``config`` (``info`` is ``bundle.json``; its ``threshold`` goes to ``threshold.json`` too); ``extra``:
    more files (name -> bytes), e.g. a finetune stage's ``baseline.parquet`` and ``blend.json``."""
    from safetensors.torch import save as st_save

    from tasks.bundle import bundle as bundle_mod
    from tasks.text.vocab import vocab_bytes

    threshold = info["threshold"]
    w.write_bytes("model.safetensors", st_save(_state_dict(model), metadata={"format": "pt"}))
    w.write_bytes("model_config.json", json.dumps(model_config, indent=1, sort_keys=True).encode())
    w.write_bytes("threshold.json", json.dumps({"threshold": threshold}).encode())
    w.write_bytes("vocab.txt", vocab_bytes(vocab))
    w.write_bytes("words.txt", vocab_bytes(words))
    for rel, arr in (("word_vectors.npy", vectors), ("rank_to_word.npy", rank_to_word)):
        buf = io.BytesIO()
        np.save(buf, arr)
        w.write_bytes(rel, buf.getvalue())
    w.write_bytes("trie.pkl", pickle.dumps(trie, protocol=4))
    w.write_bytes("compiled.npz", ct.to_bytes())
    w.write_bytes("bundle.json", json.dumps(info, indent=1, sort_keys=True, ensure_ascii=False).encode())
    w.write_bytes("README.md", b"# tiny test bundle\n\nA fixture: random weights, no lineage, no model card.\n")
    import pyarrow as pa

    from storage.parquet import write_table

    texts = ["这家酒店服务很好，房间干净", "隔音太差了", "前台态度冷淡，下次不会再来", "价格便宜，环境一般",
             "我们非常满意", "失望", "早餐不错，位置方便", "但是房间隔音太差", "服务一般，价格不便宜",
             "环境干净，下次还会再来"]
    write_table(w, "heldout.parquet", pa.table({"row_id": list(range(len(texts))), "review": texts,
                                                "label": [i % 2 for i in range(len(texts))]}))
    if blend:
        from tasks.common.text import normalize_text
        from tasks.finetune.baseline import fit_baseline
        from tasks.inference.blend import BaselineModel

        sk = fit_baseline([normalize_text(t) for t in texts], [i % 2 for i in range(len(texts))])
        write_table(w, "baseline.parquet", BaselineModel.from_sklearn(sk).to_table())
        w.write_bytes("blend.json", json.dumps(BLEND, indent=1, sort_keys=True).encode())
    for rel, data in (extra or {}).items():
        w.write_bytes(rel, data)
    missing = set(bundle_mod.FILES) - set(w._list_files())
    assert not missing, f"bundle lacks {missing}"
    stats = {"in": 1, "out": 1, "rejected": {}}
    metrics = {"threshold": threshold}
    w.commit(code_version=bundle_mod.CODE_VERSION, config=config, parents=[], stats=stats, metrics=metrics)

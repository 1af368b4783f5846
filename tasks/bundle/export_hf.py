"""export-hf: a pretrain/finetune/bundle artifact's encoder -> a Hugging Face BERT directory (config, weights, vocab).

Layout written into ``out_dir`` (loads offline with ``transformers.BertModel.from_pretrained(out_dir)`` and
``transformers.BertTokenizer.from_pretrained(out_dir)``; transformers itself is not needed to export):

    config.json              BertConfig + a "lexiflow" block (source artifact, what was dropped)
    model.safetensors        pretrain: BertForPreTraining keys ("bert.*", MLM + NSP heads as "cls.*");
                             finetune/bundle: BertModel keys, the classifier's first ``use_layers`` blocks
    lexiflow_head.safetensors  finetune/bundle only: the mean-max pooling head (no HF class for it)
    lexiflow_baseline.parquet, lexiflow_blend.json  only when the classifier is stacked with the TF-IDF baseline:
                             the baseline's arrays and the combination (the HF model gives the encoder's logits)
    vocab.txt, tokenizer_config.json, special_tokens_map.json, README.md

Exact mapping (ours -> HF): token/segment embeddings -> word/token_type_embeddings; the position table we
add (the sinusoidal table already scaled to the embedding RMS, or the learned one) -> position_embeddings;
per block the fused qkv [3H,H] (rows q|k|v, each head-major) -> query/key/value, attn.out + ln1 ->
attention.output, ffn.0 / ffn.2 + ln2 -> intermediate / output (post-LN in both). The lexicon adapter has
no HF equivalent: its word tables, projection and attention are dropped. With ``adapter="no-words"``
(default) its word-free behaviour, h -> LN(h), is kept as one extra HF layer whose attention and FFN are
zero and whose two LayerNorms are (identity, the adapter's): LN_a(LN_id(h) + 0) = LN_a(h) up to a relative
eps/(2 var(h)) (1e-12 at our eps), so hidden states equal ours with word ids absent. ``adapter="drop"``
removes it: the HF model then matches ours only up to the adapter layer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from models import LebertClassifier, LebertForPretraining, ModelConfig
from storage.artifacts import open_artifact
from tasks.text.vocab import parse_vocab, vocab_bytes

logger = logging.getLogger(__name__)

HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
ADAPTER_MODES = ("no-words", "drop")
STAGES = ("pretrain", "finetune", "bundle")
SPECIAL_TOKENS = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                  "mask_token": "[MASK]", "additional_special_tokens": ["#NUM#"]}
FILES = ("config.json", "model.safetensors", "lexiflow_head.safetensors", "vocab.txt", "tokenizer_config.json",
         "special_tokens_map.json", "README.md", "lexiflow_baseline.parquet", "lexiflow_blend.json")
STACK_FILES = {"baseline.parquet": "lexiflow_baseline.parquet", "blend.json": "lexiflow_blend.json"}


@dataclass
class Source:
    """A committed artifact's encoder, ready to map: the module (eval mode) and what the model runs."""

    stage: str
    version: str
    uri: str
    cfg: Any  # models.ModelConfig
    encoder: Any  # models.LebertEncoder with the artifact's weights
    n_blocks: int  # blocks the source model runs (pretrain: all; classifier: use_layers)
    vocab: list[str]
    pretrain: Any = None  # models.LebertForPretraining (heads) for a pretrain artifact
    classifier: Any = None  # models.LebertClassifier for a finetune/bundle artifact
    info: dict[str, Any] = field(default_factory=dict)  # extra source facts for config.json
    stack: dict[str, bytes] = field(default_factory=dict)  # STACK_FILES' export names -> bytes (a stacked classifier)


@dataclass
class ExportResult:
    """What an export wrote and what it could not carry over."""

    out_dir: str
    stage: str
    version: str
    uri: str
    adapter_dropped: bool
    adapter_mode: str | None  # "no-words" / "drop" when an adapter was dropped, else None
    num_hidden_layers: int
    files: list[str]
    warnings: list[str]

    def summary(self) -> dict[str, Any]:
        """The result as the CLI prints it (JSON-ready)."""
        keys = ("out_dir", "stage", "version", "uri", "adapter_dropped", "adapter_mode", "num_hidden_layers")
        return {k: getattr(self, k) for k in keys}


# ============================================================================= reading the artifact


def _find_vocab(art, depth: int = 3) -> list[str]:
    """``vocab.txt`` of the artifact itself or of the nearest ancestor that has one (checksum-verified)."""
    level = [art]
    for _ in range(depth + 1):
        for a in level:
            if "vocab.txt" in a.files():
                return parse_vocab(a.read_verified("vocab.txt"))
        level = [open_artifact(p) for a in level for p in a.manifest.parents]
    raise ValueError(f"{art.uri}: no vocab.txt in the artifact or its ancestors")


def load_source(uri: str) -> Source:
    """Open a committed pretrain/finetune/bundle artifact; weights and config are checksum-verified."""
    art = open_artifact(uri)
    stage = art.manifest.stage
    if stage not in STAGES:
        raise ValueError(f"{uri} is a {stage!r} artifact; export-hf takes one of {', '.join(STAGES)}")
    mc = art.read_json("model_config.json", () if stage == "pretrain" else ("model", "use_layers", "dropout"))
    state = st_load(art.read_verified("model.safetensors"))
    src = dict(stage=stage, version=art.manifest.version, uri=art.uri, vocab=_find_vocab(art))
    if stage == "pretrain":
        cfg = ModelConfig.model_validate(mc)
        model = LebertForPretraining(cfg)
        res = model.load_state_dict(state, strict=False)
        tied = {"mlm_head.decoder.weight"} if cfg.tie_mlm_decoder else set()  # stored once, as the token table
        if set(res.missing_keys) - tied or res.unexpected_keys:
            raise ValueError(f"{uri}: weights do not match model_config.json: missing "
                             f"{sorted(set(res.missing_keys) - tied)}, unexpected {sorted(res.unexpected_keys)}")
        return Source(**src, cfg=cfg, encoder=model.encoder.eval(), n_blocks=cfg.num_layers, pretrain=model.eval())
    cfg = ModelConfig.model_validate(mc["model"])
    classes = mc.get("classes")  # finetune.classes: any; K > 2: a softmax head of K logits
    k = len(classes) if classes is not None and len(classes) > 2 else 1
    clf = LebertClassifier(cfg, use_layers=mc["use_layers"], dropout=mc["dropout"], num_labels=k)
    clf.load_state_dict(state)  # strict, as tasks.inference.bundle.load_bundle
    info = {"use_layers": clf.use_layers, "max_len": mc.get("max_len"), **({"classes": classes} if classes else {})}
    if stage == "bundle":
        info["threshold"] = json.loads(art.read_verified("bundle.json")).get("threshold")
    stack = {}
    if all(f in art.files() for f in STACK_FILES):  # the shipped classifier stacks the TF-IDF baseline
        stack = {STACK_FILES[f]: art.read_verified(f) for f in STACK_FILES}
        info["stacked"] = json.loads(stack["lexiflow_blend.json"])
    return Source(**src, cfg=cfg, encoder=clf.encoder.eval(), n_blocks=clf.use_layers, classifier=clf.eval(),
                  info=info, stack=stack)


# ============================================================================= weights


def _linear(out: dict[str, Tensor], name: str, weight: Tensor, bias: Tensor) -> None:
    out[f"{name}.weight"], out[f"{name}.bias"] = weight, bias


def _layer_norm(out: dict[str, Tensor], name: str, ln) -> None:
    _linear(out, name, ln.weight, ln.bias)


def _block_state(block, p: str) -> dict[str, Tensor]:
    """One post-LN block -> HF ``encoder.layer.i`` keys under prefix ``p``."""
    out: dict[str, Tensor] = {}
    H = block.attn.out.in_features
    w, b = block.attn.qkv.weight, block.attn.qkv.bias  # [3H,H], [3H]: rows q | k | v, each [nh*hd] head-major
    for i, name in enumerate(("query", "key", "value")):
        _linear(out, f"{p}attention.self.{name}", w[i * H : (i + 1) * H], b[i * H : (i + 1) * H])  # [H,H], [H]
    _linear(out, f"{p}attention.output.dense", block.attn.out.weight, block.attn.out.bias)  # [H,H]
    _layer_norm(out, f"{p}attention.output.LayerNorm", block.ln1)
    _linear(out, f"{p}intermediate.dense", block.ffn[0].weight, block.ffn[0].bias)  # [F,H]
    _linear(out, f"{p}output.dense", block.ffn[2].weight, block.ffn[2].bias)  # [H,F]
    _layer_norm(out, f"{p}output.LayerNorm", block.ln2)
    return out


def _word_free_adapter_state(adapter, ffn_size: int, p: str) -> dict[str, Tensor]:
    """An HF layer computing the adapter with no words, h -> LN_a(h): attention and FFN all zero (their
    outputs are exactly 0), attention LayerNorm = identity affine (1, 0), output LayerNorm = the adapter's."""
    H = adapter.ln.weight.shape[0]
    z = torch.zeros
    out: dict[str, Tensor] = {}
    for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
        _linear(out, p + name, z(H, H), z(H))  # [H,H], [H]
    _linear(out, f"{p}attention.output.LayerNorm", torch.ones(H), z(H))
    _linear(out, f"{p}intermediate.dense", z(ffn_size, H), z(ffn_size))  # [F,H]
    _linear(out, f"{p}output.dense", z(H, ffn_size), z(H))  # [H,F]
    _layer_norm(out, f"{p}output.LayerNorm", adapter.ln)
    return out


def hf_state_dict(src: Source, adapter: str = "no-words") -> tuple[dict[str, Tensor], int | None]:
    """(HF state dict, index of the inserted word-free adapter layer or None). Tensors are contiguous
    CPU copies; tied weights (the MLM decoder) are left for HF to tie, as safetensors needs."""
    if adapter not in ADAPTER_MODES:
        raise ValueError(f"adapter must be one of {ADAPTER_MODES}, got {adapter!r}")
    enc, cfg = src.encoder, src.cfg
    p = "bert." if src.pretrain is not None else ""
    emb = enc.embeddings
    pos = emb.position.weight if emb.position is not None else emb.position_table  # [max_len,H], what forward adds
    sd: dict[str, Tensor] = {f"{p}embeddings.word_embeddings.weight": emb.token.weight,  # [V,H]
                             f"{p}embeddings.token_type_embeddings.weight": emb.segment.weight,  # [2,H]
                             f"{p}embeddings.position_embeddings.weight": pos}
    _layer_norm(sd, f"{p}embeddings.LayerNorm", emb.ln)
    j, adapter_index = 0, None
    for i, block in enumerate(enc.blocks[: src.n_blocks], start=1):
        sd.update(_block_state(block, f"{p}encoder.layer.{j}."))
        j += 1
        if enc.adapter is not None and i == cfg.adapter_layer and adapter == "no-words":
            sd.update(_word_free_adapter_state(enc.adapter, cfg.ffn_size, f"{p}encoder.layer.{j}."))
            adapter_index, j = j, j + 1
    if src.pretrain is not None:
        mlm, nsp = src.pretrain.mlm_head, src.pretrain.nsp_head
        _linear(sd, "bert.pooler.dense", nsp.pooler.weight, nsp.pooler.bias)  # [H,H]: tanh on [CLS]
        _linear(sd, "cls.seq_relationship", nsp.classifier.weight, nsp.classifier.bias)  # [2,H]
        _linear(sd, "cls.predictions.transform.dense", mlm.dense.weight, mlm.dense.bias)  # [H,H]
        _layer_norm(sd, "cls.predictions.transform.LayerNorm", mlm.ln)
        sd["cls.predictions.bias"] = mlm.decoder.bias  # [V]
        if not cfg.tie_mlm_decoder:
            sd["cls.predictions.decoder.weight"] = mlm.decoder.weight  # [V,H]
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}, adapter_index


# ============================================================================= config, tokenizer, README


def hf_config(src: Source, num_hidden_layers: int, lexiflow: dict[str, Any]) -> dict[str, Any]:
    """BertConfig fields (our dropouts kept: they are what the model trained with) + the lexiflow block."""
    c = src.cfg
    return {
        "architectures": ["BertForPreTraining" if src.pretrain is not None else "BertModel"],
        "model_type": "bert",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": c.num_heads,
        "intermediate_size": c.ffn_size,
        "hidden_act": HF_ACTIVATIONS[c.activation],
        "hidden_dropout_prob": c.hidden_dropout,
        "attention_probs_dropout_prob": c.attention_dropout,
        "max_position_embeddings": c.max_len,
        "type_vocab_size": c.type_vocab_size,
        "initializer_range": c.initializer_range,
        "layer_norm_eps": c.layer_norm_eps,
        "pad_token_id": src.vocab.index("[PAD]") if "[PAD]" in src.vocab else 0,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": bool(c.tie_mlm_decoder),
        "torch_dtype": "float32",
        "lexiflow": lexiflow,
    }


def tokenizer_files(vocab: list[str], max_len: int) -> dict[str, bytes]:
    """``vocab.txt`` (line i = id i, as ours), ``tokenizer_config.json``, ``special_tokens_map.json``.
    ``#NUM#`` is an additional special token so BertTokenizer keeps it whole in normalised text."""
    tok = {"tokenizer_class": "BertTokenizer", "do_lower_case": False, "tokenize_chinese_chars": True,
           "strip_accents": None, "model_max_length": max_len, **SPECIAL_TOKENS}
    return {"vocab.txt": vocab_bytes(vocab),
            "tokenizer_config.json": json.dumps(tok, indent=1, ensure_ascii=False).encode(),
            "special_tokens_map.json": json.dumps(SPECIAL_TOKENS, indent=1, ensure_ascii=False).encode()}


_README = """# {stage} `{version}` exported by lexiflow

Source: `{uri}`. A character-level BERT for simplified Chinese ({layers} HF layers, hidden {hidden}).

```python
from transformers import BertModel, BertTokenizer
tok = BertTokenizer.from_pretrained("{out}")
model = BertModel.from_pretrained("{out}"{pool}).eval()
enc = tok(["今天天气很好。"], return_tensors="pt", padding=True)
hidden = model(**enc).last_hidden_state  # [B,T,H]
```

## What is exported

- exactly: the embeddings (the position table is the one lexiflow adds: {position}) and the {blocks}
  encoder block(s) the source model runs (post-LN; the fused QKV split into query/key/value).
{heads}
## What is not

{adapter}
## Tokenizer

`vocab.txt` is lexiflow's character vocabulary (line i = id i). BertTokenizer splits every CJK character
and punctuation mark, keeps `#NUM#` whole and maps unknown characters to `[UNK]`, so on **normalised**
simplified Chinese it gives lexiflow's ids. It does not normalise: lexiflow's featuriser first applies
OpenCC t2s (traditional -> simplified), full-width -> half-width digits/letters, markup removal, and replaces
every number by one `#NUM#` (`2019年` -> `#NUM#年`). Apply the same first (`tasks.text.featurize.Featurizer.tokens`,
then write U+E000 back as `#NUM#`). Raw digits and multi-letter Latin words become `[UNK]` in BertTokenizer
(lexiflow: `#NUM#`, one token per letter), and spaces are dropped (lexiflow keeps them as tokens).
"""


def readme(src: Source, out_dir: str, num_layers: int, adapter_mode: str | None, adapter_index: int | None) -> str:
    """The exported folder's README.md: what it holds, how to load it, what differs from lexiflow's own scoring."""
    c = src.cfg
    position = "sinusoidal, scaled to the embedding RMS" if c.position == "sinusoidal" else "learned"
    if src.pretrain is not None:
        heads = ("- the MLM head (`cls.predictions`, decoder tied to the token embeddings) and the NSP head "
                 "(`pooler` + `cls.seq_relationship`): `BertForPreTraining.from_pretrained` loads them.\n")
    elif src.info.get("classes") and src.classifier.num_labels > 1:
        heads = ("- no pooler (the classifier never used one: load with `add_pooling_layer=False`). The class "
                 "head is in `lexiflow_head.safetensors`: logits [K] = `head.weight` @ [mean, max] over real tokens of "
                 "the last hidden state + `head.bias`; probabilities = softmax(logits), label = arg-max; the classes "
                 f"in logit order: {src.info['classes']} (also in config.json `lexiflow.classes`).\n")
    else:
        heads = (f"- no pooler (the classifier never used one: load with `add_pooling_layer=False`). The sentiment "
                 "head is in `lexiflow_head.safetensors`: logit = `head.weight` @ [mean, max] over real tokens of "
                 f"the last hidden state + `head.bias`; probability = sigmoid(logit), threshold "
                 f"{src.info.get('threshold')}.\n")
    if src.stack:
        heads += ("- **the shipped classifier is stacked**: lexiflow labels with the head's logits combined with a "
                  "TF-IDF character 1-2-gram baseline's (`lexiflow_baseline.parquet`: n-gram, idf, coefficients) as "
                  "`lexiflow_blend.json` says (`w_encoder`/`w_baseline`/`bias`, or for K classes `weights` [K][2K] "
                  "over [encoder logits, baseline logits] and `bias` [K]); the Hugging Face model alone gives the "
                  "encoder's logits, not lexiflow's probabilities (`tasks.finetune.baseline` scores the baseline).\n")
    if adapter_mode is None:
        adapter = ("Nothing the source model runs is left out" + (" (the lexicon adapter after block "
                   f"{c.adapter_layer} is never reached by the first {src.n_blocks} blocks).\n"
                   if c.use_adapter else ".\n"))
    elif adapter_mode == "no-words":
        adapter = (f"**The lexicon adapter is dropped** (word table, projection, char-word attention). Its word-free "
                   f"form h -> LayerNorm(h) is HF layer {adapter_index} (0-based; zero attention and FFN), so the "
                   "hidden states equal lexiflow's **with word ids absent**. With lexicon words they differ from "
                   f"layer {adapter_index} on.\n")
    else:
        adapter = (f"**The lexicon adapter is dropped** entirely (after block {c.adapter_layer}): hidden states "
                   f"match lexiflow's up to HF layer {c.adapter_layer - 1} (0-based) only.\n")
    pool = "" if src.pretrain is not None else ", add_pooling_layer=False"
    return _README.format(stage=src.stage, version=src.version, uri=src.uri, layers=num_layers, hidden=c.hidden_size,
                          out=out_dir, pool=pool, position=position, blocks=src.n_blocks, heads=heads, adapter=adapter)


# ============================================================================= export


def export_hf(uri: str, out_dir: str | Path, adapter: str = "no-words",
              warn: Callable[[str], None] = logger.warning) -> ExportResult:
    """Write the HF BERT directory for artifact ``uri``; refuses a directory holding other files."""
    out = Path(out_dir)
    ours = set(FILES) | {f".{f}.tmp" for f in FILES}
    if out.exists() and (stray := sorted(p.name for p in out.iterdir() if p.name not in ours)):
        raise FileExistsError(f"{out} holds files export-hf did not write: {stray[:5]}")
    src = load_source(uri)
    if len(src.vocab) != src.cfg.vocab_size:
        raise ValueError(f"vocab.txt has {len(src.vocab)} tokens but the model {src.cfg.vocab_size}")
    with torch.no_grad():
        sd, adapter_index = hf_state_dict(src, adapter)
    dropped = src.cfg.use_adapter and src.cfg.adapter_layer <= src.n_blocks
    mode = adapter if dropped else None
    num_layers = src.n_blocks + (adapter_index is not None)
    warnings = []
    if dropped:
        warnings.append(
            f"{src.stage} {src.version}: the lexicon adapter (after block {src.cfg.adapter_layer}) has no Hugging Face "
            "equivalent and is dropped; "
            + (f"its word-free LayerNorm is HF layer {adapter_index}: hidden states match lexiflow's with word ids "
               "absent" if adapter == "no-words" else
               f"hidden states match lexiflow's up to layer {src.cfg.adapter_layer} only"))
    lexiflow = {"source": {"stage": src.stage, "version": src.version, "uri": src.uri},
                "position": src.cfg.position, "blocks_exported": src.n_blocks, "use_adapter": src.cfg.use_adapter,
                "adapter_dropped": dropped, "adapter_layer": src.cfg.adapter_layer if src.cfg.use_adapter else None,
                "adapter_mode": mode, "adapter_hf_layer": adapter_index,
                "matches_lexiflow": ("with word ids absent" if mode == "no-words" else
                                     f"up to layer {src.cfg.adapter_layer}" if mode == "drop" else "exactly"),
                "normalisation": "OpenCC t2s, full-width -> half-width, numbers -> #NUM# (not done by BertTokenizer)",
                **src.info}
    files = {"config.json": json.dumps(hf_config(src, num_layers, lexiflow), indent=1, ensure_ascii=False).encode(),
             "model.safetensors": st_save(sd, metadata={"format": "pt"}),
             **tokenizer_files(src.vocab, src.cfg.max_len),
             "README.md": readme(src, str(out), num_layers, mode, adapter_index).encode()}
    if src.classifier is not None:
        head = src.classifier.head  # Linear(2H, 1 or K): [mean, max] pooled -> logit(s)
        hd = {"head.weight": head.weight.detach().clone(), "head.bias": head.bias.detach().clone()}  # [K,2H], [K]
        files["lexiflow_head.safetensors"] = st_save(hd, metadata={"format": "pt"})
        files.update(src.stack)
        if src.stack:
            warnings.append(f"{src.stage} {src.version}: the shipped classifier stacks the encoder with the TF-IDF "
                            "baseline; the Hugging Face model gives the encoder's logits (the baseline and the "
                            "combination are written beside it: lexiflow_baseline.parquet, lexiflow_blend.json)")
    out.mkdir(parents=True, exist_ok=True)
    for name in set(FILES) - set(files):  # e.g. a head left by an earlier export of another stage
        (out / name).unlink(missing_ok=True)
    for name, data in files.items():
        tmp = out / f".{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(out / name)
    for w in warnings:
        warn(w)
    return ExportResult(str(out), src.stage, src.version, src.uri, dropped, mode, num_layers, sorted(files), warnings)

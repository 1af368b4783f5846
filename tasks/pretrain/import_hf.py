"""pretrain.init_from: a Hugging Face BERT directory -> the pretraining model's weights (the reverse of export-hf).

A directory as users have it on disk (any fsspec URL; nothing is downloaded):

    config.json                        BertConfig (hidden_size, num_hidden_layers, num_attention_heads, ...)
    model.safetensors | pytorch_model.bin   BertModel / BertForMaskedLM / BertForPreTraining weights; a .bin file is
                                       read with ``torch.load(weights_only=True)`` (tensors only, no code runs)
    vocab.txt                          line i = token id i (read by the vocab stage: tasks.prepare.vocab)

Exact mapping (HF -> ours), :func:`tasks.bundle.export_hf.hf_state_dict` read backwards: word/token_type/position
embeddings -> token/segment/position (learned positions: ``pretrain.model.position: learned``), embeddings
LayerNorm -> embeddings.ln; per layer query/key/value stacked row-wise into the fused qkv [3H,H] (q | k | v, each
head-major, as HF splits heads), attention.output.dense + LayerNorm -> attn.out + ln1, intermediate / output dense
+ LayerNorm -> ffn.0 / ffn.2 + ln2 (post-LN in both). Heads when present: ``cls.predictions`` -> the MLM head (the
decoder tied to the token table unless config.json unties it), ``bert.pooler`` + ``cls.seq_relationship`` -> the
NSP head. Old TF-converted files name LayerNorm parameters gamma/beta; they read as weight/bias. The lexicon
adapter has no HF counterpart: it is initialised as from scratch (word vectors from the lexicon artifact).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch
from safetensors.torch import load as st_load
from torch import Tensor

from storage.fingerprints import FingerprintCache
from tasks.common.stage import input_source

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # the first present is read
CONFIG, VOCAB = "config.json", "vocab.txt"
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
IGNORED = ("embeddings.position_ids",)  # a buffer some checkpoints carry: arange(max_len)


@dataclass
class Checkpoint:
    """A read checkpoint: its config.json, its weights under normalised keys (``bert.`` dropped, gamma/beta ->
    weight/bias) and which of its files were read."""

    uri: str
    config: dict[str, Any]
    weights_file: str
    state: dict[str, Tensor] = field(repr=False)

    @property
    def has_mlm(self) -> bool:
        """Whether the checkpoint holds the MLM head's weights."""
        return "cls.predictions.transform.dense.weight" in self.state

    @property
    def has_nsp(self) -> bool:
        """Whether the checkpoint holds the NSP head and the pooler."""
        return "cls.seq_relationship.weight" in self.state and "pooler.dense.weight" in self.state

    @property
    def files(self) -> list[str]:
        """The checkpoint's files an import reads, by name."""
        return [CONFIG, self.weights_file, VOCAB]


def _join(uri: str, name: str) -> str:
    return uri.rstrip("/") + "/" + name


def checkpoint_files(uri: str) -> list[str]:
    """The URIs of the files an import reads (config.json, the weights, vocab.txt); one clear error when the
    directory lacks one."""
    fs, root = fsspec.core.url_to_fs(uri)
    if not fs.isdir(root):
        raise FileNotFoundError(f"pretrain.init_from {uri}: no such directory (a Hugging Face BERT directory: "
                                "config.json, model.safetensors or pytorch_model.bin, vocab.txt)")
    names = set(fs.ls(root, detail=False))
    have = {n.rstrip("/").rsplit("/", 1)[-1] for n in names}
    for name in (CONFIG, VOCAB):
        if name not in have:
            raise FileNotFoundError(f"pretrain.init_from {uri}: no {name} in the checkpoint directory")
    weights = next((w for w in WEIGHT_FILES if w in have), None)
    if weights is None:
        sharded = sorted(n for n in have if n.endswith(".index.json"))
        raise FileNotFoundError(f"pretrain.init_from {uri}: no model.safetensors or pytorch_model.bin"
                                + (f" (sharded weights {sharded} are not read: save them as one file)" if sharded
                                   else ""))
    return [_join(uri, n) for n in (CONFIG, weights, VOCAB)]


def checkpoint_sources(uri: str, cache: FingerprintCache | None = None) -> list[dict[str, Any]]:
    """The files of :func:`checkpoint_files` as stage inputs (URI, name, sha256): the pretrain version counts their
    bytes, the manifest keeps where they were."""
    return [input_source(u, cache=cache) for u in checkpoint_files(uri)]


def _read(uri: str) -> bytes:
    """The bytes at ``uri``."""
    with fsspec.open(uri, "rb") as f:
        return f.read()


def read_config(uri: str) -> dict[str, Any]:
    """config.json of checkpoint ``uri``."""
    try:
        return json.loads(_read(checkpoint_files(uri)[0]))
    except json.JSONDecodeError as e:
        raise ValueError(f"pretrain.init_from {uri}: config.json is not JSON ({e})") from None


def _normalise(state: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for k, v in state.items():
        if k.startswith("bert."):
            k = k[len("bert."):]
        if k.endswith(".gamma"):
            k = k[: -len(".gamma")] + ".weight"
        elif k.endswith(".beta"):
            k = k[: -len(".beta")] + ".bias"
        if k not in IGNORED:
            out[k] = v
    return out


def read_checkpoint(uri: str) -> Checkpoint:
    """Read config.json and the weights (safetensors, else a torch file loaded with ``weights_only=True``)."""
    cfg_uri, weights_uri, _ = checkpoint_files(uri)
    name = weights_uri.rsplit("/", 1)[-1]
    data = _read(weights_uri)
    try:
        if name.endswith(".safetensors"):
            state = st_load(data)
        else:
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: one line naming it
        raise ValueError(f"pretrain.init_from {uri}: {name} is not readable as weights ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"pretrain.init_from {uri}: {name} does not hold a flat dict of tensors")
    return Checkpoint(uri, read_config(uri), name, _normalise(state))


# ============================================================================= config


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The :class:`models.ModelShape` fields config.json fixes (what ``pretrain.model`` must say)."""
    act = hf.get("hidden_act", "gelu")
    if act not in HF_ACTIVATIONS:
        raise ValueError(f"config.json hidden_act {act!r} is not one lexiflow runs ({sorted(HF_ACTIVATIONS)})")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"config.json position_embedding_type {hf['position_embedding_type']!r}: only absolute "
                         "(learned) positions are imported")
    return {"hidden_size": hf["hidden_size"], "num_layers": hf["num_hidden_layers"],
            "num_heads": hf["num_attention_heads"], "ffn_size": hf["intermediate_size"],
            "max_len": hf["max_position_embeddings"], "activation": HF_ACTIVATIONS[act], "position": "learned"}


_CONFIG_KEYS = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                "ffn_size": "intermediate_size", "max_len": "max_position_embeddings", "activation": "hidden_act",
                "position": "position_embedding_type"}


def check_shape(uri: str, hf: dict[str, Any], shape) -> None:
    """One error naming every ``pretrain.model`` field that contradicts the checkpoint's config.json."""
    want = model_fields(hf)
    bad = {k: v for k, v in want.items() if getattr(shape, k) != v}
    if bad:
        said = ", ".join(f"{k} {getattr(shape, k)}" for k in bad)
        fix = ", ".join(f"{k}: {v}" for k, v in bad.items())
        raise ValueError(f"pretrain.init_from {uri}: pretrain.model contradicts the checkpoint's config.json "
                         f"({said}; the checkpoint has {fix}): set pretrain.model {{{fix}}}")


def check_config(cfg) -> None:
    """Before any work: ``cfg`` (a PretrainConfig with init_from) agrees with the checkpoint's config.json and the
    files are there (their weights are read when training starts)."""
    if cfg.init_from is None:
        return
    hf = read_config(cfg.init_from)
    check_shape(cfg.init_from, hf, cfg.model)
    if cfg.nsp == "on":
        ckpt_keys = _weight_keys(cfg.init_from)
        if ckpt_keys is not None and not {"cls.seq_relationship.weight", "pooler.dense.weight"} <= ckpt_keys:
            raise ValueError(f"pretrain.nsp on: the checkpoint {cfg.init_from} has no NSP head "
                             "(pooler + cls.seq_relationship); use nsp: auto or off")


def _weight_keys(uri: str) -> set[str] | None:
    """The normalised keys of a safetensors file, read from its header alone (None for a torch file)."""
    weights = checkpoint_files(uri)[1]
    if not weights.endswith(".safetensors"):
        return None
    with fsspec.open(weights, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return set(_normalise({k: torch.empty(0) for k in header if k != "__metadata__"}))


def model_overrides(ckpt: Checkpoint, shape, vocab_size: int) -> dict[str, Any]:
    """The :class:`models.ModelConfig` fields the checkpoint sets beyond the shape (checked against it first)."""
    hf = ckpt.config
    check_shape(ckpt.uri, hf, shape)
    if hf.get("vocab_size", vocab_size) != vocab_size:
        raise ValueError(f"pretrain.init_from {ckpt.uri}: config.json has vocab_size {hf['vocab_size']} but the "
                         f"vocab artifact {vocab_size} tokens (is prepare.vocab.checkpoint the same directory?)")
    return {"type_vocab_size": hf.get("type_vocab_size", 2), "layer_norm_eps": hf.get("layer_norm_eps", 1e-12),
            "initializer_range": hf.get("initializer_range", 0.02),
            "tie_mlm_decoder": bool(hf.get("tie_word_embeddings", True))}


def nsp_on(cfg, ckpt: Checkpoint | None) -> bool:
    """Whether pretraining adds the NSP loss: ``pretrain.nsp``, where auto means on from scratch and, with a
    checkpoint, on only when it has its NSP head."""
    if cfg.nsp != "auto":
        return cfg.nsp == "on"
    return ckpt is None or ckpt.has_nsp


# ============================================================================= weights


def ours_from_hf(ckpt: Checkpoint, num_layers: int) -> dict[str, Tensor]:
    """The checkpoint's tensors under :class:`models.LebertForPretraining` names (the heads when present)."""
    s = ckpt.state
    missing = [k for k in ("embeddings.word_embeddings.weight", "embeddings.token_type_embeddings.weight",
                           "embeddings.position_embeddings.weight") if k not in s]
    if missing:
        raise ValueError(f"pretrain.init_from {ckpt.uri}: {ckpt.weights_file} has no {missing[0]}: not BERT weights")
    out = {"encoder.embeddings.token.weight": s["embeddings.word_embeddings.weight"],  # [V,H]
           "encoder.embeddings.segment.weight": s["embeddings.token_type_embeddings.weight"],  # [2,H]
           "encoder.embeddings.position.weight": s["embeddings.position_embeddings.weight"]}  # [max_len,H]

    def take(ours: str, hf: str, required: bool = True) -> None:
        for p in ("weight", "bias"):
            if f"{hf}.{p}" in s:
                out[f"{ours}.{p}"] = s[f"{hf}.{p}"]
            elif required:
                raise ValueError(f"pretrain.init_from {ckpt.uri}: {ckpt.weights_file} has no {hf}.{p} "
                                 f"(config.json says {num_layers} layers)")

    take("encoder.embeddings.ln", "embeddings.LayerNorm")
    for i in range(num_layers):
        p, o = f"encoder.layer.{i}.", f"encoder.blocks.{i}."
        for part in ("weight", "bias"):  # q | k | v rows, each [nh*hd] head-major: the fused layout
            names = [f"{p}attention.self.{n}.{part}" for n in ("query", "key", "value")]
            if not all(n in s for n in names):
                raise ValueError(f"pretrain.init_from {ckpt.uri}: {ckpt.weights_file} has no {names[0]} "
                                 f"(config.json says {num_layers} layers)")
            if len({tuple(s[n].shape) for n in names}) != 1:
                raise ValueError(f"pretrain.init_from {ckpt.uri}: {ckpt.weights_file}: query/key/value of layer {i} "
                                 "differ in shape")
            out[f"{o}attn.qkv.{part}"] = torch.cat([s[n] for n in names], 0)  # [3H,H] / [3H]
        take(f"{o}attn.out", f"{p}attention.output.dense")
        take(f"{o}ln1", f"{p}attention.output.LayerNorm")
        take(f"{o}ffn.0", f"{p}intermediate.dense")
        take(f"{o}ffn.2", f"{p}output.dense")
        take(f"{o}ln2", f"{p}output.LayerNorm")
    if f"encoder.layer.{num_layers}.attention.self.query.weight" in s:
        raise ValueError(f"pretrain.init_from {ckpt.uri}: {ckpt.weights_file} has more layers than config.json's "
                         f"num_hidden_layers {num_layers}")
    if ckpt.has_mlm:
        take("mlm_head.dense", "cls.predictions.transform.dense")
        take("mlm_head.ln", "cls.predictions.transform.LayerNorm")
        bias = s.get("cls.predictions.bias", s.get("cls.predictions.decoder.bias"))
        if bias is not None:
            out["mlm_head.decoder.bias"] = bias  # [V]
        if "cls.predictions.decoder.weight" in s and not ckpt.config.get("tie_word_embeddings", True):
            out["mlm_head.decoder.weight"] = s["cls.predictions.decoder.weight"]  # [V,H], untied
    if ckpt.has_nsp:
        take("nsp_head.pooler", "pooler.dense")
        take("nsp_head.classifier", "cls.seq_relationship")
    return out


def load_weights(model, ckpt: Checkpoint) -> dict[str, Any]:
    """Copy the checkpoint into ``model`` (a LebertForPretraining built with :func:`model_overrides`); every
    tensor's shape is checked against the model config.json describes first. Returns what was imported."""
    cfg = model.cfg
    theirs = ours_from_hf(ckpt, cfg.num_layers)
    target = model.state_dict()
    for k, v in theirs.items():
        if tuple(v.shape) != tuple(target[k].shape):
            raise ValueError(f"pretrain.init_from {ckpt.uri}: {ckpt.weights_file} disagrees with its config.json: "
                             f"{_hf_name(k)} has shape {list(v.shape)}, config.json implies {list(target[k].shape)}")
    with torch.no_grad():
        for k, v in theirs.items():
            target[k].copy_(v.to(target[k].dtype))
    return {"uri": ckpt.uri, "weights_file": ckpt.weights_file, "tensors": len(theirs),
            "mlm_head": ckpt.has_mlm, "nsp_head": ckpt.has_nsp}


def _hf_name(ours: str) -> str:
    """A readable checkpoint-side name for an error message."""
    for a, b in (("encoder.embeddings.token", "embeddings.word_embeddings"),
                 ("encoder.embeddings.segment", "embeddings.token_type_embeddings"),
                 ("encoder.embeddings.position", "embeddings.position_embeddings"),
                 ("encoder.embeddings.ln", "embeddings.LayerNorm"), ("encoder.blocks.", "encoder.layer."),
                 ("attn.qkv", "attention.self.query/key/value"), ("attn.out", "attention.output.dense"),
                 ("ln1", "attention.output.LayerNorm"), ("ffn.0", "intermediate.dense"), ("ffn.2", "output.dense"),
                 ("ln2", "output.LayerNorm"), ("mlm_head", "cls.predictions"), ("nsp_head.pooler", "pooler.dense"),
                 ("nsp_head.classifier", "cls.seq_relationship")):
        ours = ours.replace(a, b)
    return ours


def identity(sources: list[dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint's identity for the manifest: each file's name, size and sha256 (an object store's digest
    where it gives one instead)."""
    return {s["name"]: {k: v for k, v in s.items() if k not in ("uri", "name")} for s in sources}

"""Small random BERT checkpoints written as users have them on disk (config.json, weights, vocab.txt), built with
``transformers`` offline: BertForPreTraining (MLM + NSP heads), BertForMaskedLM (no NSP head) or BertModel."""

from __future__ import annotations

from pathlib import Path

import torch

RESERVED = ["[PAD]", "[unused1]", "[unused2]", "[unused3]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # bert-base-chinese
SHAPE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
         "max_position_embeddings": 64}
# what pretrain.model must say for SHAPE
MODEL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "ffn_size": 64, "max_len": 64, "position": "learned",
         "activation": "gelu"}


def corpus_chars(paths, n: int) -> list[str]:
    """The ``n`` commonest characters of some text files (a checkpoint vocabulary that covers most of them)."""
    from collections import Counter

    counts: Counter = Counter()
    for p in paths:
        counts.update(Path(p).read_text(encoding="utf-8"))
    return [c for c, _ in counts.most_common() if c.strip() and c not in "{}\"'\\:,"][:n]


def hf_model(tokens: list[str], head: str = "pretraining", seed: int = 0, **shape):
    """A random ``transformers`` BERT over ``tokens``; every parameter drawn (biases and LayerNorms too), so a
    wrong mapping cannot hide behind zeros and ones."""
    from transformers import BertConfig, BertForMaskedLM, BertForPreTraining, BertModel

    cfg = BertConfig(vocab_size=len(tokens), **{**SHAPE, **shape}, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    model = {"pretraining": BertForPreTraining, "mlm": BertForMaskedLM, "none": BertModel}[head](cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm.weight" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def write_checkpoint(out: Path, tokens: list[str], fmt: str = "safetensors", head: str = "pretraining",
                     legacy_names: bool = False, seed: int = 0, **shape):
    """Write the directory and return the model. ``fmt`` safetensors (tied decoder left out, as HF saves it) or
    bin (``torch.save`` of the whole state dict); ``legacy_names``: LayerNorm gamma/beta, as TF-converted files."""
    from safetensors.torch import save_file

    model = hf_model(tokens, head, seed, **shape)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(model.config.to_json_string(), encoding="utf-8")
    (out / "vocab.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if legacy_names:
        state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
                 for k, v in state.items()}
    if fmt == "safetensors":
        state = {k: v for k, v in state.items() if not k.startswith("cls.predictions.decoder.")}  # tied
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(state, out / "pytorch_model.bin")
    return model

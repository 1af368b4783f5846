"""What fine-tuning and NER share around the loop: the pretrained encoder and featuriser in, weights out."""

from __future__ import annotations

import json
from typing import Any

from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from models import ModelConfig
from storage.artifacts import open_artifact
from storage.fingerprints import FingerprintCache
from tasks.common.stage import input_names, input_source
from tasks.inference.runtime import numerics_config
from tasks.text.featurize import Featurizer


def load_pretrained(pretrain_uri: str):
    """(ModelConfig, state dict) from a committed pretrain artifact, checksum-verified."""
    art = open_artifact(pretrain_uri)
    model_cfg = ModelConfig.model_validate(json.loads(art.read_verified("model_config.json")))
    return model_cfg, st_load(art.read_verified("model.safetensors"))


def pretrained_inputs(pretrain_uri: str, lexicon_uri: str, max_len: int) -> tuple[Any, dict, Any, int]:
    """(ModelConfig, encoder state dict, Featurizer, max_len capped at the model's) for a downstream task."""
    model_cfg, state = load_pretrained(pretrain_uri)
    max_len = min(max_len, model_cfg.max_len)
    return model_cfg, state, Featurizer.from_artifacts(open_artifact(lexicon_uri), max_len), max_len


def save_weights(writer, model) -> None:
    """``model.safetensors``: the model's state dict, contiguous CPU tensors."""
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    writer.write_bytes("model.safetensors", st_save(sd, metadata={"format": "pt"}))


def on_pretrained_config(stage_cfg: Any, cache: FingerprintCache | None = None) -> dict[str, Any]:
    """What enters the version of a stage trained on the pretrained encoder (finetune, ner) besides its two parents:
    its section, ``inputs`` (each data file by role: ``data_uri``, ``train_uri`` ..., with its URI, name and
    fingerprint) and the numerics. The version counts the names and bytes in place of the URIs
    (``storage.artifacts.without_locations``): the same files in another directory give the same version."""
    uris = stage_cfg.input_uris()
    names = dict(zip(uris, input_names(list(uris.values()))))
    inputs = {k: input_source(u, names[k], cache) for k, u in uris.items()}
    return {**stage_cfg.model_dump(mode="json"), "inputs": inputs,
            "numerics": numerics_config(stage_cfg.threads, stage_cfg.device)}

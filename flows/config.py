"""The whole-pipeline configuration, assembled from every stage's section, and how a profile is loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, model_validator

from tasks.bundle.config import PromoteConfig
from tasks.common.config import load_raw
from tasks.finetune.config import FinetuneConfig
from tasks.label.config import LabelConfig, MonitorConfig
from tasks.ner.config import NerConfig
from tasks.prepare.config import PrepareConfig
from tasks.pretrain.config import FINETUNE_TRAIN, ExtraTexts, PretrainConfig


class PipelineConfig(PrepareConfig):
    """Everything a pipeline run needs: prepare's keys plus one section per later stage."""

    pretrain: PretrainConfig = PretrainConfig()
    finetune: FinetuneConfig | None = Field(None, description="required by the pipeline flow")
    ner: NerConfig | None = Field(None, description="required by the ner flow")
    label: LabelConfig = LabelConfig()
    monitor: MonitorConfig = MonitorConfig()
    promote: PromoteConfig = PromoteConfig()

    def prepare(self) -> PrepareConfig:
        """The prepare flow's part of this config, every field as set here (``storage_options`` included, which
        dumps leave out)."""
        return PrepareConfig.model_validate({name: getattr(self, name) for name in PrepareConfig.model_fields})

    @model_validator(mode="after")
    def _checkpoint_vocab(self) -> "PipelineConfig":
        """pretrain.init_from's vocab.txt is the vocabulary: the vocab stage reads it from the same directory."""
        init, ckpt = self.pretrain.init_from, self.vocab.checkpoint
        if init is not None and ckpt is not None and init != ckpt:
            raise ValueError(f"vocab.checkpoint {ckpt} and pretrain.init_from {init} name different checkpoints")
        if init is not None:
            self.vocab.checkpoint = init
        return self

    @model_validator(mode="after")
    def _no_eval_text_in_pretraining(self) -> "PipelineConfig":
        """pretrain.extra_texts must never carry fine-tuning dev/test texts: the same file needs the same split."""
        ft = self.finetune
        for i, ex in enumerate(self.pretrain.extra_texts):
            if ex.data_uri == FINETUNE_TRAIN:  # the fine-tuning rows' train split, whatever file and split they use
                if ft is None:
                    raise ValueError(f"pretrain.extra_texts: {FINETUNE_TRAIN} needs a finetune section")
                self.pretrain.extra_texts[i] = ExtraTexts(
                    data_uri=ft.data_uri, train_uri=None if ft.data_uri else ft.train_uri, format=ft.format,
                    text_column=ft.text_column, label_column=ft.label_column, split=ft.split,
                    split_seed=ft.split_seed, repeat=ex.repeat, classes=ft.classes)
        for ex in self.pretrain.extra_texts if ft else ():
            held = {u for u in (ft.dev_uri, ft.test_uri) if u}
            if (uri := ex.data_uri or ex.train_uri) in held:
                raise ValueError(f"pretrain.extra_texts names {uri}, a fine-tuning dev/test file")
            if ex.data_uri and ex.data_uri == ft.data_uri and (tuple(ex.split), ex.split_seed, ex.classes) != (
                    tuple(ft.split), ft.split_seed, ft.classes):
                raise ValueError("pretrain.extra_texts splits finetune.data_uri differently (split/split_seed/"
                                 "classes): its train texts would include fine-tuning dev/test texts")
        return self


def load_config(model: type[BaseModel], path: str | Path | None, overrides: list[str] | None = None) -> Any:
    """Read a YAML profile, apply overrides, validate against ``model``.

    A profile may hold sections for stages the chosen flow does not run (they are ignored);
    a key that no flow knows is an error, so typos never pass silently."""
    data = load_raw(path, overrides)
    unknown = sorted(set(data) - set(PipelineConfig.model_fields))
    if unknown:
        raise ValueError(f"unknown top-level key(s) {unknown}; known: {sorted(PipelineConfig.model_fields)}")
    known = {k: v for k, v in data.items() if k in model.model_fields}
    return model.model_validate(known)

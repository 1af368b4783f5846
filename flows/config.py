"""The whole-pipeline configuration, assembled from every stage's section, and how a profile is loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import fsspec
import yaml
from pydantic import BaseModel, Field, model_validator

from tasks.bundle.config import PromoteConfig
from tasks.common.config import RunnerConfig, SectionConfig, apply_overrides, deprecated, warn_moved
from tasks.finetune.config import FinetuneConfig
from tasks.label.config import LabelConfig, MonitorConfig
from tasks.ner.config import NerConfig
from tasks.prepare.config import PrepareConfig
from tasks.pretrain.config import FINETUNE_TRAIN, ExtraTexts, PretrainConfig

# prepare's keys, at the top level before the config held one section per stage: still accepted there (and in
# `--set`), each moved into the `prepare:` section with one deprecation line
MOVED_TO_PREPARE = ("corpus_uri", "embeddings_uri", "clean", "numbers", "vocab", "embeddings", "trie", "lexicon")
M = TypeVar("M", bound=BaseModel)


def moved_path(path: list[str]) -> list[str]:
    """A key path in the current layout: a path under one of :data:`MOVED_TO_PREPARE` gets ``prepare.`` in front
    (one deprecation line, old -> new); any other path is returned as it is."""
    if len(path) > 0 and path[0] in MOVED_TO_PREPARE:
        new = ["prepare", *path]
        warn_moved(".".join(path), ".".join(new))
        return new
    return path


def _merge(into: dict[str, Any], key: str, value: Any) -> None:
    """``into[key] = value``, merged key by key where both are mappings (``value``'s keys win)."""
    old = into.get(key)
    if isinstance(old, dict) and isinstance(value, dict):
        into[key] = dict(old)
        for k, v in value.items():
            _merge(into[key], k, v)
    else:
        into[key] = value


def moved_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A config mapping in the current layout: a top-level key of :data:`MOVED_TO_PREPARE` is moved into the
    ``prepare`` section (one deprecation line each; where both spell a key, the top-level one wins)."""
    old = [k for k in data if k in MOVED_TO_PREPARE]
    if not old:
        return data
    out = {k: v for k, v in data.items() if k not in MOVED_TO_PREPARE}
    prepare = out.get("prepare")
    if prepare is not None and not isinstance(prepare, dict):
        return data  # not a mapping: the model's own error names it
    prepare = dict(prepare or {})
    for k in old:
        warn_moved(k, f"prepare.{k}")
        _merge(prepare, k, data[k])
    out["prepare"] = prepare
    return out


class RunConfig(SectionConfig):
    """What every flow's config holds at its top level: the store, how tasks run, run-wide switches (progress bars)
    and storage options; the stages' sections come beside them (:class:`PrepareFlowConfig`,
    :class:`PipelineConfig`)."""

    store_uri: str = Field(".lexiflow/store", description="root of the artifact store (local path or any fsspec "
                           "URL): every stage's {stage}/{version}/, checkpoints, aliases, input fingerprints")
    seed: int = Field(42, description="deprecated, read by no stage: the seeds that take effect are the stages' own "
                      "(prepare.lexicon.seed, pretrain.seed, pretrain.data.seed, finetune.seed, ner.seed)")
    progress: bool = Field(True, description="tqdm progress bars of every stage that shows them, shown only when "
                           "stderr is a terminal (LEXIFLOW_PROGRESS=0/1 overrides that); the Prefect UI's progress is "
                           "unaffected")
    runner: RunnerConfig = RunnerConfig()
    # fsspec options per protocol, e.g. {"s3": {"endpoint_url": ..., "key": ..., "secret": ...}}, installed as
    # fsspec defaults at flow start (storage.options.configure). Credentials: excluded from every dump and repr,
    # so never in a version, a manifest or a Prefect parameter (deployments: use FSSPEC_* variables).
    storage_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, exclude=True, repr=False, description="fsspec options per protocol (s3, gs, ...)"
    )

    _seed_deprecated = deprecated("seed", "seed", "no stage reads it; the stages' own seeds take effect "
                                  "(prepare.lexicon.seed, pretrain.seed, pretrain.data.seed, finetune.seed, ner.seed)")

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        """Prepare's keys at the top level (the layout before sections) move into ``prepare:``; a model with a
        ``prepare`` section given none gets an empty one, so a missing input names its key (prepare.corpus_uri)."""
        if not isinstance(data, dict):
            return data
        data = moved_keys(data)
        return {"prepare": {}, **data} if "prepare" in cls.model_fields and "prepare" not in data else data

    def narrowed(self, model: type[M]) -> M:
        """This config as ``model``, a flow's config with fewer sections (the prepare flow's inside the pipeline's):
        the same sections, every field as set here (``storage_options`` included, which dumps leave out)."""
        return model.model_validate({name: getattr(self, name) for name in model.model_fields})


class PrepareFlowConfig(RunConfig):
    """The ``prepare`` flow's config: the top-level keys and the ``prepare`` section."""

    prepare: PrepareConfig


class PipelineConfig(PrepareFlowConfig):
    """Everything a pipeline run needs: the top-level keys and one section per stage (``prepare``: the input URIs
    and the data stages)."""

    pretrain: PretrainConfig = PretrainConfig()
    finetune: FinetuneConfig | None = Field(None, description="required by the pipeline flow")
    ner: NerConfig | None = Field(None, description="required by the ner flow")
    label: LabelConfig = LabelConfig()
    monitor: MonitorConfig = MonitorConfig()
    promote: PromoteConfig = PromoteConfig()

    @model_validator(mode="after")
    def _checkpoint_vocab(self) -> "PipelineConfig":
        """pretrain.init_from's vocab.txt is the vocabulary: the vocab stage reads it from the same directory."""
        init, ckpt = self.pretrain.init_from, self.prepare.vocab.checkpoint
        if init is not None and ckpt is not None and init != ckpt:
            raise ValueError(f"prepare.vocab.checkpoint {ckpt} and pretrain.init_from {init} name different "
                             "checkpoints")
        if init is not None:
            self.prepare.vocab.checkpoint = init
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


def _moved_override(item: str) -> str:
    """A ``key=value`` override with its key in the current layout (:func:`moved_path`)."""
    key, sep, value = item.partition("=")
    if not sep:
        return item  # apply_overrides names the mistake
    return ".".join(moved_path(key.strip().split("."))) + sep + value


# A profile's one setting for where its external inputs live: the top-level ``data_dir`` key (a directory or any
# fsspec URL), which ``${data_dir}`` in any string value of the profile or an override stands for. It is expanded
# when the profile is loaded and is not itself a config key (where an input lives is provenance, never a version).
DATA_DIR = "data_dir"
_DATA_REF = "${data_dir}"


def read_profile(path: str | Path) -> dict[str, Any]:
    """A YAML profile's top-level mapping: a file in the checkout or any fsspec URL (``s3://…/full.yaml``)."""
    if "://" in str(path):
        with fsspec.open(str(path), "rt", encoding="utf-8") as f:
            text = f.read()
    else:
        text = Path(path).read_text(encoding="utf-8")
    loaded = yaml.safe_load(text) or {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a YAML mapping at the top level")
    return loaded


def expand_data_dir(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without its ``data_dir`` key, every ``${data_dir}`` in a string value replaced by it (a trailing
    ``/`` dropped); a ``${data_dir}`` with no ``data_dir`` set is an error that says how to set it."""
    data = dict(data)
    root = data.pop(DATA_DIR, None)
    if root is not None and (not isinstance(root, str) or not root.strip()):
        raise ValueError(f"data_dir: expected a directory or URL, got {root!r}")
    root = root.rstrip("/") if root else None
    used: list[str] = []

    def expand(value: Any, key: str) -> Any:
        if isinstance(value, dict):
            return {k: expand(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
        if isinstance(value, list):
            return [expand(v, f"{key}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, str) and _DATA_REF in value:
            used.append(key)
            return value.replace(_DATA_REF, root) if root is not None else value
        return value

    out = expand(data, "")
    if used and root is None:
        raise ValueError(f"{', '.join(used)} use ${{data_dir}}, but no data_dir is set: add `data_dir: DIR` to the "
                         "profile or --set data_dir=DIR")
    return out


def load_config(model: type[BaseModel], path: str | Path | None, overrides: list[str] | None = None) -> Any:
    """Read a YAML profile (a path or any fsspec URL), apply overrides, expand ``${data_dir}``, validate against
    ``model``.

    A profile may hold sections for stages the chosen flow does not run (they are ignored);
    a key that no flow knows is an error, so typos never pass silently. Keys of the layout before sections
    (``corpus_uri``, ``clean.min_chars`` at the top level) are moved to their section, profile and overrides alike,
    with one deprecation line each."""
    data = moved_keys(read_profile(path) if path is not None else {})
    data = apply_overrides(data, [_moved_override(o) for o in overrides or []])
    data = expand_data_dir(data)
    unknown = sorted(set(data) - set(PipelineConfig.model_fields))
    if unknown:
        known = sorted([*PipelineConfig.model_fields, DATA_DIR])
        raise ValueError(f"unknown top-level key(s) {unknown}; known: {known}")
    known = {k: v for k, v in data.items() if k in model.model_fields}
    return model.model_validate(known)

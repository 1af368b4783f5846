"""Typed configuration: one pydantic model per stage, YAML profiles and ``key=value`` overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Stage(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CleanConfig(_Stage):
    """clean: read raw dumps, normalise, split sentences, filter, dedup."""

    input_format: Literal["auto", "jsonl", "wikiextractor_doc", "text"] = "auto"
    min_chars: int = Field(5, ge=1, description="shortest sentence kept, in characters")
    min_cjk_ratio: float = Field(0.3, ge=0.0, le=1.0, description="least share of CJK characters")
    max_line_bytes: int = Field(1_000_000, ge=1024, description="longer input lines are rejected")
    dedup: bool = True
    shard_rows: int = Field(8192, ge=1, description="sentences per output shard")


class NumbersConfig(_Stage):
    """numbers: integers/decimals -> ``#NUM#``; English words marked for whole-word masking."""

    min_english_len: int = Field(2, ge=1, description="shortest ASCII-letter run marked as an English word")


class VocabConfig(_Stage):
    min_count: int = Field(1, ge=1)
    max_size: int | None = Field(None, ge=7)


class EmbeddingsConfig(_Stage):
    max_scan_num: int | None = Field(None, ge=1, description="read at most this many words")


class TrieConfig(_Stage):
    max_scan_num: int | None = Field(None, ge=1, description="trie holds the first N words (by rank)")


class LexiconConfig(_Stage):
    max_word_num: int = Field(3, ge=1, description="words kept per character")
    min_word_len: int = Field(2, ge=2)
    seed: int = 42


class RunnerConfig(_Stage):
    """Which Prefect task runner maps the shard tasks."""

    kind: Literal["thread", "dask"] = "thread"
    max_workers: int | None = Field(None, ge=1, description="thread runner pool size")
    dask_address: str | None = Field(None, description="existing cluster; None starts a LocalCluster")
    dask_workers: int = Field(2, ge=1)
    dask_threads_per_worker: int = Field(1, ge=1)


class PrepareConfig(_Stage):
    """The ``prepare`` flow: clean -> numbers -> vocab; embeddings -> trie; -> lexicon."""

    store_uri: str = ".lexiflow/store"
    corpus_uri: str | list[str] = Field(..., description="fsspec URL, glob or list of them")
    embeddings_uri: str = Field(..., description="Tencent-format text file (any fsspec URL)")
    seed: int = 42
    progress: bool = True
    runner: RunnerConfig = RunnerConfig()
    clean: CleanConfig = CleanConfig()
    numbers: NumbersConfig = NumbersConfig()
    vocab: VocabConfig = VocabConfig()
    embeddings: EmbeddingsConfig = EmbeddingsConfig()
    trie: TrieConfig = TrieConfig()
    lexicon: LexiconConfig = LexiconConfig()

    @field_validator("corpus_uri")
    @classmethod
    def _nonempty(cls, v: str | list[str]) -> str | list[str]:
        if not v:
            raise ValueError("corpus_uri is empty")
        return v


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b=1`` -> (["a", "b"], 1); the value is parsed as YAML (so ``null``, ``3``, ``[x]`` work)."""
    if "=" not in item:
        raise ValueError(f"--set {item!r}: expected key=value, e.g. clean.min_chars=8")
    key, raw = item.split("=", 1)
    value = yaml.safe_load(raw) if raw != "" else ""
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {part!r} is not a section")
        node[path[-1]] = value
    return data


def load_raw(path: str | Path | None, overrides: list[str] | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text(encoding="utf-8")
        loaded = yaml.safe_load(text) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a YAML mapping at the top level")
        data = loaded
    return apply_overrides(data, overrides or [])


def load_config(model: type[BaseModel], path: str | Path | None, overrides: list[str] | None = None) -> Any:
    """Read a YAML profile, apply overrides, validate against ``model`` (only its keys are used)."""
    data = load_raw(path, overrides)
    known = {k: v for k, v in data.items() if k in model.model_fields}
    return model.model_validate(known)

"""What every stage's configuration shares: the thread default, deprecations, the section base, the runner,
labelled-data files, and YAML profiles with ``key=value`` overrides. Each stage's section lives in its room
(``tasks/<room>/config.py``); the whole-pipeline config is assembled in :mod:`flows.config`."""

from __future__ import annotations

import logging
import warnings
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# torch CPU threads of every torch stage and of labelling: a fixed default, never the machine's core count (float
# reductions split over the threads, so results, and versions, depend on it)
THREADS = 2
THREADS_DOC = "torch CPU threads (results depend on it, so it enters the version; fixed, not the core count)"

log = logging.getLogger(__name__)
_WARNED: set[tuple[str, object]] = set()


def warn_deprecated(field: str, value: object, why: str) -> None:
    """Warn (once per field and value) that a deprecated field was set: it stays accepted and in every dump, so
    the versions it enters do not move, but nothing reads it."""
    if (field, value) in _WARNED:
        return
    _WARNED.add((field, value))
    msg = f"{field}={value!r} is deprecated: {why}; it is still accepted and kept in the config"
    warnings.warn(msg, DeprecationWarning, stacklevel=2)
    log.warning(msg)


def warn_moved(old: str, new: str) -> None:
    """Warn (once per key) that a config key is spelled as before the config held one section per stage: it is
    read at its new place, ``old`` -> ``new``."""
    if ("moved", old) in _WARNED:
        return
    _WARNED.add(("moved", old))
    msg = f"config key {old} is deprecated: it is now {new} (read there; write {new} in profiles and --set)"
    warnings.warn(msg, DeprecationWarning, stacklevel=2)
    log.warning(msg)


def deprecated(field: str, shown: str, why: str):
    """A validator of a model's deprecated ``field`` (named ``shown`` in the warning): a value other than the
    default warns (:func:`warn_deprecated`) and is kept as given."""

    def check(cls, v):
        if v != cls.model_fields[field].default:
            warn_deprecated(shown, v, why)
        return v

    return field_validator(field)(classmethod(check))


class SectionConfig(BaseModel):
    """A config section: unknown keys are an error, so typos never pass silently."""

    model_config = ConfigDict(extra="forbid")


class RunnerConfig(SectionConfig):
    """How tasks run: which Prefect task runner maps the shard tasks (every flow that maps shards), retries and
    timeouts (every stage is idempotent: staged files then a move; training resumes from its checkpoint), and
    the staging lease that lets overlapping runs share a store."""

    kind: Literal["thread", "dask"] = Field(
        "thread", description="what runs the shard tasks: thread (Prefect's thread pool in this process, "
        "max_workers) or dask (the cluster at dask_address, else a LocalCluster started for the run)")
    max_workers: int | None = Field(None, ge=1, description="thread runner pool size")
    dask_address: str | None = Field(None, description="existing cluster; None starts a LocalCluster")
    dask_workers: int = Field(2, ge=1, description="worker processes of the LocalCluster, at most the CPUs the "
                              "process may use (affinity, cgroup quota; unused with dask_address)")
    dask_threads_per_worker: int = Field(1, ge=1, description="threads per LocalCluster worker (unused with "
                                         "dask_address)")
    shard_retries: int = Field(2, ge=0, description="retries of a failed shard task")
    stage_retries: int = Field(1, ge=0, description="retries of a failed stage (training resumes from its checkpoint)")
    retry_delay_s: float = Field(10.0, ge=0, description="seconds to wait before retrying a failed shard or stage")
    shard_timeout_s: float | None = Field(None, gt=0, description="a shard task running longer fails (and retries)")
    stage_timeout_s: float | None = Field(None, gt=0, description="a stage running longer fails; None: no limit")
    lease_heartbeat_s: float = Field(15.0, gt=0, description="how often a run refreshes its staging owner record")
    lease_stale_after_s: float = Field(120.0, gt=0, description="an owner silent this long (other host) is dead")
    lease_poll_s: float = Field(2.0, gt=0, description="how often a run waiting for another's version looks again")
    rehash_inputs: bool = Field(False, description="hash every input file again (default: an input whose URL, size "
                                "and mtime are unchanged takes its sha256 from <store>/_fingerprints)")

    @model_validator(mode="after")
    def _lease(self) -> "RunnerConfig":
        if self.lease_stale_after_s <= 2 * self.lease_heartbeat_s:
            raise ValueError("runner.lease_stale_after_s must exceed 2 x lease_heartbeat_s")
        return self


class LabelledFiles(BaseModel):
    """The labelled data files: one file to split, or given splits."""

    model_config = ConfigDict(extra="forbid")

    data_uri: str | None = Field(None, description="one labelled file, split by `split`/`split_seed`")
    train_uri: str | None = Field(None, description="given splits are used as they are")
    dev_uri: str | None = Field(None, description="given splits: the dev file (required with train_uri); the best "
                                "epoch is chosen on it")
    test_uri: str | None = Field(None, description="given splits: the test file (optional); scored with the chosen "
                                 "model only, never used to choose; None: no test metrics")

    def input_uris(self) -> dict[str, str]:
        """The data files that are set, by role (data/train/dev/test)."""
        return {k: u for k in ("data_uri", "train_uri", "dev_uri", "test_uri") if (u := getattr(self, k))}


class LabelledDataConfig(LabelledFiles):
    """Where a supervised stage's rows come from: one file split deterministically, or given splits."""

    split: tuple[float, float, float] = Field((0.8, 0.1, 0.1), description="(train, dev, test) fractions that "
                                              "data_uri is split by: train, dev > 0, test >= 0, sum 1")
    split_seed: int = Field(7, description="seed of data_uri's split; split_seed + 1, + 2, + 3 seed the train, dev "
                            "and test subsamples (the max_* caps)")

    @model_validator(mode="after")
    def _check_data(self) -> "LabelledDataConfig":
        if self.data_uri and any((self.train_uri, self.dev_uri, self.test_uri)):
            raise ValueError("give either data_uri or train_uri/dev_uri[/test_uri], not both")
        if not self.data_uri and not (self.train_uri and self.dev_uri):
            raise ValueError(f"{self._section} needs data_uri, or train_uri and dev_uri")
        tr, dv, te = self.split
        if tr <= 0 or dv <= 0 or te < 0 or abs(tr + dv + te - 1.0) > 1e-6:
            raise ValueError(f"split {self.split}: train, dev > 0, test >= 0, summing to 1")
        return self

    _section = "this stage"


class TableColumns(LabelledFiles):
    """How a labelled table is read: its format and the text and label columns."""

    format: Literal["auto", "csv", "tsv", "jsonl", "parquet"] = Field(
        "auto", description="the files' format; auto: from each name's extension (a compression suffix ignored)")
    text_column: str = Field("review", description="column holding the text (empty text: row rejected)")
    label_column: str = Field("label", description="column holding the label, read as `classes` says (a bad "
                              "label: row rejected)")


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b=1`` -> (["a", "b"], 1); the value is parsed as YAML (so ``null``, ``3``, ``[x]`` work)."""
    if "=" not in item:
        raise ValueError(f"--set {item!r}: expected key=value, e.g. prepare.clean.min_chars=8")
    key, raw = item.split("=", 1)
    value = yaml.safe_load(raw) if raw != "" else ""
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` overrides (values parsed as YAML) to a nested config dict, in place."""
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {part!r} is not a section")
        node[path[-1]] = value
    return data


"""What a stage's build is handed: the run's :class:`Runtime` (how side effects happen) and its :class:`StageContext`.

A stage is ``build(ctx, **parents_and_inputs)``. ``ctx`` carries the stage's name, version, config section and
staging writer, a picklable :attr:`StageContext.staging` handle for shard workers and torchrun ranks, and the
runtime's ways of acting: :meth:`StageContext.map` for shard maps, :meth:`StageContext.call` for a named step,
:meth:`StageContext.step` for a training step, progress, logging and publishing.

:class:`Runtime` here is the plain one: everything runs in this process, in order, and nothing is published (the
Python API, tests, torchrun ranks, Dask workers). ``flows`` builds a Prefect-backed one at flow start
(:mod:`flows.runtime`) and hands it down; nothing is installed anywhere, and no run state lives in a module.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.artifacts import ArtifactStore, ArtifactWriter, StagingHandle
from storage.fingerprints import FingerprintCache
from storage.lease import LeaseSettings
from tasks.common.ui import PLAIN, LiveTable, Progress, Reporter

log = logging.getLogger("lexiflow")


@dataclass(frozen=True)
class RunOptions:
    """How stage and shard tasks run: retries, timeouts, and the staging lease (from ``runner:``)."""

    shard_retries: int = 0
    stage_retries: int = 0
    retry_delay_s: float = 10.0
    shard_timeout_s: float | None = None
    stage_timeout_s: float | None = None
    lease: LeaseSettings = LeaseSettings()


class Runtime:
    """How a run carries out its side effects; this plain one runs everything here, in order, and publishes nothing.

    - ``options``: retries, timeouts, lease timings (:class:`RunOptions`); ``owner``: the run an owner record names
      (None: this process, ``pid-<pid>``); ``fingerprints``: the input fingerprint cache beside the store (None:
      every input is hashed); ``reporter``: where UI artifacts go (:class:`tasks.common.ui.Reporter`).
    - :meth:`map`, :meth:`call`, :meth:`step` and :meth:`run_stage` are the four ways work runs; a subclass (the
      Prefect runtime) makes them tasks of a flow run."""

    def __init__(self, options: RunOptions = RunOptions(), *, owner: str | None = None,
                 fingerprints: FingerprintCache | None = None, reporter: Reporter = PLAIN):
        self.options, self.owner, self.fingerprints, self.reporter = options, owner, fingerprints, reporter

    @property
    def log(self) -> logging.Logger | logging.LoggerAdapter:
        """The logger whose lines reach the run's logs (here: the ``lexiflow`` logger)."""
        return log

    def map(self, fn: Callable[..., Any], items: Sequence[dict[str, Any]], *, name: str, stage: str,
            fold: Callable[[Any], Any] | None = None, shared: dict[str, Any] | None = None) -> list[Any]:
        """``fn(**item, **shared)`` for every item, results in item order; with ``fold`` each result is passed to
        it as it completes and only its return value is kept. ``name`` is what the shard runs show as, ``stage``
        names the progress bar and the crash tests' pause point. Here: in this process, in order."""
        kept = []
        for item in items:
            res = fn(**item, **(shared or {}))
            kept.append(fold(res) if fold else res)
            pause_point(stage)
        return kept

    def call(self, fn: Callable[..., Any], name: str, **kwargs: Any) -> Any:
        """``fn(**kwargs)`` as the named step ``name`` of this run (here: a plain call)."""
        return fn(**kwargs)

    def step(self, fn: Callable[..., Any], name: str, **kwargs: Any) -> Any:
        """A training stage's training step ``fn(**kwargs)`` named ``name`` (here: a plain call)."""
        return fn(**kwargs)

    def run_stage(self, name: str, tags: Sequence[str], body: Callable[[], tuple[Any, bool]]) -> Any:
        """Run one stage's ``body`` (returns ``(ref, cached)``); the ref. Here: a plain call."""
        return body()[0]


PLAIN_RUNTIME = Runtime()  # stateless: what a stage run outside any flow uses


@dataclass(frozen=True)
class StageContext:
    """What a stage's ``build(ctx, **parents)`` is handed: one stage version being built, and how to act.

    ``stage``, ``version``, ``cfg`` (its config section), ``writer`` (its staging directory), ``store``; the
    :attr:`staging` handle for other processes; :meth:`map`, :meth:`call`, :meth:`step`, :meth:`progress`,
    :meth:`live_table`, :attr:`log`, :attr:`reporter` from the run's :class:`Runtime`."""

    stage: str
    version: str
    cfg: Any
    writer: ArtifactWriter
    store: ArtifactStore
    runtime: Runtime = PLAIN_RUNTIME

    @property
    def staging(self) -> StagingHandle:
        """This staging directory as a picklable handle: shard workers and torchrun ranks attach a writer with it."""
        return StagingHandle(self.store.uri, self.stage, self.version)

    @property
    def log(self) -> logging.Logger | logging.LoggerAdapter:
        """The run's logger."""
        return self.runtime.log

    @property
    def reporter(self) -> Reporter:
        """Where this run's UI artifacts go."""
        return self.runtime.reporter

    def map(self, fn: Callable[..., Any], items: Sequence[dict[str, Any]], *, name: str,
            fold: Callable[[Any], Any] | None = None, shared: dict[str, Any] | None = None,
            stage: str | None = None) -> list[Any]:
        """:meth:`Runtime.map` for this stage (``stage`` names the progress bar when one stage maps twice)."""
        return self.runtime.map(fn, items, name=name, stage=stage or self.stage, fold=fold, shared=shared)

    def call(self, fn: Callable[..., Any], name: str, **kwargs: Any) -> Any:
        """:meth:`Runtime.call`: ``fn(**kwargs)`` as the named step ``name``."""
        return self.runtime.call(fn, name, **kwargs)

    def step(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """This stage's training step ``fn(**kwargs)``: inside a flow run the task ``<stage>-train``."""
        return self.runtime.step(fn, f"{self.stage}-train", **kwargs)

    def progress(self, total: float, description: str | None = None) -> Progress:
        """A progress bar ``<stage>-progress`` out of ``total``."""
        return self.reporter.progress_bar(f"{self.stage}-progress", total, description or f"{self.stage}: progress")

    def live_table(self, key: str, columns: Sequence[str], description: str) -> LiveTable:
        """A table ``key`` republished while rows arrive."""
        return self.reporter.live_table(key, columns, description)

    def pause_point(self, until: Callable[[], bool] | None = None) -> None:
        """:func:`pause_point` named after this stage."""
        pause_point(self.stage, until)


def pause_point(stage: str, until: Callable[[], bool] | None = None) -> None:
    """Test hook for crash-safety tests: with ``LEXIFLOW_PAUSE_IN=<stage>`` the process writes
    ``LEXIFLOW_PAUSE_MARKER`` and waits there (mid-stage) until it is killed, or until ``until()`` holds (a
    stop signal arrived: the stage then stops the way it would have)."""
    if os.environ.get("LEXIFLOW_PAUSE_IN") != stage:
        return
    marker = os.environ.get("LEXIFLOW_PAUSE_MARKER")
    if marker:
        Path(marker).write_text(str(os.getpid()))
    while until is None or not until():
        time.sleep(0.1)

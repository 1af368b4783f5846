"""Tests' shortcut to a stage version's staging writer, outside a ``store.stage(...)`` block.

``begin(store, stage, version)`` takes the staging lease and returns the writer (the test commits it with
``writer.commit(...)``), as a stage run's ``store.stage`` block would on entry; stages themselves only ever write
through ``store.stage``. ``context(writer, cfg)`` is the context a stage's build gets for that writer."""

from __future__ import annotations

from storage.artifacts import ArtifactStore, ArtifactWriter
from storage.lease import LeaseSettings


def begin(store: ArtifactStore, stage: str, version: str, settings: LeaseSettings = LeaseSettings()
          ) -> ArtifactWriter | None:
    """The leased staging writer of ``stage/version`` (None: another run committed it while this one waited);
    FileExistsError when it is already committed."""
    if store.is_committed(stage, version):
        raise FileExistsError(f"{store.artifact_uri(stage, version)} is already committed")
    return store._leased_writer(stage, version, settings)


def context(writer: ArtifactWriter, cfg=None, runtime=None):
    """The :class:`~tasks.common.stage.StageContext` a stage's build gets for the staging ``writer`` (from
    :func:`begin`) and its config section ``cfg``, under ``runtime`` (None: the plain one): to call a stage's
    ``build(ctx, **parents)`` directly, without :func:`~tasks.common.stage.run_stage` around it."""
    from tasks.common.context import PLAIN_RUNTIME, StageContext  # noqa: PLC0415  (tasks: for stage tests only)

    return StageContext(writer.stage, writer.version, cfg, writer, writer.store, runtime or PLAIN_RUNTIME)


def run_build(store: ArtifactStore, stage: str, code_version: str, config: dict, parents: list, build,
              runtime=None):
    """Run ``build(writer, version)`` as stage ``stage`` with this versioned ``config`` and ``parents`` through
    :func:`tasks.common.stage.run_stage` (a one-off :class:`~tasks.common.stage.Stage` record); the ref."""
    from tasks.common.stage import Stage, run_stage  # noqa: PLC0415  (tasks: only for the tests that build stages)

    names = tuple(f"p{i}" for i in range(len(parents)))
    record = Stage(stage, code_version, None, names, lambda ctx, **_: build(ctx.writer, ctx.version),
                   version_config=lambda cfg, cache=None: config)
    return run_stage(runtime, store, record, None, **dict(zip(names, parents)))

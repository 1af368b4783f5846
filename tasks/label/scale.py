"""label at scale: one input labelled by several workers, each writing its share of the shards, committed once.

Shard ``i`` of a labelling run is a fixed range of input records (:mod:`tasks.label.run`), scored on its own, so
its bytes do not depend on who computes it. The coordinator claims the output directory and records the run
(``_run.json``); share ``t`` of ``n`` then writes the missing shards ``i`` with ``i % n == t`` (reading the
input, scoring only its own rows), one task per share on the flow's task runner (threads, or Dask workers
on a LocalCluster or at a scheduler address). Last, the ordinary labeller runs over the same directory: it
finds every shard written, reads their counts back, and commits the manifest. So the committed output is
byte-identical to a one-process run whatever ``n`` is (for the same ``threads`` per worker), and a worker
killed mid-run costs only the shards it had not finished: a re-run skips every shard already written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tasks.common.context import PLAIN_RUNTIME, Runtime
from tasks.inference.interface import load_scorer
from tasks.label.config import LabelOptions, MonitorConfig
from tasks.label.run import label_stream, open_run, prepare_output


def label_share(kind: str, model_uri: str, input_uri: str | list[str], output_uri: str, options: dict[str, Any],
                t: int, n: int, threads: int | None = None, monitor: dict[str, Any] | None = None) -> dict[str, Any]:
    """One worker's share: load the model where the task runs, write shards ``i % n == t`` (no commit), each with
    its monitoring sketch when ``monitor`` is enabled."""
    opts = LabelOptions.model_validate(options)
    scorer = load_scorer(kind, model_uri, opts.batch_size)
    mon = MonitorConfig.model_validate(monitor) if monitor is not None else None
    return label_stream(scorer, input_uri, output_uri, opts, progress=False, threads=threads, share=(t, n),
                        monitor=mon)


def label_scaled(kind: str, model_uri: str, input_uri: str | Sequence[str], output_uri: str | None,
                 options: LabelOptions, *, shares: int, output_root: str | None = None, overwrite: bool = False,
                 threads: int | None = None, scorer=None, progress: bool = False,  # pragma: no mutate
                 monitor: MonitorConfig | None = None, runtime: Runtime | None = None) -> dict[str, Any]:
    """Label ``input_uri`` in ``shares`` tasks mapped by ``runtime`` (default: the plain one, here in order; a flow's
    runtime maps them on its shard runner), then commit once.

    Returns :func:`tasks.label.run.label_stream`'s summary (``skipped_shards`` counts the shards the shares wrote).
    ``scorer``: the coordinator's already loaded model (loaded from ``model_uri`` when None). ``monitor``: each share
    writes its shards' monitoring sketches, the coordinator merges them into the run's report."""
    runtime = runtime or PLAIN_RUNTIME
    if shares < 1:
        raise ValueError(f"shares must be >= 1, got {shares}")
    if threads is not None:  # one thread count for the coordinator and every share: it is part of the version
        options, threads = options.model_copy(update={"threads": int(threads)}), None
    inputs = input_uri if isinstance(input_uri, str) else list(input_uri)
    scorer = scorer if scorer is not None else load_scorer(kind, model_uri, options.batch_size)
    run = open_run(scorer, inputs, output_uri, options, output_root, overwrite, runtime.fingerprints)
    if run.done is None:
        prepare_output(run)
        mon = (monitor or MonitorConfig()).model_dump()
        items = [dict(kind=kind, model_uri=model_uri, input_uri=inputs, output_uri=run.out.uri,
                      options=options.model_dump(), t=t, n=shares, threads=threads, monitor=mon)
                 for t in range(shares)]
        runtime.map(label_share, items, name="label-share", stage="label")  # pragma: no mutate (UI names)
    return label_stream(scorer, inputs, run.out.uri, options, threads=threads, progress=progress, monitor=monitor,
                        runtime=runtime)

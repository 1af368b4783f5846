"""The finetune stage as a Prefect task: the wiring around :func:`tasks.finetune.train.run_finetune_stage`."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE

from storage.artifacts import ArtifactStore
from tasks.common.config import FinetuneConfig
from tasks.common.stage import Progress, StageResult
from tasks.finetune.train import run_finetune_stage


@task(name="finetune-train", cache_policy=NONE)
def finetune_task(store_uri: str, version: str, cfg: FinetuneConfig, pretrain_uri: str, lexicon_uri: str,
                  progress: bool = True) -> StageResult:
    """Run the stage into the staging directory that :func:`tasks.common.stage.run_stage` began."""
    bar = Progress("finetune", cfg.max_epochs)
    writer = ArtifactStore(store_uri).attach("finetune", version)
    return run_finetune_stage(writer, cfg, pretrain_uri, lexicon_uri, progress, lambda row: bar.step())

"""The labeller's configuration: how a table of texts is read and scored, and where its output goes."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tasks.common.config import THREADS, THREADS_DOC


class LabelOptions(BaseModel):
    """How a table of texts is read and scored: one object from the CLI/flow down to the labeller."""

    model_config = ConfigDict(extra="forbid")
    text_column: str = Field("review", description="column of the input holding the texts to label")
    id_column: str | None = Field(None, description="row ids from this column; default: file:row")
    shard_rows: int = Field(50_000, ge=1, description="input rows per output shard (the resume unit)")
    # 32: on CPU, length-sorted batches of 32 keep activations in cache, faster than 64 (benchmarks/bench_label.py)
    batch_size: int = Field(32, ge=1, description="texts per forward pass")
    precision: Literal["fp32", "int8"] = Field(
        "fp32", description="int8: dynamic quantization (CPU), used only if it agrees with fp32 on >= 99.9% of the "
        "bundle's held-out labels; recorded in the output")
    threads: int = Field(THREADS, ge=1, description=THREADS_DOC)


class _LabelTarget(BaseModel):
    """What to label and where the labelled shards go."""

    model_config = ConfigDict(extra="forbid")
    input_uri: str | None = Field(None, description="texts to label: CSV/TSV/JSONL/Parquet, fsspec URL or glob; "
                                  "\"@heldout\": the fine-tuning test split, which the bundle never saw")
    output_uri: str | None = Field(None, description="default: {store_uri}/labelled/{bundle version}")


class LabelConfig(LabelOptions, _LabelTarget):
    """Offline labelling at the end of the pipeline (skipped when ``input_uri`` is unset).

    ``model_dump()`` lists ``input_uri, output_uri`` first (reversed MRO), as it always did."""

    def options(self) -> LabelOptions:
        """The options part of the config (what a run reads, not where it writes)."""
        return LabelOptions.model_validate(self.model_dump(include=set(LabelOptions.model_fields)))


class MonitorConfig(BaseModel):
    """monitor: the report written beside every sentiment label run (``monitor.json``): each feature's drift against
    the bundle's reference (its held-out test rows), the estimated accuracy and F1 of this run's labels, the share
    of texts near the decision and the rejects, and the verdict: an alert on what hurts, drift as the diagnosis.
    Not part of the label version: the part files and rejects are the same bytes with it on or off."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(True, description="write the report (needs a bundle that carries the dev "
                          "reference: any bundle built since monitoring exists)")
    margin: float = Field(0.05, ge=0, le=1, description="a text is near the decision when its probability is within "
                          "this of the threshold (K > 2 classes: its top two probabilities are within this)")
    psi_threshold: float = Field(0.2, gt=0, description="a feature drifts when its population stability index "
                                 "(deciles of the reference) is at least this ...")
    ks_pvalue: float = Field(0.01, gt=0, lt=1, description="... and its two-sample Kolmogorov-Smirnov p-value "
                             "against the reference is below this")
    content_js: float = Field(0.02, gt=0, le=1, description="the texts' content drifts when the Jensen-Shannon "
                              "divergence of their character frequencies from the reference's is at least this and "
                              "above the largest the reference's own chunks of a similar size show")
    metric: Literal["accuracy", "f1"] = Field("accuracy", description="the estimated metric the floor applies to "
                                              "(f1: the positive class's; macro-F1 for K > 2 classes)")
    metric_floor: float | None = Field(None, ge=0, le=1, description="alert when the estimated metric's interval "
                                       "lies wholly below this; None: the bundle's dev value minus max_drop")
    max_drop: float = Field(0.05, ge=0, le=1, description="with metric_floor None: how far below its dev value the "
                            "estimated metric may fall before an alert")
    min_rows: int = Field(100, ge=1, description="fewer labelled rows (tonight together with the rolling window): "
                          "drift and estimate are reported but marked unreliable, and raise no alert (a data-quality "
                          "alert still fires)")
    window: int = Field(7, ge=1, description="a night with fewer than min_rows labelled rows is judged together with "
                        "the earlier nights under the same output root and bundle, up to this many nights in all, "
                        "until the rows reach min_rows (1: each night alone)")
    max_reject_share: float = Field(0.2, ge=0, le=1, description="alert (data quality) when more than this share "
                                    "of the input rows is rejected; an empty or fully rejected run always alerts")
    max_unseen_share: float = Field(0.2, ge=0, le=1, description="alert (data quality) when more than this share "
                                    "of the labelled rows falls in score x length x script cells where the "
                                    "reference has no row (texts unlike any the model was checked on, such as "
                                    "another language): the estimate cannot vouch for them. Held back, like the "
                                    "metric, below min_rows")
    alert_on: list[Literal["metric", "data_quality", "drift"]] = Field(
        ["metric", "data_quality"], description="what raises an alert: metric (the estimated metric's interval "
        "lies wholly below its floor), data_quality (rejects, an empty run), drift (a drifted feature; without it "
        "drift is a warning in the report, no alert)")

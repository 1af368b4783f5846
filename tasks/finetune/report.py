"""The fine-tuning report, for two classes and K > 2 alike: the shipped classifier beside the baseline on the same
rows, the epoch table, and the stage's publish step (the UI's table, report and explained dev examples)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tasks.common.ui import Reporter
from tasks.finetune.baseline import clean_test_line, fmt, vs_baseline
from tasks.finetune.heads import confusion_markdown, head_of_metrics

__all__ = ["comparison_markdown", "confusion_markdown", "publish", "report_markdown"]


def comparison_markdown(m: dict[str, Any]) -> str:
    """Finetune metrics ``m`` as markdown: the shipped classifier beside the baseline on the same rows (and, when it
    stacks the baseline, the encoder alone between them), how it ships, its difference to the baseline, the
    clean-row figures and the contamination counts ("n/a" where a manifest predates them)."""
    head = head_of_metrics(m)
    out = head.comparison_table(m)
    if isinstance(vs := m.get(head.vs_key), dict):
        out += f"\nShipped against the baseline: {vs_baseline(vs, head.test_metric)}.\n"
    if clean := clean_test_line(m):
        out += f"\n{clean}\n"
    return (out + head.baseline_sentence(m) + f"Contamination: {fmt(m.get('contaminated_test_rows'))} of "
            f"{fmt(m.get('n_test'))} test rows and {fmt(m.get('contaminated_dev_rows'))} of {fmt(m.get('n_dev'))} "
            "dev rows have a text that, normalised, also occurs among the training rows.\n")


def report_markdown(log: list[dict[str, Any]], art) -> str:
    """Markdown for the UI: test metrics beside the baseline's, (K > 2) the confusion matrix, the epoch table, where
    the curves are."""
    m = art.manifest.metrics
    head = head_of_metrics(m)
    comparison = comparison_markdown(m)
    if m.get("dev_missing_classes"):
        comparison += f"\nClasses with no dev row (dev macro-F1 averages over the others): {m['dev_missing_classes']}\n"
    columns = head.epoch_columns[:-1]
    rows = "".join("| " + " | ".join(_cell(r.get(c)) for c in columns) + " |\n" for r in log)
    table = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n" + rows
    return (f"# finetune `{art.manifest.version}`{head.title(m)}\n\nbest epoch {m.get('best_epoch')}\n\n"
            f"{comparison}\n{head.report_extra(m, art.uri)}## epochs\n\n{table}\nCurves: `{art.uri}/curves.png`\n")


def _cell(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def publish(log: list[dict[str, Any]], art, reporter: Reporter, explain: Callable[..., Any] | None = None) -> None:
    """The UI, once committed: the epoch table and the markdown report (nothing where there is no UI); ``explain``:
    the explained dev examples (:func:`tasks.inference.explain.explain_dev`, given ``art`` and ``reporter``)."""
    columns = head_of_metrics(art.manifest.metrics).epoch_columns[:-1]
    report = ("finetune-report", report_markdown(log, art), "fine-tuning report")
    reporter.publish_table("finetune-epochs", log, columns, f"fine-tuning, one row per epoch\n\n`{art.uri}`",
                           markdown=report)
    if explain is not None:
        explain(art, reporter)

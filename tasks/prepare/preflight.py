"""Checks a flow's config against its inputs before any work: before a Prefect server, a Dask cluster or a stage
starts, every missing input is listed in one error, and a labelled file whose label column does not fit
``finetune.classes`` is refused with what to set.

Cheap by design: an input is looked up (a glob expanded), never read, except the fine-tuning files' label column
(the files are small next to the corpus); the embeddings' archive member (``tar://<member>::<archive>``) is checked
by its archive only, since finding a member means decompressing the archive up to it (a corpus given as archive
members is listed, as the clean stage lists it, so a member that is a link is refused here).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import fsspec

from storage.urls import has_secret_parts, public_url
from tasks.common.labelled import class_name
from tasks.common.table import expand_inputs, read_batches
from tasks.prepare.corpus import corpus_files

_GLOB = "*?["


def config_inputs(cfg: Any, sections: tuple[str, ...]) -> list[tuple[str, str]]:
    """``[(config key, URI)]`` of every input file a flow that reads ``sections`` of ``cfg`` reads (symbolic values
    such as ``@finetune`` left out)."""
    out: list[tuple[str, str]] = []

    def add(key: str, uri: str | None) -> None:
        if isinstance(uri, str) and uri and not uri.startswith("@"):
            out.append((key, uri))

    if "prepare" in sections:
        prep = cfg.prepare
        corpus = prep.corpus_uri
        for i, u in enumerate([corpus] if isinstance(corpus, str) else corpus):
            add("prepare.corpus_uri" if isinstance(corpus, str) else f"prepare.corpus_uri[{i}]", u)
        add("prepare.embeddings_uri", prep.embeddings_uri)
        add("prepare.clean.dump.index_uri", getattr(getattr(prep.clean, "dump", None), "index_uri", None))
    if "pretrain" in sections:
        for i, ex in enumerate(cfg.pretrain.extra_texts):
            add(f"pretrain.extra_texts[{i}].{'data_uri' if ex.data_uri else 'train_uri'}", ex.data_uri or ex.train_uri)
    for name in ("finetune", "ner"):
        section = getattr(cfg, name, None) if name in sections else None
        for key, uri in (section.input_uris().items() if section is not None else ()):
            add(f"{name}.{key}", uri)
    if "label" in sections:
        add("label.input_uri", cfg.label.input_uri)
    return out


def _found(uri: str) -> bool:
    """Whether ``uri`` names a file (a glob: at least one); a chain's archive stands for its member."""
    target = uri.rpartition("::")[2] if "::" in uri else uri
    fs, path = fsspec.core.url_to_fs(target)
    if not has_secret_parts(target) and any(c in path for c in _GLOB):
        return any(fs.isfile(p) for p in fs.glob(path))
    return fs.exists(path)


def missing_inputs(cfg: Any, sections: tuple[str, ...]) -> list[str]:
    """``key uri`` of every input in ``sections`` that is not there (an unreachable storage server raises)."""
    return [f"{key} {public_url(uri)}" for key, uri in config_inputs(cfg, sections) if not _found(uri)]


def check_inputs(cfg: Any, sections: tuple[str, ...]) -> None:
    """FileNotFoundError listing every missing input in a flow's ``sections`` of ``cfg``; then
    :func:`check_label_classes`."""
    missing = missing_inputs(cfg, sections)
    if missing:
        raise FileNotFoundError(f"{len(missing)} input(s) not found: " + "; ".join(missing)
                                + " (check the paths in the profile or --set, and that the data is there)")
    for key, uri in config_inputs(cfg, sections):
        if key.startswith("prepare.corpus_uri") and uri.startswith("tar://"):  # a member that is a link: refused now
            corpus_files(uri)
    if "finetune" in sections and getattr(cfg, "finetune", None) is not None:
        check_label_classes(cfg.finetune)


def label_counts(uri: str, fmt: str, column: str) -> Counter:
    """Rows per class name (``tasks.common.labelled.class_name``) in ``column`` of the labelled file ``uri``."""
    counts: Counter = Counter()
    for src in expand_inputs(uri, fmt):
        for b in read_batches(src, {"label": column}, header_required=True):
            counts.update(n for n, bad in zip(map(class_name, b.values["label"]), b.bad) if bad is None and n)
    return counts


# share of the labelled rows whose label is not 0/1 above which ``classes: binary`` is taken for a mistake: a few
# bad labels in a binary file are rejects (``bad_label``); a column of K classes is a config to fix
NOT_BINARY_SHARE = 0.1


def check_label_classes(ft: Any) -> None:
    """ValueError when ``finetune.classes`` is ``binary`` and the label column holds more than two classes in a
    good share of its rows (it would reject them all as ``bad_label`` and train on what is left, or on nothing)."""
    if getattr(ft, "classes", "binary") != "binary":
        return
    for key, uri in ft.input_uris().items():
        counts = label_counts(uri, ft.format, ft.label_column)
        other = sum(n for c, n in counts.items() if c not in ("0", "1"))
        if len(counts) > 2 and other >= NOT_BINARY_SHARE * sum(counts.values()):
            shown = sorted(counts, key=lambda c: (-counts[c], c))[:8]
            raise ValueError(
                f"finetune.{key} {public_url(uri)}: label column {ft.label_column!r} holds {len(counts)} classes "
                f"({', '.join(map(repr, shown))}{', …' if len(counts) > len(shown) else ''}), but finetune.classes "
                "is binary (labels 0/1 only; others are rejected as bad_label): set finetune.classes: any to "
                "train on all of them"
            )

"""The same input files under another directory give the same versions (finetune, ner, label): where an input
lies is provenance, kept in the manifest, never part of a version (``storage.artifacts.without_locations``).
The data stages are checked end to end in ``test_prepare_flow.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.artifacts import ArtifactRef, ArtifactStore, open_artifact
from tasks.common.stage import StageResult

REVIEWS = "label,review\n1,这家酒店服务很好\n0,隔音太差了\n2,标签不对\n1,早餐不错\n0,失望\n1,环境干净\n"
PARENTS = (ArtifactRef(stage="pretrain", version="p1", uri="memory://nowhere/pretrain/p1"),
           ArtifactRef(stage="lexicon", version="l1", uri="memory://nowhere/lexicon/l1"))


def _copies(tmp_path: Path, name: str, text: str) -> list[Path]:
    """The same bytes under two unrelated directories."""
    out = []
    for d in ("one", "two/deeper"):
        path = tmp_path / d / name
        path.parent.mkdir(parents=True)
        path.write_text(text, encoding="utf-8")
        out.append(path)
    return out


def _on_pretrained(store: ArtifactStore, stage: str, cfg, built: list[str]) -> ArtifactRef:
    """A stage trained on the pretrained encoder (as finetune and ner are: their version config and parents),
    with a stand-in trainer, run as flows run it."""
    from tasks.common.stage import Stage, run_stage
    from tasks.pretrain.downstream import on_pretrained_config

    def train(ctx, pretrain_ref, lexicon_ref, progress):
        def step():  # written through the staging handle, as a torchrun rank writes
            built.append(ctx.version)
            ctx.staging.writer().write_bytes("out.txt", b"trained\n")
            return StageResult({"in": 1, "out": 1, "rejected": {}}, run={"wall_s": 0.1})

        return ctx.step(step)

    trained = Stage(stage, f"{stage}-t", type(cfg), parents=("pretrain_ref", "lexicon_ref"), build=train,
                    version_config=on_pretrained_config)
    return run_stage(None, store, trained, cfg, pretrain_ref=PARENTS[0], lexicon_ref=PARENTS[1], progress=False)


def test_finetune_version_is_the_same_for_the_same_file_under_two_paths(tmp_path):
    from tasks.finetune.config import FinetuneConfig

    a, b = _copies(tmp_path, "reviews.csv", REVIEWS)
    store = ArtifactStore(str(tmp_path / "store"))
    built: list[str] = []
    ref_a = _on_pretrained(store, "finetune", FinetuneConfig(data_uri=str(a)), built)
    ref_b = _on_pretrained(store, "finetune", FinetuneConfig(data_uri=str(b)), built)
    assert ref_a == ref_b and built == [ref_a.version]  # the second is a cache hit: nothing trained
    m = open_artifact(ref_a).manifest
    assert m.config["data_uri"] == str(a) and m.config["inputs"]["data_uri"]["uri"] == str(a)  # provenance kept
    assert m.run == {"wall_s": 0.1}
    # given splits: the same files moved together keep the version; the roles still count
    tr, dv = (_copies(tmp_path / n, f"{n}.csv", REVIEWS) for n in ("train", "dev"))
    given = [_on_pretrained(store, "finetune", FinetuneConfig(train_uri=str(t), dev_uri=str(d)), built)
             for t, d in zip(tr, dv)]
    assert given[0] == given[1] != ref_a
    swapped = FinetuneConfig(train_uri=str(tmp_path / "two" / "x" / "dev.csv"), dev_uri=str(tr[1]))
    Path(swapped.train_uri).parent.mkdir(parents=True)
    Path(swapped.train_uri).write_text(REVIEWS, encoding="utf-8")  # same bytes, named as the dev file
    assert _on_pretrained(store, "finetune", swapped, built) != given[0]
    # new bytes: a new version
    b.write_text(REVIEWS + "1,新的一行\n", encoding="utf-8")
    assert _on_pretrained(store, "finetune", FinetuneConfig(data_uri=str(b)), built) != ref_a


def test_finetune_rejects_name_the_file_not_its_directory(tmp_path):
    from tasks.common.labelled import read_labelled
    from tasks.finetune.config import FinetuneConfig

    a, b = _copies(tmp_path, "reviews.csv", REVIEWS)
    (rows_a, rej_a), (rows_b, rej_b) = (read_labelled(str(p), FinetuneConfig(data_uri=str(p))) for p in (a, b))
    assert rows_a == rows_b and rej_a == rej_b and [r["source"] for r in rej_a] == ["reviews.csv"]


def test_ner_version_is_the_same_for_the_same_file_under_two_paths(tmp_path):
    from tasks.ner.config import NerConfig

    a, b = _copies(tmp_path, "ner.txt", "中 B-LOC\n国 I-LOC\n\n")
    store = ArtifactStore(str(tmp_path / "store"))
    built: list[str] = []
    refs = [_on_pretrained(store, "ner", NerConfig(data_uri=str(p)), built) for p in (a, b)]
    assert refs[0] == refs[1] and len(built) == 1


def test_label_version_is_the_same_for_the_same_file_under_two_paths(tmp_path):
    pytest.importorskip("torch")
    from tasks.inference.bundle import load_bundle
    from tasks.label.config import LabelOptions
    from tasks.label.run import label_stream
    from tests.bundle_fixture import make_tiny_bundle

    bundle = load_bundle(make_tiny_bundle(str(tmp_path / "store")))
    a, b = _copies(tmp_path, "texts.csv", "review\n这家酒店服务很好\n\"  \"\n失望\n")
    root = str(tmp_path / "labelled")
    opts = LabelOptions(shard_rows=10)
    first = label_stream(bundle, str(a), None, opts, output_root=root, progress=False)
    again = label_stream(bundle, str(b), None, opts, output_root=root, progress=False)
    assert again["version"] == first["version"] and again["uri"] == first["uri"]
    assert again["cached"] and not first["cached"]  # the second run found the committed output: nothing scored
    assert first["stats"]["rejected"] == {"empty_text": 1}


def test_pretrain_version_with_extra_texts_is_the_same_for_the_same_file_under_two_paths(tmp_path):
    from flows.config import PipelineConfig
    from storage.artifacts import compute_version
    from tasks.pretrain.stage import version_config

    def version(path: Path, extra: dict) -> str:
        cfg = PipelineConfig.model_validate({"prepare": {"corpus_uri": "c", "embeddings_uri": "e"},
                                             "finetune": {"data_uri": str(path)},
                                             "pretrain": {"extra_texts": [extra]}})
        return compute_version("pretrain", "p", version_config(cfg.pretrain), list(PARENTS))

    a, b = _copies(tmp_path, "reviews.csv", REVIEWS)
    assert version(a, {"data_uri": "@finetune"}) == version(b, {"data_uri": "@finetune"})
    assert version(a, {"data_uri": str(a)}) == version(b, {"data_uri": str(b)})
    # the same file used whole (train_uri) is other training data than its train split (data_uri)
    assert version(a, {"train_uri": str(a)}) != version(a, {"data_uri": str(a)})

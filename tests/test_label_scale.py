"""One input labelled by several workers (tasks/label/scale.py): the committed bytes do not depend on the number
of shares or workers, a killed worker costs only the shards it had not finished, and the ``label`` flow spreads
the shares over a Dask LocalCluster (checked from the scheduler's own record)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from storage.artifacts import MANIFEST
from tasks.label.config import LabelOptions
from tasks.label.run import label_stream
from tasks.label.scale import label_scaled, label_share
from tests.staging import begin
from tests.test_label import REPO, _pythonpath, bundle, bundle_uri, csv_text, digests, many_rows  # noqa: F401

OPTS = LabelOptions(id_column="id", shard_rows=6, batch_size=4, threads=1)  # 40 rows + 2 bad ones: 7 shards


def _input(tmp_path: Path) -> str:
    inp = tmp_path / "in.csv"
    inp.write_text(csv_text(many_rows(40) + [("e", "   "), ("", "没有编号")]), encoding="utf-8")
    return str(inp)


@pytest.fixture(scope="module")
def reference(bundle, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("ref")
    inp = _input(tmp)
    res = label_stream(bundle, inp, str(tmp / "ref"), OPTS, progress=False, threads=1)
    assert res["stats"] == {"in": 42, "out": 40, "rejected": {"empty_text": 1, "missing_id": 1}}
    assert len(res["parts"]) == 7
    return inp, str(tmp / "ref"), res


@pytest.mark.parametrize("shares", [1, 3, 7, 10])
def test_any_number_of_shares_commits_the_same_bytes(bundle, bundle_uri, reference, tmp_path, shares):  # noqa: F811
    inp, ref_dir, ref = reference
    out = str(tmp_path / "out")
    res = label_scaled("label", bundle_uri, inp, out, OPTS, shares=shares, threads=1, scorer=bundle)
    assert res["skipped_shards"] == 7 and not res["cached"]  # every shard was written by a share
    assert (res["version"], res["stats"], res["metrics"]) == (ref["version"], ref["stats"], ref["metrics"])
    assert digests(out) == digests(ref_dir)
    again = label_scaled("label", bundle_uri, inp, out, OPTS, shares=shares, threads=1, scorer=bundle)
    assert again["cached"]


def test_a_share_needs_its_coordinators_directory(bundle_uri, reference, tmp_path):  # noqa: F811
    inp, _, _ = reference
    with pytest.raises(RuntimeError, match="a share runs in a directory its coordinator prepared"):
        label_share("label", bundle_uri, inp, str(tmp_path / "nowhere"), OPTS.model_dump(), 0, 2, 1)
    with pytest.raises(ValueError, match="shares must be >= 1"):
        label_scaled("label", bundle_uri, inp, str(tmp_path / "x"), OPTS, shares=0)


def test_a_killed_worker_costs_only_its_unfinished_shards(bundle, bundle_uri, reference, tmp_path):  # noqa: F811
    inp, ref_dir, _ = reference
    out = tmp_path / "out"
    # the coordinator prepared the directory, then worker 0 of 2 wrote one shard and was killed (SIGKILL)
    from tasks.label.run import open_run, prepare_output

    prepare_output(open_run(bundle, inp, str(out), OPTS))
    marker = tmp_path / "paused"
    code = ("import sys; from tasks.label.scale import label_share; from tasks.label.config import LabelOptions; "
            f"label_share('label', sys.argv[1], sys.argv[2], sys.argv[3], {OPTS.model_dump()!r}, 0, 2, 1)")
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "LEXIFLOW_PAUSE_IN": "label",
           "LEXIFLOW_PAUSE_MARKER": str(marker)}
    proc = subprocess.Popen([sys.executable, "-c", code, bundle_uri, inp, str(out)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.time() < deadline, "the share never reached its pause point"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    written = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*")}
    assert list(written) == ["part-00000.parquet"] and not (out / MANIFEST).exists()

    res = label_scaled("label", bundle_uri, inp, str(out), OPTS, shares=2, threads=1, scorer=bundle)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("part-00000*")} == written  # not recomputed
    assert digests(str(out)) == digests(ref_dir) and res["skipped_shards"] == 7


@pytest.mark.flow
def test_the_label_flow_spreads_shares_over_dask_workers(prefect_server, bundle_uri, reference, tmp_path):  # noqa: F811
    distributed = pytest.importorskip("distributed")
    from flows.label import label_flow

    inp, ref_dir, ref = reference
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None,
                                  processes=True) as cluster:
        runner = {"kind": "dask", "dask_address": cluster.scheduler_address}
        res = label_flow(bundle_uri, inp, str(tmp_path / "out"), OPTS, shares=4, runner=runner, threads=1)
        done = {name: tp.state_counts.get("memory", 0) for name, tp in cluster.scheduler.task_prefixes.items()}
    assert done.get("label_share") == 4, done
    assert res["version"] == ref["version"] and res["stats"] == ref["stats"]
    assert digests(str(tmp_path / "out")) == digests(ref_dir)


def test_roots_and_loading_the_model_where_the_shares_run(bundle_uri, reference, tmp_path):  # noqa: F811
    inp, ref_dir, ref = reference
    res = label_scaled("label", bundle_uri, [inp], None, OPTS, shares=2, output_root=str(tmp_path / "root") + "/",
                       threads=1)  # no scorer given: the coordinator loads the bundle from its URI too
    assert res["uri"] == f"{tmp_path}/root/{ref['version']}" and res["version"] == ref["version"]
    assert digests(res["uri"]) == digests(ref_dir)


@pytest.fixture(scope="module")
def ner_uri(tmp_path_factory):
    """A tiny NER model trained for one epoch (as tests/test_ner.py builds it), committed in a memory store."""
    import json
    import uuid

    import torch
    from safetensors.torch import save as st_save

    from models import LebertForPretraining
    from storage.artifacts import ArtifactStore
    from tasks.ner.config import NerConfig
    from tasks.ner.train import run_ner_stage
    from tasks.text.featurize import Featurizer
    from tasks.training.checkpoint import weights
    from tests.test_ner import LEX, _cfg, _data, _featurizer

    feat = _featurizer()
    mc = _cfg(vocab_size=len(feat.vocab_index), num_layers=1, word_vocab_size=2 + len(LEX), max_len=24)
    torch.manual_seed(1)
    store = ArtifactStore(f"memory://ner-scale-{uuid.uuid4().hex}")
    w = begin(store, "pretrain", "p1")
    w.write_bytes("model.safetensors", st_save(weights(LebertForPretraining(mc))))
    w.write_bytes("model_config.json", json.dumps(mc.model_dump()).encode())
    pre = w.commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
    lex = begin(store, "lexicon", "l1").commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
    cfg = NerConfig(**_data(tmp_path_factory.mktemp("ner")), max_len=24, batch_size=16, lr=3e-3, max_epochs=1,
                    threads=1, device="cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Featurizer, "from_artifacts", lambda art, max_len=256: feat)
        writer = begin(store, "ner", "n1")
        res = run_ner_stage(writer, cfg, pre.uri, lex.uri, progress=False)
    return writer.commit(code_version="t", config={}, parents=[], stats=res.stats, metrics=res.metrics,
                         rows=res.rows).uri


def test_ner_labelling_scales_out_the_same_way(ner_uri, tmp_path):
    from tasks.inference.ner import NerScorer

    inp = tmp_path / "texts.csv"
    inp.write_text("id,text\n" + "".join(f"r{i},我们今天去了{'北京' if i % 2 else '上海'}看到李四\n" for i in range(9))
                   + "e,  \n", encoding="utf-8")
    opts = LabelOptions(text_column="text", id_column="id", shard_rows=3, batch_size=2)
    one = label_stream(NerScorer(ner_uri, "cpu", 2), str(inp), str(tmp_path / "one"), opts, progress=False,
                       threads=1)
    res = label_scaled("ner-label", ner_uri, str(inp), str(tmp_path / "three"), opts, shares=3, threads=1)
    assert res["stats"] == one["stats"] == {"in": 10, "out": 9, "rejected": {"empty_text": 1}}
    assert digests(str(tmp_path / "three")) == digests(str(tmp_path / "one"))

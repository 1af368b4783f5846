"""Golden bytes of the fine-tuning path for each kind of head: binary mode (residual; the stacked binary run is
the tiny pipeline's golden), two named classes, three classes (stacked and alone), each a tiny finetune stage run
on a hand-made encoder plus the threshold stage on it. Every file's sha256 and each artifact's version are held in
``tests/golden/finetune_classes.json`` and compared wherever the recorded numerics equal the golden file's (as
``tests/test_determinism.py`` does for the tiny pipeline); elsewhere the test says why it skipped.

A change that moves these bytes on purpose regenerates the file (``LEXIFLOW_WRITE_GOLDEN=1``) in the same commit."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
import torch

from models import LebertForPretraining
from storage.artifacts import ArtifactStore, open_artifact
from tasks.finetune import threshold
from tasks.finetune.config import FinetuneConfig
from tasks.finetune.train import code_version, run_finetune_stage
from tasks.inference.runtime import numerics_config
from tasks.pretrain.downstream import on_pretrained_config
from tasks.text.featurize import Featurizer
from tasks.text.vocab import vocab_bytes
from tasks.training.checkpoint import weights
from tests.staging import begin, run_build
from tests.test_finetune import LEX, _featurizer, _model_cfg, _synthetic_csv
from tests.test_kclass import _three_class_csv

GOLDEN = Path(__file__).resolve().parent / "golden" / "finetune_classes.json"
MAX_LEN = 24
# name -> (data file, FinetuneConfig fields beyond the shared ones)
CASES = {
    "binary-residual": ("binary", {"combine": "residual"}),
    "two-named-classes": ("two", {"classes": "any", "label_column": "cat"}),
    "three-classes-stack": ("three", {"classes": "any", "label_column": "cat"}),
    "three-classes-none": ("three", {"classes": "any", "label_column": "cat", "combine": "none"}),
}


def _two_named_csv(path):
    """The binary file with its labels as the class names ``bad``/``good``."""
    binary = path.parent / "binary-for-two.csv"
    _synthetic_csv(binary, n=90, seed=3)
    rows = binary.read_text(encoding="utf-8").splitlines()[1:]
    named = [("good" if r.split(",")[0] == "1" else "bad") + "," + r.split(",", 1)[1] for r in rows]
    path.write_text("cat,review\n" + "\n".join(named) + "\n", encoding="utf-8")


def _run_case(store: ArtifactStore, pre, lex, data: Path, extra: dict) -> dict[str, str]:
    cfg = FinetuneConfig(data_uri=str(data), max_len=MAX_LEN, use_layers=2, dropout=0.1, batch_size=16, lr=2e-3,
                         max_epochs=3, patience=2, threads=1, device="cpu", **extra)
    config = on_pretrained_config(cfg)  # the section, its input files and the numerics
    ft_ref = run_build(store, "finetune", code_version(cfg), config, [pre.ref, lex.ref],
                       lambda writer, version: run_finetune_stage(writer, cfg, pre.uri, lex.uri, progress=False))
    th_ref = run_build(store, "threshold", threshold.CODE_VERSION, {}, [ft_ref],
                       lambda writer, version: threshold.build(writer, open_artifact(ft_ref)))
    out = {}
    for ref in (ft_ref, th_ref):
        art = open_artifact(ref)
        out[f"{ref.stage}/version"] = ref.version
        out.update({f"{ref.stage}/{f.path}": f.sha256 for f in art.manifest.files})
    return out


@pytest.fixture(scope="module")
def current(tmp_path_factory):
    """Every case's files and versions, and the numerics they were computed under."""
    from safetensors.torch import save as st_save

    tmp = tmp_path_factory.mktemp("golden-ft")
    files = {"binary": tmp / "binary.csv", "two": tmp / "two.csv", "three": tmp / "three.csv"}
    _synthetic_csv(files["binary"], n=90, seed=2)
    _two_named_csv(files["two"])
    _three_class_csv(files["three"], n=120, seed=4, noise=0.15)
    mc = _model_cfg()
    torch.manual_seed(1)
    store = ArtifactStore(f"memory://golden-ft-{uuid.uuid4().hex}")
    w = begin(store, "pretrain", "p1")
    w.write_bytes("model.safetensors", st_save(weights(LebertForPretraining(mc))))
    w.write_bytes("model_config.json", json.dumps(mc.model_dump()).encode())
    pre = w.commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
    lw = begin(store, "lexicon", "l1")
    lw.write_bytes("words.txt", vocab_bytes(["[PAD]", "[UNK]", *LEX]))
    lex = lw.commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
    feat = _featurizer(MAX_LEN)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Featurizer, "from_artifacts", lambda art, max_len=256: feat)
        cases = {name: _run_case(store, pre, lex, files[data], extra) for name, (data, extra) in CASES.items()}
    return {"cases": cases, "numerics": numerics_config(1, "cpu")}


def test_golden_bytes_of_every_kind_of_finetune(current):
    """Each case's finetune and threshold files and versions equal the golden file's under its numerics."""
    if os.environ.get("LEXIFLOW_WRITE_GOLDEN"):
        GOLDEN.write_text(json.dumps(current, indent=1, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert set(golden["cases"]) == set(CASES)
    if current["numerics"] != golden["numerics"]:
        from models.numerics import numerics_difference

        pytest.skip("numerics differ from the golden file's "
                    f"({numerics_difference(golden['numerics'], current['numerics'])}): outside the byte promise")
    for name in CASES:
        want, got = golden["cases"][name], current["cases"][name]
        moved = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
        assert not moved, f"{name}: these files or versions moved: {moved}"


def test_each_case_ran_the_head_it_names(current):
    """The cases cover what they say: K > 2 runs write no threshold table, binary ones do, versions differ."""
    cases = current["cases"]
    for name, files in cases.items():
        has_table = "finetune/threshold_table.parquet" in files
        assert has_table == (not name.startswith("three")), name
        assert ("finetune/blend.json" in files) == (not name.endswith("none")), name
    assert len({files["finetune/version"] for files in cases.values()}) == len(cases)

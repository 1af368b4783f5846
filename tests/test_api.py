"""The public Python API (``lexiflow``): real tiny bundle, real label outputs, real flow runs — no mocks."""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

import lexiflow
from storage.artifacts import MANIFEST
from tasks.inference.sentiment import score_texts
from tasks.label.config import LabelOptions
from tasks.label.run import label_stream
from tests.bundle_fixture import make_tiny_bundle
from tests.conftest import tiny_config_data
from tests.test_label import GOOD

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ["prob", "label", "threshold", "bundle_version", "no_cjk", "truncated_at", "reason"]
# texts the labeller rejects, with the reason each gets
BAD = {"": "empty_text", "   ": "empty_text", "<br/>": "empty_after_normalization"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread (tests/conftest.py)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("api_store"))


@pytest.fixture(scope="module")
def model(store):
    return lexiflow.load_bundle(make_tiny_bundle(store))


def reviews(n: int) -> list[str]:
    """``n`` texts of varied lengths (so how texts are batched shows in the last bits), each bad kind mixed in."""
    bad = list(BAD)
    return [bad[i // 7 % len(bad)] if i % 7 == 3 else GOOD[i % 10] + GOOD[i * 7 % 10][: i % 6] for i in range(n)]


def test_version_comes_from_the_package_metadata():
    with open(REPO / "pyproject.toml", "rb") as f:
        declared = tomllib.load(f)["project"]["version"]
    assert lexiflow.__version__ == importlib.metadata.version("lexiflow") == declared


def test_predict_scores_in_order_and_gives_reasons(model):
    texts = GOOD + [None, 7, *BAD]
    out = model.predict(texts)
    assert list(out.columns) == ["text_index", *COLUMNS]
    assert out["text_index"].tolist() == list(range(len(texts)))
    assert {c: str(t) for c, t in out.dtypes.items() if c in ("prob", "label")} == {"prob": "float32", "label": "Int8"}
    assert out["reason"].tolist() == [None] * len(GOOD) + ["missing_text", "not_a_string", *BAD.values()]
    good = out.iloc[: len(GOOD)]
    assert np.array_equal(good["prob"].to_numpy(), score_texts(model.bundle, GOOD))  # the real scorer, bit for bit
    assert good["label"].tolist() == (good["prob"] >= model.threshold).astype(int).tolist()
    assert 0 < good["label"].sum() < len(GOOD)  # the fixture's threshold splits them
    assert out.iloc[len(GOOD) :][["prob", "label"]].isna().all().all()
    assert set(out["bundle_version"]) == {model.version} and set(out["threshold"]) == {model.threshold}
    assert model.predict("隔音太差了")["prob"].iloc[0] == out["prob"].iloc[1]


@pytest.mark.flow
def test_label_dataframe_equals_the_cli_bit_for_bit(prefect_server, model, tmp_path):
    """`lexiflow label` on a CSV vs label_dataframe on the same rows: same probabilities (float32, exact),
    labels and reasons. batch_size=2 makes a scoring window 64 texts and shard_rows=100 cuts shards, so
    both the full-window and the end-of-shard flush are exercised (a different grouping changes the last
    bits of some probabilities: the lengths vary); chunk_rows=3 crosses both."""
    from typer.testing import CliRunner

    from lexiflow.cli import app

    texts = reviews(150)
    pd.DataFrame({"review": texts}).to_csv(tmp_path / "in.csv", index=False)
    out = str(tmp_path / "out")
    args = ["label", "--bundle", model.uri, "--input", str(tmp_path / "in.csv"), "--output", out]
    res = CliRunner().invoke(app, [*args, "--shard-rows", "100", "--batch-size", "2"])
    assert res.exit_code == 0, res.output
    cli = lexiflow.read_labelled(out)

    df = pd.read_csv(tmp_path / "in.csv", dtype=str, keep_default_na=False, skip_blank_lines=False)  # as the CLI
    ours = lexiflow.label_dataframe(df, model, batch_size=2, shard_rows=100, chunk_rows=3)
    assert cli["row_id"].tolist() == [f"in.csv:{i}" for i in range(len(texts))]  # read back in input order
    assert ours["row_id"].tolist() == [str(i) for i in range(len(texts))]
    assert np.array_equal(cli["prob"].to_numpy(), ours["prob"].to_numpy(), equal_nan=True)
    pd.testing.assert_frame_equal(cli[COLUMNS], ours[COLUMNS])
    assert ours["reason"].tolist() == [BAD.get(t) for t in texts]


def test_label_dataframe_chunks_ids_index_and_rejects(model):
    texts = reviews(90) + [None, float("nan"), 3, "好"]
    ids = [f"r{i}" for i in range(len(texts))]
    ids[5] = None
    df = pd.DataFrame({"review": texts, "id": ids}, index=[f"ix{i}" for i in range(len(texts))])
    small = lexiflow.label_dataframe(df, model, id_column="id", batch_size=2, chunk_rows=3)
    whole = lexiflow.label_dataframe(df, model.uri, id_column="id", batch_size=2, chunk_rows=1000)
    pd.testing.assert_frame_equal(small, whole)  # chunking changes nothing, not a bit (a window is 64 texts)
    assert small.index.equals(df.index) and len(df.join(small)) == len(df)
    assert small.loc["ix5", ["row_id", "reason"]].tolist() == ["ix5", "missing_id"]  # no id: the index names it
    assert small.loc["ix6", "row_id"] == "r6"
    tail = small.iloc[-4:]
    assert tail["reason"].tolist() == ["missing_text", "missing_text", "not_a_string", None]
    assert small["prob"].isna().tolist() == small["reason"].notna().tolist()
    by_index = lexiflow.label_dataframe(df.drop(columns="id"), model, batch_size=1)
    assert by_index["row_id"].tolist() == df.index.tolist()


def test_label_dataframe_refuses_bad_arguments(model):
    df = pd.DataFrame({"text": ["好"]})
    with pytest.raises(KeyError, match="review"):
        lexiflow.label_dataframe(df, model)
    with pytest.raises(ValueError, match="chunk_rows"):
        lexiflow.label_dataframe(df, model, text_column="text", chunk_rows=0)
    with pytest.raises(ValueError, match="both"):
        lexiflow.label_dataframe(df, model, text_column="text", id_column="text")
    empty = lexiflow.label_dataframe(df.iloc[:0], model, text_column="text")
    assert list(empty.columns) == ["row_id", *COLUMNS] and len(empty) == 0


def test_read_labelled_with_an_id_column_and_refuses_an_uncommitted_dir(model, tmp_path):
    texts = reviews(30)
    rows = [{"id": f"k{i}", "review": t} for i, t in enumerate(texts)]
    rows[4]["id"] = None
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    out = str(tmp_path / "out")
    opts = LabelOptions(id_column="id", shard_rows=8)
    label_stream(model.bundle, str(src), out, opts, progress=False)
    got = lexiflow.read_labelled(out).set_index("row_id")
    df = pd.DataFrame(rows, index=[f"in.jsonl:{i}" for i in range(len(rows))])  # the CLI's default ids
    ours = lexiflow.label_dataframe(df, model, id_column="id", shard_rows=8).set_index("row_id")
    assert sorted(got.index) == sorted(ours.index)  # one row per input row, rejects included
    pd.testing.assert_frame_equal(got.loc[ours.index, COLUMNS], ours[COLUMNS])
    assert got.loc["in.jsonl:4", ["reason", "source", "line"]].tolist() == ["missing_id", "in.jsonl", 5]

    shutil.copytree(out, tmp_path / "crashed")
    (tmp_path / "crashed" / MANIFEST).unlink()
    with pytest.raises(FileNotFoundError, match="not a committed label output"):
        lexiflow.read_labelled(str(tmp_path / "crashed"))


def ancestor(uri: str, stage: str) -> str:
    """The version of the ``stage`` artifact in ``uri``'s lineage."""
    from storage.artifacts import lineage

    todo = [lineage(uri)]
    while todo:
        node = todo.pop()
        if node["stage"] == stage:
            return node["version"]
        todo += node["parents"]
    raise KeyError(stage)


@pytest.mark.flow
def test_run_is_lexiflow_run_and_versions_lists_them(prefect_server, tiny_inputs, tmp_path):
    """A dict config from Python, then the same profile as YAML through the CLI: the same ArtifactRef (a
    cache hit). An override makes a second clean version; versions() lists both with their lineage."""
    from typer.testing import CliRunner

    from lexiflow.cli import app

    store = str(tmp_path / "store")
    data = tiny_config_data(tiny_inputs, "unused")
    ref = lexiflow.run("prepare", data, store_uri=store)
    assert ref.stage == "lexicon" and ref.uri == f"{store}/lexicon/{ref.version}"
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(app, ["run", "prepare", "--config", str(tmp_path / "p.yaml"), "--store", store])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output.strip().splitlines()[-1]) == ref.model_dump()

    again = lexiflow.run("prepare", data, {"store_uri": store}, clean__min_chars=12)
    assert again.version != ref.version
    table = lexiflow.versions(store, "clean")
    assert len(table) == 2 and table["created_at"].is_monotonic_increasing
    assert table["version"].tolist() == [ancestor(ref.uri, "clean"), ancestor(again.uri, "clean")]  # oldest first
    assert {"parents", "in", "out", "rejected", "uri"} <= set(table.columns)
    assert all(p == [] for p in table["parents"])  # clean is a root stage
    assert (table["in"] == table["out"] + table["rejected"]).all() and (table["rejected"] > 0).all()
    lex = lexiflow.versions(store, "lexicon").set_index("version")
    assert set(lex.index) == {ref.version, again.version}
    assert any(p.startswith("vocab:") for p in lex.loc[ref.version, "parents"])
    assert [c for c in lex.columns if c.startswith("metric.")], lex.columns
    assert lexiflow.versions(store, "no_such_stage").empty


def test_python_m_lexiflow_is_the_cli(model):
    res = subprocess.run([sys.executable, "-m", "lexiflow", "lineage", model.uri], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"bundle {model.version}")


def readme_example() -> str:
    """The Python API page's first example (docs/api.md)."""
    text = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
    return next(c for c in re.findall(r"```python\n(.*?)```", text, re.S) if "store = " in c)


def test_readme_example_runs(model, store, tmp_path):
    """The API page's example, executed against the tiny store (its first lines name the demo store)."""
    pd.DataFrame({"review": reviews(20)}).to_csv(tmp_path / "in.csv", index=False)
    label_stream(model.bundle, str(tmp_path / "in.csv"), f"{store}/labelled/{model.version}", progress=False)
    code = readme_example()
    assert 'store = ".demo/store"' in code
    ns: dict = {}
    exec(compile(code.replace('store = ".demo/store"', f"store = {store!r}"), "docs/api.md", "exec"), ns)
    assert ns["labelled"]["reason"].tolist() == [None, None, "missing_text"]
    assert len(ns["out"]) == 20

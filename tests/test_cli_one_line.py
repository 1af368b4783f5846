"""Mistakes a new user meets first, each one ``error:`` line and exit 2 before any work, through the real CLI in a
subprocess: an edited model_config.json, an archive member that is a link, an unreachable S3 endpoint, an object
store without credentials, an empty
Parquet file, ``lineage`` from another directory, a profile whose data is not there, a K-class label column under
``finetune.classes: binary``."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from tests.bundle_fixture import make_tiny_bundle
from tests.staging import begin
from tests.test_cli_errors import REPO, cli, one_error


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    return make_tiny_bundle(str(tmp_path_factory.mktemp("store")))


@pytest.fixture()
def reviews(tmp_path) -> Path:
    p = tmp_path / "reviews.csv"
    p.write_text("id,review\n1,这家酒店服务很好\n2,隔音太差了\n", encoding="utf-8")
    return p


def _no_server_started(res: subprocess.CompletedProcess) -> None:
    assert "temporary server" not in res.stderr.lower() and "dask" not in res.stderr.lower(), res.stderr[-2000:]


def test_model_config_without_an_expected_key(bundle, reviews, tmp_path):
    edited = tmp_path / "edited"
    shutil.copytree(bundle, edited)
    mc_path = edited / "model_config.json"
    mc = json.loads(mc_path.read_text())
    del mc["use_layers"]
    mc_path.write_text(json.dumps(mc))
    manifest = json.loads((edited / "_manifest.json").read_text())  # re-hashed: what an edit that passes looks like
    for f in manifest["files"]:
        if f["path"] == "model_config.json":
            f["sha256"], f["bytes"] = hashlib.sha256(mc_path.read_bytes()).hexdigest(), mc_path.stat().st_size
    (edited / "_manifest.json").write_text(json.dumps(manifest))
    line = one_error(cli("label", "--bundle", str(edited), "--input", str(reviews), "--output", str(tmp_path / "o")),
                     str(mc_path), "['use_layers'] missing", "rebuild it")
    assert "KeyError" not in line and not (tmp_path / "o").exists()


def _tar_with_link(path: Path, member: bytes) -> None:
    with tarfile.open(path, "w:gz") as tf:
        real = tarfile.TarInfo("d/real.csv")
        real.size = len(member)
        tf.addfile(real, io.BytesIO(member))
        link = tarfile.TarInfo("d/link.csv")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(link)


def test_an_archive_member_that_is_a_link(bundle, reviews, tmp_path):
    archive = tmp_path / "in.tar.gz"
    _tar_with_link(archive, reviews.read_bytes())
    chain = f"tar://d/link.csv::{archive}"
    one_error(cli("label", "--bundle", bundle, "--input", chain, "--output", str(tmp_path / "o")),
              "archive member 'd/link.csv' is a link (to '/etc/passwd'); expected a regular file")
    res = cli("run", "prepare", "--store", str(tmp_path / "store"), "--set", f"prepare.corpus_uri={chain}",
              "--set", f"prepare.embeddings_uri={reviews}")
    one_error(res, "corpus_uri", "archive member 'd/link.csv' is a link")
    _no_server_started(res)
    assert not (tmp_path / "store").exists()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_s3_endpoint(bundle, tmp_path):
    endpoint = f"http://127.0.0.1:{_closed_port()}"  # nothing listens there
    opts = json.dumps({"s3": {"endpoint_url": endpoint, "key": "k", "secret": "s",  # one quick try, no backoff
                              "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}})
    started = time.monotonic()
    one_error(cli("label", "--bundle", bundle, "--input", "s3://bucket/in.csv", "--output", str(tmp_path / "o"),
                  "--storage-options", opts), "cannot reach the storage server", endpoint, "endpoint_url")
    res = cli("run", "prepare", "--store", str(tmp_path / "store"), "--set", "prepare.corpus_uri=s3://bucket/c/*.jsonl",
              "--set", "prepare.embeddings_uri=s3://bucket/e.txt", "--storage-options", opts)
    one_error(res, "cannot reach the storage server", endpoint)
    _no_server_started(res)
    assert time.monotonic() - started < 120


def test_an_object_store_without_credentials(bundle, tmp_path, monkeypatch):
    """No AWS credentials anywhere (no variables, no credentials or config file, no instance metadata): reading,
    listing and labelling to s3:// each end in one line that says so and where credentials go, not a traceback."""
    for var in [v for v in os.environ if v.startswith(("AWS_", "FSSPEC_S3"))]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    names = ("no credentials for the object store", "NoCredentialsError", "--storage-options", "AWS_ACCESS_KEY_ID")
    one_error(cli("ls", "s3://bucket/store"), *names)
    one_error(cli("monitor", "s3://bucket/labelled"), *names)
    one_error(cli("label", "--bundle", bundle, "--input", "s3://bucket/in.csv", "--output", str(tmp_path / "o")),
              *names)


def test_an_empty_parquet_file_is_named(bundle, tmp_path):
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    one_error(cli("label", "--bundle", bundle, "--input", str(empty), "--output", str(tmp_path / "o")),
              f"{empty}: not a readable Parquet file", "0 bytes")


def test_lineage_of_a_store_given_as_a_relative_path_from_another_directory(tmp_path, monkeypatch):
    from storage.artifacts import ArtifactStore

    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    store = ArtifactStore("store")  # a relative path: the manifests record relative parent URIs
    w = begin(store, "clean", "c0")
    w.write_bytes("x", b"x")
    clean = w.commit(code_version="t", config={}, parents=[], stats={"in": 1, "out": 1})
    w = begin(store, "numbers", "n0")
    w.write_bytes("y", b"y")
    w.commit(code_version="t", config={}, parents=[clean.ref], stats={"in": 1, "out": 1})
    monkeypatch.chdir(REPO)
    child = tmp_path / "work" / "store" / "numbers" / "n0"
    assert json.loads((child / "_manifest.json").read_text())["parents"][0]["uri"] == "store/clean/c0"
    res = cli("lineage", str(child))  # run from the repository, not from work/
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith("numbers n0") and lines[1].strip().startswith("clean c0")
    assert lines[1].rstrip().endswith(str(tmp_path / "work" / "store" / "clean" / "c0"))
    assert ArtifactStore(str(tmp_path / "work" / "store")).versions("clean") == ["c0"]


def test_full_profile_without_the_data_lists_every_missing_input_before_any_server():
    started = time.monotonic()
    res = cli("run", "prepare", "--config", "configs/full.yaml")
    line = one_error(res, "2 input(s) not found", "corpus_uri /data/zhwiki/", "embeddings_uri tar://")
    assert "finetune" not in line  # prepare reads no fine-tuning file
    _no_server_started(res)
    res = cli("run", "pipeline", "--config", "configs/full.yaml")
    one_error(res, "5 input(s) not found", "corpus_uri", "embeddings_uri", "finetune.train_uri", "finetune.dev_uri",
              "finetune.test_uri /data/sentiment/chnsenticorp/test.tsv")
    assert time.monotonic() - started < 120  # no Prefect server, no 8-worker Dask cluster


def _one_line_inputs(tmp_path):
    """A one-document corpus and a one-word embeddings file: inputs that exist, for checks made before any stage."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "1", "title": "t", "text": "今天天气很好。"}, ensure_ascii=False) + "\n",
                      encoding="utf-8")
    emb = tmp_path / "e.txt"
    emb.write_text("1 2\n天气 0.1 0.2\n", encoding="utf-8")
    return corpus, emb


def test_a_k_class_label_column_under_binary_is_refused_at_the_start(tmp_path, reviews):
    corpus, emb = _one_line_inputs(tmp_path)
    data = tmp_path / "four.csv"
    data.write_text("review,label\n" + "".join(f"文本{i},{c}\n" for i in range(40) for c in ("好", "差", "中", "乱")),
                    encoding="utf-8")
    store = tmp_path / "store"
    base = ["run", "pipeline", "--store", str(store), "--set", f"prepare.corpus_uri={corpus}",
            "--set", f"prepare.embeddings_uri={emb}", "--set", f"finetune.data_uri={data}"]
    res = cli(*base)
    line = one_error(res, f"finetune.data_uri {data}", "label column 'label' holds 4 classes",
                     "set finetune.classes: any")
    assert "'中', '乱', '好', '差'" in line
    _no_server_started(res)
    assert not store.exists()  # no stage ran


def test_the_label_check_lets_binary_files_with_a_few_bad_labels_through(tmp_path):
    from tasks.finetune.config import FinetuneConfig
    from tasks.prepare.preflight import check_label_classes

    data = tmp_path / "two.csv"
    rows = [f"t{i},{i % 2}\n" for i in range(40)] + ["x,2\n", "y,bad\n"]  # 2 bad labels in 42: rejects, not classes
    data.write_text("review,label\n" + "".join(rows), encoding="utf-8")
    check_label_classes(FinetuneConfig(data_uri=str(data)))
    data.write_text("review,label\n" + "".join(rows) + "".join(f"z{i},2\n" for i in range(10)), encoding="utf-8")
    with pytest.raises(ValueError, match=r"holds 4 classes \('0', '1', '2', 'bad'\)"):
        check_label_classes(FinetuneConfig(data_uri=str(data)))
    check_label_classes(FinetuneConfig(data_uri=str(data), classes="any"))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine whose torch can use CUDA")
def test_device_cuda_where_torch_cannot_use_it_is_one_line_before_any_work(tmp_path):
    import torch

    from tasks.inference.runtime import CUDA_GUIDE, resolve_device

    corpus, emb = _one_line_inputs(tmp_path)
    store = tmp_path / "store"
    res = cli("run", "pretrain", "--store", str(store), "--set", f"prepare.corpus_uri={corpus}", "--set",
              f"prepare.embeddings_uri={emb}", "--set", "pretrain.device=cuda")
    line = one_error(res, "pretrain.device is 'cuda'", CUDA_GUIDE, "or set pretrain.device: cpu")
    if torch.version.cuda is None:  # a CPU build: says so, with its version
        assert f"this torch build has no CUDA (torch {torch.__version__})" in line
    _no_server_started(res)
    assert not store.exists()  # no stage ran
    with pytest.raises(ValueError, match="finetune.device is 'cuda'"):  # the library path too (API, a rank)
        resolve_device("cuda", key="finetune.device")
    assert resolve_device("auto").type == "cpu"

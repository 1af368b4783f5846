"""Checkpoints that cannot tear: each save a step directory of its own, published by one atomic pointer write.

The layout (pointer, step directories, what is kept and removed), resume from the newest complete checkpoint (a
damaged one falls back to the one before), the earlier layout refused, and fault injection: the process killed
after each file operation of a save in turn (``LEXIFLOW_CKPT_KILL_AFTER``), on a local store and on S3 (moto),
then run again, ends on the uninterrupted run's artifact bytes every time. The default suite keeps the one boundary
that tore before (the new weights written, the optimizer not yet); the whole matrix is ``heavy``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import fsspec
import pyarrow as pa
import pytest
import torch
from safetensors.torch import save as st_save

from storage.parquet import table_bytes
from tasks.pretrain.data import rows_of
from tasks.pretrain.stage import learned
from tasks.pretrain.train import train
from tasks.training import checkpoint
from tasks.training.checkpoint import (
    KILL_AFTER_ENV,
    POINTER,
    TrainState,
    latest_state,
    load_checkpoint,
    published,
    save_checkpoint,
    weights,
)
from tests.test_pretrain import WV, V, W, _cfg, _rows

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the smallest run that saves three times (steps 2, 4, 6): the third save removes the first checkpoint
TINY = dict(steps=6, log_every=2, checkpoint_every=2, warmup_steps=1,
            model={"hidden_size": 16, "num_layers": 1, "num_heads": 2, "ffn_size": 32, "hidden_dropout": 0.1,
                   "attention_dropout": 0.1, "max_len": 64},
            data={"max_seq_len": 32, "batch_size": 4, "bucket_batches": 2, "loader_workers": 0})
# file operations of TINY's saves: per save makedirs, 2 files, pointer (local: written, renamed); the third save
# removes step 2
LOCAL_OPS = [f"{s}:{op}" for s in (2, 4, 6) for op in ("mkdir", "weights", "trainer", "pointer.tmp", "rename")] \
    + ["6:remove step 2"]
S3_OPS = [f"{s}:{op}" for s in (2, 4, 6) for op in ("mkdir", "weights", "trainer", "pointer")] + ["6:remove step 2"]


def artifact_bytes(model, log) -> dict[str, bytes]:
    """The pretrain artifact's data files as the stage writes them (:func:`tasks.pretrain.stage.run_pretrain_stage`)."""
    return {"model.safetensors": st_save(weights(model), metadata={"format": "pt"}),
            "log.parquet": table_bytes(pa.Table.from_pylist(learned(log)))}


def _train(fs=None, path=None, **kw):
    model, log = train(_cfg(**{**TINY, **kw}), rows_of(_rows()), V, WV, W, fs, path, progress=False)
    return artifact_bytes(model, log)


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, bytes]:
    return _train()


# ----------------------------------------------------------------------------- layout and resume rule


def _toy():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched


def _save(fs, path, step, model=None):
    model, opt, sched = _toy() if model is None else (model, *_toy()[1:])
    with torch.no_grad():
        model.weight.fill_(float(step))
    save_checkpoint(fs, path, model, opt, sched, TrainState(step=step, log=[{"step": step}]))


def test_each_save_is_a_step_directory_published_by_the_pointer_and_two_are_kept(mem):
    fs, path = fsspec.core.url_to_fs(f"{mem}/ck")
    for step in (2, 4, 6):
        _save(fs, path, step)
    entries = published(fs, path)
    assert [(e["step"], e["dir"]) for e in entries] == [(6, "step-00000006"), (4, "step-00000004")]
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(path, detail=False)) == [POINTER, "step-00000004",
                                                                               "step-00000006"]
    for e in entries:  # the pointer names every file with its size and digest
        assert sorted(e["files"]) == ["model.safetensors", "trainer.pt"]
        assert e["files"]["trainer.pt"]["bytes"] == fs.size(f"{path}/{e['dir']}/trainer.pt")
    model, opt, sched = _toy()
    assert load_checkpoint(fs, path, model, opt, sched).step == 6
    assert float(model.weight[0, 0].detach()) == 6.0


def test_keep_checkpoints_one_leaves_only_the_newest_and_the_same_bytes(tmp_path, uninterrupted):
    """``pretrain.keep_checkpoints: 1``: each save, once published, removes the one before (half the disk); the run
    ends on the same bytes, resumed or not, and the setting never enters the pretrain version."""
    from tasks.pretrain.config import PretrainConfig

    fs, path = fsspec.filesystem("file"), str(tmp_path / "ck")
    n = LOCAL_OPS.index("4:rename") + 1  # killed right after the second save published: resumes from step 4
    script_cfg = {**TINY, "keep_checkpoints": 1}
    _killed_after(n, "file", {}, path, tmp_path, script_cfg)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [POINTER, "step-00000002", "step-00000004"]
    assert [e["step"] for e in published(fs, path)] == [4]  # the pointer names one; step 2 goes with the next save
    assert _train(fs, path, keep_checkpoints=1) == uninterrupted
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [POINTER, "step-00000006"]
    with pytest.raises(ValueError, match="at least the checkpoint just written"):
        save_checkpoint(fs, str(tmp_path / "none"), *_toy(), TrainState(step=1), keep=0)
    dump = _cfg(**script_cfg).model_dump(mode="json", exclude=PretrainConfig.NOT_VERSIONED)
    assert dump == _cfg(**TINY).model_dump(mode="json", exclude=PretrainConfig.NOT_VERSIONED)
    assert "keep_checkpoints" not in _cfg(**TINY).model_dump(mode="json")  # the default: not even in a dump


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(mem, caplog):
    fs, path = fsspec.core.url_to_fs(f"{mem}/ck")
    for step in (2, 4):
        _save(fs, path, step)
    fs.pipe(f"{path}/step-00000004/trainer.pt", b"not the trainer state that was published")
    model, opt, sched = _toy()
    assert load_checkpoint(fs, path, model, opt, sched).step == 2
    assert float(model.weight[0, 0].detach()) == 2.0
    assert any("not the file that was published" in r.getMessage() for r in caplog.records)
    fs.rm(f"{path}/step-00000002", recursive=True)  # nothing complete left: training starts over
    assert load_checkpoint(fs, path, *_toy()) is None


def test_a_save_removes_an_interrupted_saves_directory_and_a_fallback_drops_the_newer(mem):
    fs, path = fsspec.core.url_to_fs(f"{mem}/ck")
    for step in (2, 4):
        _save(fs, path, step)
    fs.pipe(f"{path}/step-00000005/model.safetensors", b"half a save")  # killed before its publish
    _save(fs, path, 3)  # a run that fell back to step 2 saves step 3: 4 was in the future it redoes
    assert [e["step"] for e in published(fs, path)] == [3, 2]
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(path, detail=False)) == [POINTER, "step-00000002",
                                                                               "step-00000003"]


def test_a_checkpoint_of_the_earlier_layout_is_refused_with_a_way_out(mem):
    fs, path = fsspec.core.url_to_fs(f"{mem}/ck")
    for name in ("model.safetensors", "trainer.pt"):
        fs.pipe(f"{path}/{name}", b"x")
    fs.pipe(f"{path}/state.json", json.dumps({"step": 4}).encode())
    with pytest.raises(ValueError, match="earlier layout.*Remove that directory to train this version from its start"):
        load_checkpoint(fs, path, *_toy())


# ----------------------------------------------------------------------------- fault injection

SCRIPT = textwrap.dedent("""
    import json, sys
    import fsspec
    from tasks.pretrain.data import rows_of
    from tasks.pretrain.train import train
    from tests.test_pretrain import WV, V, W, _cfg, _rows

    spec = json.loads(sys.argv[1])
    fs = fsspec.filesystem(spec["protocol"], **spec["options"])
    train(_cfg(**spec["cfg"]), rows_of(_rows()), V, WV, W, fs, spec["path"], progress=False)
""")


def _killed_after(n: int, protocol: str, options: dict, path: str, tmp_path: Path, cfg: dict | None = None) -> None:
    """A training run (``cfg``, default TINY) in a subprocess that dies right after the n-th file operation of its
    saves."""
    script = tmp_path / "ckpt_run.py"
    script.write_text(SCRIPT)
    spec = {"protocol": protocol, "options": options, "path": path, "cfg": cfg or TINY}
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0", KILL_AFTER_ENV: str(n)}
    proc = subprocess.run([sys.executable, str(script), json.dumps(spec)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 137, f"not killed after operation {n}: rc {proc.returncode}\n{proc.stderr[-3000:]}"


def _count_ops(fs, path) -> int:
    before = checkpoint._ops
    _train(fs, path)
    return checkpoint._ops - before


def test_a_kill_between_the_new_weights_and_the_optimizer_resumes_to_the_same_bytes(tmp_path, uninterrupted):
    """The boundary that tore before (a save moved the new weights beside the previous save's optimizer and
    state): killed right after the second save wrote its weights. The rerun resumes from the first checkpoint and
    ends on the uninterrupted run's bytes."""
    fs, path = fsspec.filesystem("file"), str(tmp_path / "ck")
    n = LOCAL_OPS.index("4:weights") + 1
    _killed_after(n, "file", {}, path, tmp_path)
    assert (tmp_path / "ck" / "step-00000004" / "model.safetensors").exists()
    assert not (tmp_path / "ck" / "step-00000004" / "trainer.pt").exists()
    assert latest_state(fs, path).step == 2  # the half-written save is not published
    assert _train(fs, path) == uninterrupted
    assert [e["step"] for e in published(fs, path)] == [6, 4]


@pytest.mark.heavy  # about 30 killed runs and their reruns: make test-heavy
def test_a_kill_after_any_file_operation_of_a_save_resumes_to_the_same_bytes_locally(tmp_path, uninterrupted):
    fs = fsspec.filesystem("file")
    assert _count_ops(fs, str(tmp_path / "count")) == len(LOCAL_OPS), "the list of boundaries is out of date"
    for n, op in enumerate(LOCAL_OPS, 1):
        path = str(tmp_path / f"ck{n}")
        _killed_after(n, "file", {}, path, tmp_path)
        assert _train(fs, path) == uninterrupted, f"killed after {op}"
        assert [e["step"] for e in published(fs, path)] == [6, 4], op


@pytest.mark.heavy
def test_a_kill_after_any_file_operation_of_a_save_resumes_to_the_same_bytes_on_s3(tmp_path, moto_server,
                                                                                    uninterrupted):
    """On S3 (moto) a save has no rename: the pointer is one PUT, visible whole or not at all."""
    pytest.importorskip("s3fs")
    options = {"endpoint_url": moto_server, "key": "AKIDLEXIFLOWTEST", "secret": "moto", "skip_instance_cache": True}
    fs = fsspec.filesystem("s3", **options)
    bucket = f"ckpt-{uuid.uuid4().hex[:8]}"
    fs.mkdir(bucket)
    assert _count_ops(fs, f"{bucket}/count") == len(S3_OPS), "the list of boundaries is out of date"
    for n, op in enumerate(S3_OPS, 1):
        path = f"{bucket}/ck{n}"
        _killed_after(n, "s3", options, path, tmp_path)
        fs.invalidate_cache()
        assert _train(fs, path) == uninterrupted, f"killed after {op}"
        assert [e["step"] for e in published(fs, path)] == [6, 4], op


def test_a_ranks_cuda_rng_state_is_its_own_devices_and_an_older_all_gpus_one_still_resumes(monkeypatch, caplog):
    """The CUDA RNG restore picks one state for the rank's own device: a checkpoint now holds just that one; one
    written before held every visible GPU's (``get_rng_state_all``), and a machine with fewer GPUs than that one
    resumes with a warning instead of an IndexError. (The CUDA calls are recorded: this machine has no GPU.)"""
    restored: list[tuple[bytes, str]] = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((bytes(state), str(device))))
    cpu = torch.get_rng_state()

    def states(n):
        return [torch.full((8,), i, dtype=torch.uint8) for i in range(n)]

    checkpoint._restore_rng({"torch_rng": cpu, "cuda_rng": states(1)}, torch.device("cuda", 3))  # saved now: one
    checkpoint._restore_rng({"torch_rng": cpu, "cuda_rng": states(8)}, torch.device("cuda", 3))  # older: all 8
    checkpoint._restore_rng({"torch_rng": cpu, "cuda_rng": states(8)}, torch.device("cpu"))  # a CPU run: none
    with caplog.at_level("WARNING", logger="lexiflow"):
        checkpoint._restore_rng({"torch_rng": cpu, "cuda_rng": states(2)}, torch.device("cuda", 5))  # 2-GPU machine
    assert restored == [(bytes([0] * 8), "cuda:3"), (bytes([3] * 8), "cuda:3")]
    assert "no CUDA RNG state for cuda:5 (it was written on a machine with 2 GPUs)" in caplog.text
    assert checkpoint.rng_state(torch.device("cpu"))["cuda_rng"] == []  # a CPU run saves no CUDA state

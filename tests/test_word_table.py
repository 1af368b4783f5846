"""The adapter's word table trained sparsely (``pretrain.model.word_table: sparse``): rows the batch touched only.

Row-wise AdamW against ``torch.optim.AdamW`` (every row touched: the same update; some rows: each row as if it had
its own AdamW, stepped when touched, and the others untouched, state included); the global clipping norm as dense
clipping's; the config (freeze_word_vectors and word_table, one setting; the default left out of every dump, so
versions do not move); a CPU run that learns, agrees with dense where the two are comparable, leaves rows no batch
used bitwise as loaded, resumes from a checkpoint to the same bytes, and under DDP averages the rows over the ranks.
"""

from __future__ import annotations

import datetime
import io
import json
import uuid

import fsspec
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pydantic import ValidationError
from safetensors.torch import load as st_load

from models import LebertForPretraining, ModelConfig
from tasks.pretrain.config import PretrainConfig, PretrainModel
from tasks.pretrain.data import rows_of
from tasks.pretrain.stage import STAGE
from tasks.pretrain.train import train
from tasks.training.checkpoint import newest_complete
from tasks.training.loop import optimizer_step
from tasks.training.row_adam import RowAdamW, SparseRows
from tests.test_checkpoint import TINY, artifact_bytes
from tests.test_pretrain import WV, V, W, _cfg, _rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LR, BETAS, WD = 1e-2, (0.9, 0.98), 0.01


def _pair(rows=6, dim=4, wd=WD):
    torch.manual_seed(0)
    table = torch.randn(rows, dim)
    ref = torch.nn.Parameter(table.clone())
    return table, RowAdamW(table, LR, BETAS, weight_decay=wd), ref


def test_every_row_touched_is_torch_adamw():
    table, row, ref = _pair()
    opt = torch.optim.AdamW([ref], lr=LR, betas=BETAS, weight_decay=WD, foreach=False)
    for k in range(5):
        g = torch.randn_like(table)
        lr = LR * (k + 1) / 5  # a schedule: the LR of each step is passed in
        opt.param_groups[0]["lr"] = lr
        ref.grad = g.clone()
        opt.step()
        row.step(torch.arange(table.shape[0]), g, lr)
        torch.testing.assert_close(table, ref.detach(), rtol=0, atol=1e-7)
    assert row.step_count.tolist() == [5] * 6


def test_touched_rows_step_with_their_own_state_and_the_others_keep_their_bytes():
    table, row, _ = _pair()
    start = table.clone()
    refs = [torch.nn.Parameter(table[i:i + 1].clone()) for i in range(table.shape[0])]
    opts = [torch.optim.AdamW([p], lr=LR, betas=BETAS, weight_decay=WD, foreach=False) for p in refs]
    for ids in ([1, 3], [3, 4], [1]):
        g = torch.randn(len(ids), table.shape[1])
        before = (table.clone(), row.exp_avg.clone(), row.exp_avg_sq.clone())
        row.step(torch.tensor(ids), g)
        for j, i in enumerate(ids):  # each touched row: AdamW over that row alone, stepped when it is touched
            refs[i].grad = g[j:j + 1].clone()
            opts[i].step()
            torch.testing.assert_close(table[i:i + 1], refs[i].detach(), rtol=0, atol=1e-7)
        others = [i for i in range(table.shape[0]) if i not in ids]
        for t, b in zip((table, row.exp_avg, row.exp_avg_sq), before):
            assert torch.equal(t[others], b[others])  # untouched: the same bytes, state included
    assert row.step_count.tolist() == [0, 2, 0, 2, 1, 0]  # each row counts its own steps (its bias correction)
    assert torch.equal(table[[0, 2, 5]], start[[0, 2, 5]])
    assert not row.exp_avg[[0, 2, 5]].any() and not row.exp_avg_sq[[0, 2, 5]].any()


def test_state_round_trips():
    table, row, _ = _pair()
    row.step(torch.tensor([2, 4]), torch.randn(2, 4))
    sd = row.state_dict()
    other = RowAdamW(table.clone(), LR, BETAS, weight_decay=WD)
    other.load_state_dict(torch.load(io.BytesIO(_saved(sd)), weights_only=True))
    for a, b in ((other.exp_avg, row.exp_avg), (other.exp_avg_sq, row.exp_avg_sq), (other.step_count, row.step_count)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="shape"):
        RowAdamW(torch.zeros(3, 4), LR).load_state_dict(sd)


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_the_static_step_is_the_step_on_real_rows_and_padding_changes_nothing(tensor_lr):
    # the captured form: every entry of a padded [R] computed, the [PAD] padding (id 0, repeated) written back as it
    # was read. The real rows must get what step gives them: the same ops on the same values, row by row (odd sizes,
    # so the kernels' vector bodies and scalar tails both run; other tensor sizes, so float tolerance, not bits)
    table, row, _ = _pair(rows=11, dim=5)
    twin = RowAdamW(table.clone(), LR, BETAS, weight_decay=WD)
    for k, real in enumerate(([3, 7, 1], [7, 9], [2, 3, 7, 10, 4])):
        lr = LR * (k + 1) / 3
        lr = torch.tensor(lr, dtype=torch.float32) if tensor_lr else lr  # a capturable optimizer's LR
        ids = torch.tensor([0, *real] + [0] * (9 - len(real)))  # [PAD] first, then padding: R = 10
        grad = torch.randn(len(ids), 5)  # padding and [PAD] with gradients too: they must still change nothing
        before = [t.clone() for t in (table, row.exp_avg, row.exp_avg_sq, row.step_count)]
        row.step_static(ids, grad, lr)
        twin.step(torch.tensor(real), grad[1:1 + len(real)], lr)
        for mine, ref in ((table, twin.table), (row.exp_avg, twin.exp_avg), (row.exp_avg_sq, twin.exp_avg_sq),
                          (row.step_count, twin.step_count)):
            torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-7)  # real rows as step makes them
        others = [i for i in range(11) if i not in real]
        assert 0 in others
        for t, b in zip((table, row.exp_avg, row.exp_avg_sq, row.step_count), before):
            assert torch.equal(t[others], b[others])  # [PAD] and untouched rows: bitwise, state included
    assert row.step_count[0] == 0 and not row.exp_avg[0].any()


def test_the_captured_rows_are_the_gathered_ones_and_step_as_the_ordinary_step():
    table = torch.randn(50, 3)
    ids = torch.tensor([[[0, 7, 0], [42, 7, 3]], [[3, 0, 0], [49, 42, 0]]])
    a, b = SparseRows(table.clone(), LR, BETAS, WD, fixed_shape=True), SparseRows(table.clone(), LR, BETAS, WD)
    local_a, row_ids = a.index(ids)
    local_b, rows_b = b.gather(ids)
    assert row_ids.shape == (ids.numel() + 1,) and row_ids[5:].eq(0).all()  # [PAD], 4 words, [PAD] padding
    rows_a = a.rows_of(row_ids)
    assert rows_a.is_leaf and rows_a.requires_grad and torch.equal(rows_a[local_a], rows_b[local_b])
    g = torch.randn(3)
    rows_a[local_a].mul(g).sum().backward()
    rows_b[local_b].mul(g).sum().backward()
    a.step_static(row_ids, rows_a, LR)
    b.step(LR)
    torch.testing.assert_close(a.table, b.table, rtol=1e-6, atol=1e-7)  # padded rows vs the words alone
    assert torch.equal(a.optimizer.step_count, b.optimizer.step_count)


def _saved(obj) -> bytes:
    b = io.BytesIO()
    torch.save(obj, b)
    return b.getvalue()


def test_gather_renumbers_into_rows_that_are_the_tables():
    table = torch.randn(50, 3)
    ids = torch.tensor([[[0, 7, 0], [42, 7, 3]], [[3, 0, 0], [49, 42, 0]]])
    for fixed in (False, True):
        rows = SparseRows(table, LR, BETAS, WD, fixed_shape=fixed)
        local, gathered = rows.gather(ids)
        assert gathered.requires_grad and gathered.is_leaf
        assert torch.equal(gathered[local], table[ids])  # the same vectors: the same forward
        assert torch.equal(local == 0, ids == 0)  # [PAD] stays 0
        assert gathered.shape[0] == (ids.numel() + 1 if fixed else 5)  # [PAD] + 4 distinct words
        assert rows._ids.tolist() == [3, 7, 42, 49]


def _model(word_table: str, wd: float = 0.0) -> tuple[LebertForPretraining, SparseRows | None]:
    torch.manual_seed(3)
    mc = ModelConfig(vocab_size=20, hidden_size=16, num_layers=1, num_heads=2, ffn_size=32, hidden_dropout=0.0,
                     attention_dropout=0.0, max_len=16, word_vocab_size=30, word_dim=8, max_word_num=2)
    m = LebertForPretraining(mc)
    m.load_word_vectors(torch.randn(30, 8), freeze=word_table != "dense")
    rows = SparseRows(m.encoder.adapter.word_embeddings.weight, LR, BETAS, wd) if word_table == "sparse" else None
    return m, rows


def _batch(seed: int, words: range) -> tuple[torch.Tensor, ...]:
    """A batch whose word slots use every id of ``words`` (and [PAD])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 20, (2, 8), generator=g)
    slots = torch.cat([torch.tensor(list(words)), torch.zeros(32 - len(words), dtype=torch.int64)])
    words_ = slots[torch.randperm(32, generator=g)].view(2, 8, 2)
    return ids, words_, torch.tensor([1, 4, 9]), torch.tensor([3, 5, 7]), torch.tensor([0, 1])


def _steps(kind: str, batches, wd: float = 0.0, clip: float = 0.05, wrap=lambda m: m):
    """(losses, grad norms, word table) after one optimizer step per batch; ``clip`` small: the clipping bites."""
    m, rows = _model(kind, wd)
    fwd = wrap(m)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR, betas=BETAS, weight_decay=wd,
                            foreach=False)
    losses, norms = [], []
    for ids, words, pos, labels, nsp in batches:
        extra = {}
        if rows is not None:
            words, extra["word_rows"] = rows.gather(words)
        out = fwd(ids, None, None, words, pos, labels, nsp, **extra)
        norms.append(float(optimizer_step(opt, out.loss, m.parameters(), clip, rows)))
        losses.append(float(out.loss.detach()))
    return losses, norms, m.encoder.adapter.word_embeddings.weight.detach().clone()


def test_one_step_clips_and_updates_as_dense_does():
    batch = _batch(0, range(1, 12))  # rows 12..29 untouched
    (ld, nd, td), (ls, ns, ts) = _steps("dense", [batch]), _steps("sparse", [batch])
    assert ld == ls  # the same forward
    assert nd[0] > 0.05 and ns[0] == pytest.approx(nd[0], rel=1e-6)  # the table's rows count in the norm alike
    torch.testing.assert_close(ts, td, rtol=0, atol=1e-6)  # clipped alike, stepped alike (no decay, first step)
    assert torch.equal(ts[12:], _model("sparse")[0].encoder.adapter.word_embeddings.weight[12:])  # bitwise


def test_where_every_row_is_touched_on_every_step_sparse_is_dense():
    # lazy and dense AdamW differ on the rows a step did not touch (dense moves them by their momentum and decays
    # them); with every row in every batch they make the same updates, up to the order of float sums
    batches = [_batch(k, range(1, 30)) for k in range(4)]
    (ld, nd, td), (ls, ns, ts) = _steps("dense", batches, wd=0.01), _steps("sparse", batches, wd=0.01)
    np.testing.assert_allclose(ls, ld, rtol=1e-5)
    np.testing.assert_allclose(ns, nd, rtol=1e-5)
    torch.testing.assert_close(ts[1:], td[1:], rtol=0, atol=1e-5)  # row 0, [PAD], is never a sparse row


# ----------------------------------------------------------------------------------------------------------- config


def test_freeze_word_vectors_is_word_table_freeze_and_a_contradiction_is_an_error():
    assert PretrainModel(freeze_word_vectors=True).word_table == "freeze"
    assert PretrainModel(word_table="freeze").freeze_word_vectors is True
    # one setting, dumped as it always was: the same dump, so the same version
    assert PretrainModel(word_table="freeze").model_dump() == PretrainModel(freeze_word_vectors=True).model_dump()
    for other in ("sparse", "dense"):
        with pytest.raises(ValidationError, match="freeze_word_vectors true keeps the word vectors fixed"):
            PretrainModel(freeze_word_vectors=True, word_table=other)
    PretrainModel(freeze_word_vectors=True, word_table="freeze")  # saying it twice is fine


def test_the_default_is_left_out_of_every_dump_so_versions_do_not_move():
    default = PretrainConfig()
    dumped = default.model_dump(mode="json")["model"]
    # the model section dumps exactly the keys it dumped before word_table existed: the shape and freeze_word_vectors
    assert set(dumped) == set(PretrainModel.model_fields) - {"word_table"}
    assert "word_table" not in json.dumps(STAGE.version_config(default))
    before = {**dumped}  # what a config without the field validates to
    assert PretrainConfig(model=before).model_dump() == default.model_dump()
    assert STAGE.version_config(PretrainConfig(model={"word_table": "dense"})) == STAGE.version_config(default)
    assert STAGE.version_config(PretrainConfig(model={"word_table": "freeze"})) == \
        STAGE.version_config(PretrainConfig(model={"freeze_word_vectors": True}))
    sparse = STAGE.version_config(PretrainConfig(model={"word_table": "sparse"}))
    assert sparse != STAGE.version_config(default) and sparse["model"]["word_table"] == "sparse"  # other weights


def test_the_gpu_profiles_train_the_table_sparsely_and_the_cpu_ones_densely():
    from pathlib import Path

    from flows.config import PipelineConfig, load_config

    root = Path(__file__).resolve().parents[1]
    for path in sorted((root / "configs").glob("*.yaml")):
        cfg = load_config(PipelineConfig, path, []).pretrain
        want = "sparse" if cfg.device == "cuda" else "dense"
        assert cfg.model.word_table == want, path.name


# --------------------------------------------------------------------------------------------------------- training

SPARSE = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "ffn_size": 64, "hidden_dropout": 0.1,
          "attention_dropout": 0.1, "max_len": 64, "word_table": "sparse"}
WV8 = np.concatenate([WV, np.random.default_rng(2).normal(size=(3, WV.shape[1])).astype(np.float32)])  # 5..7 unused


def _table(model) -> torch.Tensor:
    return model.encoder.adapter.word_embeddings.weight.detach()


def test_a_sparse_run_learns_and_leaves_the_rows_no_batch_used_as_loaded():
    cfg = _cfg(steps=80, log_every=10, lr=3e-3, warmup_steps=5, model={**SPARSE, "hidden_dropout": 0.0,
                                                                         "attention_dropout": 0.0})
    model, log = train(cfg, rows_of(_rows(n_docs=10)), V, WV8, W, progress=False)
    assert log[-1]["mlm_loss"] < log[0]["mlm_loss"] - 0.25, [r["mlm_loss"] for r in log]
    table = _table(model)
    assert torch.equal(table[5:], torch.from_numpy(WV8[5:]))  # never in a batch: bitwise as loaded
    assert not torch.equal(table[1:5], torch.from_numpy(WV8[1:5]))  # the words the batches used were trained


def test_a_sparse_run_resumes_from_its_checkpoint_to_the_same_bytes():
    kw = {**TINY, "model": {**TINY["model"], "word_table": "sparse"}}
    cfg = _cfg(**kw)
    whole = artifact_bytes(*train(cfg, rows_of(_rows()), V, WV, W, progress=False))
    fs, ck = fsspec.filesystem("memory"), f"/ck-{uuid.uuid4().hex}"
    train(cfg, rows_of(_rows()), V, WV, W, fs, ck, stop_at=4, progress=False)
    entry = newest_complete(fs, ck)
    saved = st_load(fs.cat_file(f"{ck}/{entry['dir']}/rows.safetensors"))  # a file of its own, streamed
    steps = saved["step"]  # the rows' optimizer state travels with the checkpoint
    assert 0 < steps.max() <= 4 and steps[0] == 0  # ([PAD] never steps)
    resumed = artifact_bytes(*train(cfg, rows_of(_rows()), V, WV, W, fs, ck, progress=False))
    assert resumed == whole


# -------------------------------------------------------------------------------------------------------------- DDP


def _ddp_rank(rank: int, tmp: str) -> None:
    try:
        _ddp_rank_body(rank, tmp)
    except BaseException:  # SystemExit too, which leaves no traceback behind: keep it for the assertion
        import traceback

        with open(f"{tmp}/rank{rank}.err", "w") as f:
            f.write(traceback.format_exc())
        raise


def _ddp_rank_body(rank: int, tmp: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from tasks.training import collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        ids = torch.tensor([[1, 4, 7], [4, 9]][rank])
        grads = torch.full((ids.numel(), 2), float(rank + 1)) * ids[:, None]
        # padded to a capacity of 4 each, the union's static size min(2 x 4, the table's 10 rows): 8
        union, avg = collectives.average_rows(collectives.gather_row_ids(ids, 4, 2), grads, 10)
        out = {"union": union.tolist(), "avg": avg.tolist()}
        # each rank's batches touch its half of the rows (and a few of the other's): their union is every row
        words = [range(1, 18), range(12, 30)][rank]
        batches = [_batch(10 * k + rank, words) for k in range(3)]
        for kind in ("dense", "sparse"):
            losses, norms, table = _steps(kind, batches, wd=0.01, wrap=DistributedDataParallel)
            out[kind] = {"table": table.tolist(), "loss": losses, "norm": norms}
        cfg = _cfg(steps=3, model=SPARSE)  # the stage's loop under DDP, sparse
        out["train"] = _table(train(cfg, rows_of(_rows()), V, WV, W, progress=False)[0]).tolist()
    finally:
        collectives.shutdown()
    with open(f"{tmp}/rank{rank}.json", "w") as f:
        json.dump(out, f)


@pytest.mark.timeout(180)  # two ranks: a wedged rank must fail the test, not hang the suite
def test_under_ddp_the_rows_are_averaged_over_the_ranks_as_dense_ddp_averages_the_table(tmp_path):
    # spawned, not forked: a fork of a pytest worker inherits whatever earlier tests left running in it (one
    # such run exited with code 1 after its last step, under the full suite only)
    try:
        mp.spawn(_ddp_rank, args=(str(tmp_path),), nprocs=2, join=True)
    except mp.ProcessExitedException as e:
        errs = "".join(p.read_text() for p in sorted(tmp_path.glob("rank*.err")))
        raise AssertionError(f"a rank failed: {e}\n{errs}") from e
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for out in got:
        assert out["union"] == [0, 1, 4, 7, 9, 0, 0, 0]  # [PAD] (the padding) first, then [PAD] to the static size
        # row 4: rank 0 gives 1*4, rank 1 gives 2*4 -> (4 + 8) / 2; the others from one rank, halved; padding 0
        assert out["avg"] == [[0.0, 0.0], [0.5, 0.5], [6.0, 6.0], [3.5, 3.5], [9.0, 9.0]] + [[0.0, 0.0]] * 3
        np.testing.assert_allclose(out["sparse"]["loss"], out["dense"]["loss"], rtol=1e-5)
        np.testing.assert_allclose(out["sparse"]["norm"], out["dense"]["norm"], rtol=1e-5)
        np.testing.assert_allclose(np.array(out["sparse"]["table"])[1:], np.array(out["dense"]["table"])[1:],
                                   rtol=0, atol=1e-5)
    assert got[0]["sparse"]["table"] == got[1]["sparse"]["table"]  # every rank holds the same table
    assert got[0]["train"] == got[1]["train"]


def test_a_sparse_checkpoint_written_before_the_rows_had_their_own_file_still_resumes_to_the_same_bytes():
    """A checkpoint of the earlier save (the rows' AdamW state inside ``trainer.pt``, the weights serialised
    whole by ``safetensors.torch.save``) resumes, read by the streaming loader, to the uninterrupted bytes."""
    import hashlib
    import json

    from safetensors.torch import save as st_save

    kw = {**TINY, "model": {**TINY["model"], "word_table": "sparse"}}
    cfg = _cfg(**kw)
    whole = artifact_bytes(*train(cfg, rows_of(_rows()), V, WV, W, progress=False))
    fs, ck = fsspec.filesystem("memory"), f"/ck-{uuid.uuid4().hex}"
    train(cfg, rows_of(_rows()), V, WV, W, fs, ck, stop_at=4, progress=False)
    pointer = json.loads(fs.cat_file(f"{ck}/latest.json"))
    for entry in pointer["checkpoints"]:  # rewritten as the earlier save wrote them
        where = f"{ck}/{entry['dir']}"
        trainer = torch.load(io.BytesIO(fs.cat_file(f"{where}/trainer.pt")), weights_only=True)
        trainer["word_table"] = {**trainer["word_table"], **st_load(fs.cat_file(f"{where}/rows.safetensors"))}
        blob = io.BytesIO()
        torch.save(trainer, blob)
        files = {"model.safetensors": st_save(st_load(fs.cat_file(f"{where}/model.safetensors"))),
                 "trainer.pt": blob.getvalue()}
        fs.rm(f"{where}/rows.safetensors")
        for name, data in files.items():
            fs.pipe_file(f"{where}/{name}", data)
        entry["files"] = {k: {"bytes": len(v), "sha256": hashlib.sha256(v).hexdigest()} for k, v in files.items()}
    fs.pipe_file(f"{ck}/latest.json", json.dumps(pointer).encode())
    resumed = artifact_bytes(*train(cfg, rows_of(_rows()), V, WV, W, fs, ck, progress=False))
    assert resumed == whole

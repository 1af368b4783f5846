"""Model selection, really exercised: a scripted schedule makes the dev metric peak at epoch 1 and then fall
(after the first evaluation the training step ascends the loss instead of descending it), and the test
recomputes dev AUC (fine-tuning) and dev entity F1 (NER) from the *saved* weights of the committed artifact.
Shipping the last epoch's weights with the best epoch's metadata would make the recomputed metric differ."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from sklearn.metrics import roc_auc_score

from models import LebertClassifier, LebertForPretraining, ModelConfig
from storage.artifacts import ArtifactStore
from tasks.text.featurize import Featurizer
from tasks.training.checkpoint import weights
from tests.staging import begin


def _ascend_after_first_epoch(module, monkeypatch) -> None:
    """Wrap ``module.fit`` so that every step after the first evaluation maximises the loss: the dev metric
    peaks at epoch 1 and falls, whatever the data (the scripted schedule the selection logic must survive)."""
    real_fit = module.fit

    def scripted_fit(model, opt, lengths, batch_loss, evaluate, *args, **kwargs):
        evaluated = [0]

        def loss(model, idx):
            value, n, out = batch_loss(model, idx)
            return (-value if evaluated[0] else value), n, out

        def report(model, batches, outs):
            evaluated[0] += 1
            return evaluate(model, batches, outs)

        return real_fit(model, opt, lengths, loss, report, *args, **kwargs)

    monkeypatch.setattr(module, "fit", scripted_fit)


def _store_with_pretrain(mc: ModelConfig):
    torch.manual_seed(1)
    store = ArtifactStore(f"memory://select-{uuid.uuid4().hex}")
    w = begin(store, "pretrain", "p1")
    w.write_bytes("model.safetensors", st_save(weights(LebertForPretraining(mc))))
    w.write_bytes("model_config.json", json.dumps(mc.model_dump()).encode())
    pre = w.commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
    lex = begin(store, "lexicon", "l1").commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
    return store, pre, lex


def _epochs(art) -> list[dict]:
    with art.open("epochs.parquet") as f:
        return pq.read_table(f).to_pylist()


def test_finetune_ships_the_best_epochs_weights(tmp_path, monkeypatch):
    from tasks.common.labelled import read_labelled
    from tasks.finetune import train as ft
    from tasks.finetune.config import FinetuneConfig
    from tests.test_finetune import _featurizer, _model_cfg, _synthetic_csv

    data = tmp_path / "s.csv"
    _synthetic_csv(data)
    cfg = FinetuneConfig(data_uri=str(data), max_len=32, use_layers=2, dropout=0.1, batch_size=16, lr=3e-3,
                         max_epochs=4, patience=3, threads=1, device="cpu", max_eval_rows=30,
                         combine="none")  # dev predictions are the encoder's own
    feat = _featurizer(32)
    store, pre, lex = _store_with_pretrain(_model_cfg())
    monkeypatch.setattr(Featurizer, "from_artifacts", lambda art, max_len=256: feat)
    _ascend_after_first_epoch(ft, monkeypatch)

    writer = begin(store, "finetune", "f1")
    res = ft.run_finetune_stage(writer, cfg, pre.uri, lex.uri, progress=False)
    art = writer.commit(code_version="t", config={}, parents=[], stats=res.stats, metrics=res.metrics, rows=res.rows)
    log = _epochs(art)
    dev_auc = [r["dev_auc"] for r in log]
    assert res.metrics["best_epoch"] == 1 and len(log) == 4, dev_auc  # patience 3: epochs 2-4 never improve
    assert dev_auc[0] > 0.9 and max(dev_auc[1:]) < dev_auc[0] - 0.2, dev_auc  # the peak is early, then it falls

    # the saved classifier, reloaded as the bundle reloads it, scores the dev rows with the best epoch's AUC
    mcj = json.loads(art.read_verified("model_config.json"))
    clf = LebertClassifier(ModelConfig.model_validate(mcj["model"]), mcj["use_layers"], mcj["dropout"])
    clf.load_state_dict(st_load(art.read_verified("model.safetensors")))
    clf.eval()
    with art.open("dev_predictions.parquet") as f:
        dev = pq.read_table(f).to_pylist()
    text = {r["row_id"]: r["text"] for r in read_labelled(str(data), cfg)[0]}
    enc = feat.encode([text[r["row_id"]] for r in dev])
    with torch.no_grad():
        prob = [float(torch.sigmoid(clf(torch.from_numpy(e.input_ids)[None], None,
                                        torch.from_numpy(e.word_ids)[None]))) for e in enc]
    recomputed = roc_auc_score([r["label"] for r in dev], prob)
    assert recomputed == pytest.approx(dev_auc[0], abs=1e-6)
    assert res.metrics["dev_auc"] == pytest.approx(recomputed, abs=1e-6)
    assert np.allclose(prob, [r["prob"] for r in dev], atol=1e-5)


def test_ner_ships_the_best_epochs_weights(tmp_path, monkeypatch):
    from tasks.inference.ner import NerModel
    from tasks.ner import train as ner_train
    from tasks.ner.config import NerConfig
    from tasks.ner.metrics import entity_prf
    from tests.test_ner import LEX, _cfg, _data
    from tests.test_ner import _featurizer as ner_featurizer

    feat = ner_featurizer()
    mc = _cfg(vocab_size=len(feat.vocab_index), num_layers=1, word_vocab_size=2 + len(LEX), max_len=48)
    store, pre, lex = _store_with_pretrain(mc)
    monkeypatch.setattr(Featurizer, "from_artifacts", lambda art, max_len=256: feat)
    _ascend_after_first_epoch(ner_train, monkeypatch)

    cfg = NerConfig(**_data(tmp_path), max_len=48, use_crf=False, batch_size=16, lr=1e-2, max_epochs=3, patience=2,
                    threads=1, device="cpu")
    writer = begin(store, "ner", "n1")
    res = ner_train.run_ner_stage(writer, cfg, pre.uri, lex.uri, progress=False)
    art = writer.commit(code_version="t", config={}, parents=[], stats=res.stats, metrics=res.metrics, rows=res.rows)
    dev_f1 = [r["dev_f1"] for r in _epochs(art)]
    assert res.metrics["best_epoch"] == 1 and len(dev_f1) == 3, dev_f1
    assert dev_f1[0] > 0.5 and max(dev_f1[1:]) < dev_f1[0] - 0.2, dev_f1

    dev = ner_train.load_ner_splits(cfg).dev
    pred = NerModel.load(art.uri).predict_tags([s["chars"] for s in dev])  # from the saved weights
    recomputed = entity_prf([s["tags"] for s in dev], pred)["overall"]["f1"]
    assert recomputed == pytest.approx(dev_f1[0], abs=1e-9)
    # recomputed with another batch size (other padding, other kernels): equal up to float noise, not bit for bit
    assert res.metrics["dev_f1"] == pytest.approx(recomputed, abs=1e-6)

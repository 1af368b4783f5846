"""export-hf: transformers loads the exported directory and reproduces our hidden states, heads and vocab."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save as st_save
from typer.testing import CliRunner

from models import LebertClassifier, LebertForPretraining, ModelConfig
from storage.artifacts import ArtifactStore
from tasks.bundle.export_hf import export_hf
from tasks.common.text import normalize_text
from tasks.text.featurize import Featurizer, pad_encoded
from tasks.text.matcher import build_trie, compile_trie
from tasks.text.numbers import replace_numbers, to_token_string
from tasks.text.vocab import SPECIALS, vocab_bytes
from tasks.training.checkpoint import weights
from tests.bundle_fixture import write_bundle
from tests.staging import begin

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

# raw text: traditional characters, full-width digits and numbers, as a user would feed the labeller
TEXTS = [
    "今天北京的天气很好，我们去公园散步。",
    "这家酒店服务很好，房间干净，早餐不错。",
    "１９９８年，臺灣的經濟增長了８%。",
    "国务院总理主持召开常务会议，研究部署经济工作。",
]
LEX = ["今天", "北京", "天气", "我们", "公园", "散步", "酒店", "服务", "房间", "干净", "早餐", "台湾", "经济",
       "增长", "国务院", "总理", "会议", "研究", "部署", "工作"]
WORDS = ["[PAD]", "[UNK]", *LEX]
TOL = 1e-5


def _tokens(text: str) -> str:  # what the featuriser sees: normalised, numbers as #NUM# (U+E000)
    return to_token_string(replace_numbers(normalize_text(text)))


VOCAB = list(SPECIALS) + sorted({c for t in TEXTS for c in _tokens(t)} - {"\ue000"})


def _featurizer(max_len=64) -> Featurizer:
    return Featurizer.build(VOCAB, LEX, WORDS, compile_trie(build_trie(LEX)), 3, max_len)


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=len(VOCAB), hidden_size=32, num_layers=3, num_heads=4, ffn_size=64, max_len=64,
                use_adapter=False, word_vocab_size=len(WORDS), word_dim=8, max_word_num=3)
    return ModelConfig(**{**base, **kw})


def _perturbed(model, seed=0):
    """Every parameter moved off its init (LayerNorms != (1, 0), biases != 0), so a swapped mapping shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def _batch(with_words=True):
    """Our ids for TEXTS, dynamically padded: ids [B,T], mask [B,T] bool, word ids [B,T,3]."""
    ids, words, lens = pad_encoded(_featurizer().encode(TEXTS), with_words=True)
    mask = np.arange(ids.shape[1])[None, :] < lens[:, None]
    return torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(words)


def _store(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    ok = {"in": 0, "out": 0, "rejected": {}}
    w = begin(store, "vocab", "v1")
    w.write_bytes("vocab.txt", vocab_bytes(VOCAB))
    return store, w.commit(code_version="t", config={}, parents=[], stats=ok)


def _pretrain_artifact(tmp_path, **kw):
    store, vocab_art = _store(tmp_path)
    model = _perturbed(LebertForPretraining(_cfg(**kw)))
    w = begin(store, "pretrain", "p1")
    w.write_bytes("model.safetensors", st_save(weights(model)))
    w.write_bytes("model_config.json", json.dumps(model.cfg.model_dump()).encode())
    art = w.commit(code_version="t", config={}, parents=[vocab_art.ref], stats={"in": 0, "out": 0, "rejected": {}})
    return model, art.uri


def _max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b)[mask].abs().max())  # real positions only


@pytest.mark.parametrize("position,activation", [("sinusoidal", "gelu"), ("learned", "gelu_tanh"),
                                                 ("sinusoidal", "relu")])
def test_pretrain_export_reproduces_hidden_states_and_heads(tmp_path, position, activation):
    from transformers import BertForPreTraining, BertModel

    ours, uri = _pretrain_artifact(tmp_path, position=position, activation=activation)
    out = tmp_path / "hf"
    res = export_hf(uri, out)
    assert res.summary()["adapter_dropped"] is False and res.warnings == [] and res.num_hidden_layers == 3
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_act"] == {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}[activation]
    assert cfg["lexiflow"]["source"]["version"] == "p1" and cfg["lexiflow"]["matches_lexiflow"] == "exactly"

    ids, mask, _ = _batch()
    hf = BertModel.from_pretrained(out).eval()
    with torch.no_grad():
        h_ours = ours.encoder(ids, None, mask)  # [B,T,H]
        h_hf = hf(input_ids=ids, attention_mask=mask.long()).last_hidden_state  # [B,T,H]
    assert bool(mask[:, -1].logical_not().any()), "the batch must contain padding"
    assert _max_diff(h_ours, h_hf, mask) < TOL

    # the heads: BertForPreTraining loads every key (MLM decoder tied) and gives our MLM and NSP logits
    full, info = BertForPreTraining.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        o = ours(ids, None, mask, None, mask)  # MLM at every real position: [N,V]
        p = full.eval()(input_ids=ids, attention_mask=mask.long())
    assert float((o.mlm_logits - p.prediction_logits[mask]).abs().max()) < TOL
    assert float((o.nsp_logits - p.seq_relationship_logits).abs().max()) < TOL


def test_adapter_is_dropped_with_a_warning_and_word_free_states_match(tmp_path):
    from transformers import BertModel

    ours, uri = _pretrain_artifact(tmp_path, use_adapter=True, adapter_layer=1)
    ids, mask, words = _batch()
    before_adapter = []  # our block-1 output, before the adapter: [B,T,H]
    ours.encoder.blocks[0].register_forward_hook(lambda m, i, o: before_adapter.append(o))
    with torch.no_grad():
        h_free = ours.encoder(ids, None, mask)  # word ids absent: the adapter is h -> LN(h)
        h_words = ours.encoder(ids, None, mask, words)

    warned = []
    res = export_hf(uri, tmp_path / "nw", warn=warned.append)  # default: adapter="no-words"
    cfg = json.loads((tmp_path / "nw" / "config.json").read_text())
    lex = cfg["lexiflow"]
    assert res.adapter_dropped and len(warned) == 1 and "lexicon adapter" in warned[0] and "dropped" in warned[0]
    assert (lex["adapter_dropped"], lex["adapter_layer"], lex["adapter_mode"], lex["adapter_hf_layer"]) == (
        True, 1, "no-words", 1)
    assert cfg["num_hidden_layers"] == 4 and "lexicon adapter is dropped" in (tmp_path / "nw" / "README.md").read_text()
    hf = BertModel.from_pretrained(tmp_path / "nw").eval()
    with torch.no_grad():
        hs = hf(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True).hidden_states  # 5 x [B,T,H]
    assert _max_diff(hs[1], before_adapter[1], mask) < TOL  # layer 0 = our block 1, words or not
    assert _max_diff(hs[-1], h_free, mask) < TOL  # every layer after: equal to ours with word ids absent
    assert _max_diff(hs[-1], h_words, mask) > 1e-2  # with lexicon words ours differs: the adapter really is gone

    res = export_hf(uri, tmp_path / "drop", adapter="drop", warn=warned.append)
    assert res.adapter_mode == "drop" and res.num_hidden_layers == 3 and "up to layer 1" in warned[-1]
    hf = BertModel.from_pretrained(tmp_path / "drop").eval()
    with torch.no_grad():
        hs = hf(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True).hidden_states  # 4 x [B,T,H]
    assert _max_diff(hs[1], before_adapter[0], mask) < TOL
    assert _max_diff(hs[-1], h_free, mask) > 1e-2  # the adapter's LayerNorm is missing after block 1


def _bundle_artifact(tmp_path, **kw):
    store = ArtifactStore(str(tmp_path / "store"))
    feat, trie = _featurizer(), build_trie(LEX)
    clf = _perturbed(LebertClassifier(_cfg(**kw), use_layers=2, dropout=0.1), seed=1)
    vectors = np.random.default_rng(0).normal(size=(len(WORDS), 8)).astype(np.float32)
    mc = {"model": clf.cfg.model_dump(), "use_layers": 2, "dropout": 0.1, "max_len": 64}
    info = {"max_len": 64, "max_word_num": 3, "threshold": 0.5, "metrics": {}}
    w = begin(store, "bundle", "b1")
    write_bundle(w, {}, clf, mc, info, VOCAB, WORDS, vectors, feat.rank_to_word, trie, feat.ct)
    return store.artifact_uri("bundle", "b1")


def test_bundle_export_is_the_classifiers_encoder_and_head(tmp_path):
    from safetensors.torch import load_file
    from transformers import BertModel

    from tasks.inference.bundle import load_bundle

    # adapter after block 3, classifier runs blocks 1..2: the adapter is never reached, nothing is dropped
    uri = _bundle_artifact(tmp_path, use_adapter=True, adapter_layer=3)
    res = export_hf(uri, tmp_path / "hf", warn=pytest.fail)
    assert (res.stage, res.adapter_dropped, res.num_hidden_layers) == ("bundle", False, 2)
    lex = json.loads((tmp_path / "hf" / "config.json").read_text())["lexiflow"]
    assert lex["use_layers"] == 2 and lex["threshold"] == 0.5 and lex["blocks_exported"] == 2

    clf = load_bundle(uri).model  # the labeller's model, weights checksum-verified
    ids, mask, words = _batch()
    hf, info = BertModel.from_pretrained(tmp_path / "hf", add_pooling_layer=False, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        h_ours = clf.encoder(ids, None, mask, words, use_layers=2)  # [B,T,H]
        h_hf = hf.eval()(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        logit_ours = clf(ids, mask, words)  # [B]
    assert _max_diff(h_ours, h_hf, mask) < TOL
    # the head file + mean-max pooling over real tokens reproduces the bundle's logits
    head = load_file(tmp_path / "hf" / "lexiflow_head.safetensors")
    m = mask[..., None]  # [B,T,1]
    pooled = torch.cat([(h_hf * m).sum(1) / m.sum(1), h_hf.masked_fill(~m, -1e30).amax(1)], -1)  # [B,2H]
    assert float((pooled @ head["head.weight"].T + head["head.bias"]).squeeze(-1).sub(logit_ours).abs().max()) < TOL


def test_tokenizer_vocab_and_what_it_does_not_normalise(tmp_path):
    from transformers import BertTokenizer

    _, uri = _pretrain_artifact(tmp_path)
    export_hf(uri, tmp_path / "hf")
    tok = BertTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.get_vocab() == {t: i for i, t in enumerate(VOCAB)}
    specials = (tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id)
    assert specials == (0, 1, 2, 3, 4) and tok.convert_tokens_to_ids("#NUM#") == 5
    feat = _featurizer()
    ours = [e.input_ids.tolist() for e in feat.encode(TEXTS)]
    # normalised simplified Chinese (numbers already #NUM#): BertTokenizer gives exactly our ids
    normalised = [_tokens(t).replace("\ue000", "#NUM#") for t in TEXTS]
    assert normalised[2] == "#NUM#年，台湾的经济增长了#NUM#%。"  # t2s, ８ -> 8 -> #NUM#; the comma stays full-width
    assert tok(normalised)["input_ids"] == ours
    # raw text: no t2s, no full-width -> half-width, no numbers -> #NUM#: 臺/灣/經/濟 and １９９８ become [UNK]
    raw = tok.convert_ids_to_tokens(tok(TEXTS[2])["input_ids"])
    assert [VOCAB[i] for i in ours[2]] == ["[CLS]", "#NUM#", "年", "，", "台", "湾", "的", "经", "济", "增", "长", "了",
                                          "#NUM#", "%", "。", "[SEP]"]
    assert raw == ["[CLS]", "[UNK]", "年", "，", "[UNK]", "[UNK]", "的", "[UNK]", "[UNK]", "增", "[UNK]", "了", "[UNK]",
                   "%", "。", "[SEP]"]
    assert tok(TEXTS[0])["input_ids"] == ours[0]  # already normalised text needs nothing


def test_cli_prints_a_json_summary_and_refuses_bad_input(tmp_path):
    from lexiflow.cli import app

    _, uri = _pretrain_artifact(tmp_path, use_adapter=True, adapter_layer=2)
    res = CliRunner().invoke(app, ["export-hf", uri, "--out", str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary == {"out_dir": str(tmp_path / "hf"), "stage": "pretrain", "version": "p1", "uri": uri,
                       "adapter_dropped": True, "adapter_mode": "no-words", "num_hidden_layers": 4}
    assert "warning:" in res.stderr and "lexicon adapter" in res.stderr
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted(
        ["config.json", "model.safetensors", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json",
         "README.md"])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokenizer.json").write_text("{}")  # would shadow vocab.txt in transformers
    res = CliRunner().invoke(app, ["export-hf", uri, "--out", str(tmp_path / "other")])
    assert res.exit_code == 2 and "did not write" in res.stderr
    vocab_uri = str(tmp_path / "store" / "vocab" / "v1")
    res = CliRunner().invoke(app, ["export-hf", vocab_uri, "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "'vocab' artifact" in res.stderr
    res = CliRunner().invoke(app, ["export-hf", uri, "--out", str(tmp_path / "y"), "--adapter", "keep"])
    assert res.exit_code == 2 and "adapter must be one of" in res.stderr
    res = CliRunner().invoke(app, ["export-hf", uri + "x", "--out", str(tmp_path / "y")])
    assert res.exit_code == 2 and "not a committed artifact" in res.stderr
    weights_file = tmp_path / "store" / "pretrain" / "p1" / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:-4] + b"\0\0\0\0")  # tampered after commit
    res = CliRunner().invoke(app, ["export-hf", uri, "--out", str(tmp_path / "y")])
    assert res.exit_code == 2 and "does not match manifest" in res.stderr and not (tmp_path / "y").exists()

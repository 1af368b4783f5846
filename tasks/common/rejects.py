"""The one reject vocabulary: every reason a stage may give a row it does not keep, and the reject schema.

A reason is named once here and used by every stage that can meet it, so ``undecodable`` means the
same thing in the corpus cleaner, the embeddings reader, the labelled-table reader and the labeller.
Names that were already written into data-stage artifacts (clean, embeddings) were kept as they were,
so those artifacts keep their versions and bytes.

Reject rows share one column vocabulary, in this order: ``source`` (the input URI; the labeller
writes the file name its row ids use, so moving the inputs keeps its bytes), ``line`` (1-based line
where the record starts in a text file, or 1-based row in Parquet), ``id`` (the record's own id: a
wiki document id, the labeller's output row id; null where a record has none), ``reason``, ``text``
(a snippet of at most ``SNIPPET`` characters), then any stage-specific extras (fine-tuning keeps the
raw ``label``). The table reader (:mod:`tasks.common.table`) gives ``undecodable``, ``invalid_json``
and ``bad_columns``; the stages reading through it add the row checks. A stage writes the columns
that apply to it (the embeddings file has one source and no ids, so it writes ``line, reason,
text``); the clean stage's id column is called ``doc_id``, as its artifacts always had it.
"""

from __future__ import annotations

import pyarrow as pa

from tasks.common.text import replace_invalid

SNIPPET = 200  # characters of text kept in a reject row

# ---------------------------------------------------------------- reading any input
UNDECODABLE = "undecodable"  # bytes that are not valid UTF-8
LINE_TOO_LONG = "line_too_long"  # a line longer than the configured byte limit
INVALID_JSON = "invalid_json"  # a JSON-lines line that does not parse to an object
BAD_COLUMNS = "bad_columns"  # a CSV/TSV record with another field count than the header, or unparsable (bare CR)
INVALID_UNICODE = "invalid_unicode"  # a text or id holding a lone surrogate (a JSON "\ud800" escape): not Unicode text
MISSING_TEXT = "missing_text"  # the text field is null or absent
NOT_A_STRING = "not_a_string"  # the text field holds a non-string JSON value
EMPTY_TEXT = "empty_text"  # the text is empty or whitespace only
MISSING_ID = "missing_id"  # an id column was named but this row's id is null or empty
DUPLICATE_ID = "duplicate_id"  # an id an earlier row of the same run already has (the first one keeps it)
BAD_LABEL = "bad_label"  # a label that is not 0 or 1

# ---------------------------------------------------------------- clean (wiki dumps)
UNTERMINATED_DOC = "unterminated_doc"  # a <doc> opened and never closed
STRAY_CLOSE_TAG = "stray_close_tag"  # </doc> without an open <doc>
OUTSIDE_DOC = "outside_doc"  # text between documents in a WikiExtractor file
TOO_SHORT = "too_short"  # a sentence shorter than clean.min_chars
LOW_CJK_RATIO = "low_cjk_ratio"  # a sentence with too few CJK characters
DUPLICATE = "duplicate"  # a sentence seen before (exact, after normalisation)
# MediaWiki XML dumps: a page that is not an article (tasks/prepare/wikidump.py); one reject per page
REDIRECT = "redirect"  # a redirect page (<redirect/> or #REDIRECT / #重定向 text)
DISAMBIGUATION = "disambiguation"  # a disambiguation page ({{disambig}}, {{消歧义}}, ... or a "(消歧义)" title)
OTHER_NAMESPACE = "other_namespace"  # a page outside namespace 0 (Template:, Category:, Wikipedia:, File:, ...)

# ---------------------------------------------------------------- vocab (characters, not rows)
BELOW_MIN_COUNT = "below_min_count"  # a character seen fewer than vocab.min_count times
OVER_MAX_SIZE = "over_max_size"  # a character past vocab.max_size (the rarest are dropped)
NOT_IN_CHECKPOINT_VOCAB = "not_in_checkpoint_vocab"  # a character an imported checkpoint's vocab.txt lacks ([UNK])

# ---------------------------------------------------------------- embeddings and trie
SHORT_LINE = "short_line"  # fewer fields than the header's dimension + 1
NON_NUMERIC = "non_numeric"  # a vector field that is not a number
DUPLICATE_WORD = "duplicate_word"  # a word already read earlier in the file
DUPLICATE_OR_UNUSABLE = "duplicate_or_unusable"  # a trie word that repeats or cannot match text

# ---------------------------------------------------------------- NER files
NO_SEPARATOR = "no_separator"  # a line with no space/tab between character and tag
EMPTY_CHAR = "empty_char"  # a line whose character field is empty
BAD_TAG = "bad_tag"  # a tag that is not O, B-X, I-X, E-X, S-X or M-X

# ---------------------------------------------------------------- labelling
EMPTY_AFTER_NORMALIZATION = "empty_after_normalization"  # only markup/space: the model would see [CLS][SEP]

REASONS: dict[str, str] = {
    name: value
    for name, value in globals().items()
    if name.isupper() and isinstance(value, str) and name not in ("SNIPPET",)
}

COLUMNS: dict[str, pa.DataType] = {
    "source": pa.string(),
    "line": pa.int64(),
    "id": pa.string(),
    "reason": pa.string(),
    "text": pa.string(),
}


def reject_schema(*columns: str, id_name: str = "id", extra: dict[str, pa.DataType] | None = None) -> pa.Schema:
    """The reject schema for a stage: the named standard columns in the standard order, then extras.

    ``reject_schema()`` is every standard column; ``reject_schema("line", "reason", "text")`` a subset."""
    names = [c for c in COLUMNS if not columns or c in columns]
    unknown = set(columns) - set(COLUMNS)
    if unknown:
        raise ValueError(f"unknown reject column(s) {sorted(unknown)}; standard ones: {list(COLUMNS)}")
    fields = [(id_name if c == "id" else c, COLUMNS[c]) for c in names]
    return pa.schema(fields + list((extra or {}).items()))


def snippet(text: object) -> str | None:
    """At most ``SNIPPET`` characters of a rejected value (None stays None; other values via str), lone surrogates
    shown as U+FFFD so that the reject row can be written."""
    if text is None:
        return None
    return replace_invalid((text if isinstance(text, str) else str(text))[:SNIPPET])

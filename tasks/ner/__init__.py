"""NER: char-per-line data, entity metrics, the HMM baseline and tagger training (its scorer is inference's)."""

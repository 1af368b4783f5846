"""NER: char-per-line data, entity metrics, the HMM baseline, tagger training and the scorer."""

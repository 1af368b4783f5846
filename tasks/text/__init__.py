"""Runtime text encoding, shared by training and inference: the #NUM# rule, vocabulary ids, lexicon matching
and its kernels, the featurizer."""

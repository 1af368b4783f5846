"""Evaluations across stages: the lexicon ablation (two separately pretrained encoders) beside the baselines."""

"""Evaluations across stages: the lexicon ablation beside the baselines, and the summary of a pipeline run."""

"""Fine-tuning for any number of classes: the trainer and its heads, the baseline, the threshold, the reports."""

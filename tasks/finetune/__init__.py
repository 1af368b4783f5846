"""Fine-tuning: the classifier trainer, the TF-IDF baseline and stacking, threshold search, evaluation reports."""

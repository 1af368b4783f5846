"""Inference: a bundle opened, the scorers (sentiment, NER) and their interface, explain, devices and batching."""

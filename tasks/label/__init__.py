"""Offline labelling: the resumable labeller, its output directory, and one input split over several workers."""

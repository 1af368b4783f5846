"""What every trainer shares: the fit loop, checkpoints, preemption, progress, collectives and row-wise AdamW."""

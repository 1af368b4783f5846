"""What every trainer shares: the training loop, checkpoints, preemption, progress and numerics."""

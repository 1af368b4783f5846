"""Pretraining: the packed MLM + NSP data, the training loop, checkpoints and resume, the stage and its DDP launcher."""

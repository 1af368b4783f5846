"""Pretraining: the packed MLM + NSP data, the stage and its DDP launcher, checkpoint import, the downstream start."""

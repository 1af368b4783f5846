"""The bundle stage and its uses: the bundle artifact, HF export, the model card, promotion."""

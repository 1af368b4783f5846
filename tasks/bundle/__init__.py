"""The bundle and its uses: the bundle artifact, the scorer, explanations, HF export, the model card, promotion."""

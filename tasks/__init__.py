"""Stage logic as plain functions, in rooms by role: common, text, inference, prepare, training, pretrain, finetune,
ner, bundle, label, evaluate."""

import models.numerics  # noqa: E402,F401  (pins torch's CPU kernels before any torch op; imports no torch)

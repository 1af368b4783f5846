"""Stage logic as plain functions, a room per job: common, prepare, pretrain, finetune, bundle, ner, label, evaluate."""

import models.numerics  # noqa: E402,F401  (pins torch's CPU kernels before any torch op; imports no torch)

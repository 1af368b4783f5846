"""Stage logic as plain functions, one room per job: common, prepare, pretrain, finetune, ner, bundle, label."""

import models.numerics  # noqa: E402,F401  (pins torch's CPU kernels before any torch op; imports no torch)

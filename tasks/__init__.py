"""Stage logic as plain functions, grouped by role: common, prepare, train, ner; plus the labeller and the sample."""

import models.numerics  # noqa: E402,F401  (pins torch's CPU kernels before any torch op; imports no torch)

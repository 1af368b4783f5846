"""Stage logic as plain functions, grouped by role: common, prepare, train, ner; plus the labeller and the sample."""

"""Stage mechanics shared by every stage: runner, config, table reader, rejects, splits, text, plots."""

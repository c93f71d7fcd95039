"""Training supervision: the monitored session, checkpoints, summaries, hooks."""

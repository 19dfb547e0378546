"""LM training: sharded train state, pure train step, held-out evaluation, pretraining with checkpoints."""

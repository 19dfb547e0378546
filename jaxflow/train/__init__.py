"""LM training: sharded train state, pure train step, held-out evaluation, lm_pretrain."""

"""The ``lm_pretrain`` experiment: train the LM on the arithmetic corpus, checkpoint, resume.

The work is :func:`jaxflow.train.pretrain.pretrain` (shared with the RL warm start); this entry
point only names it for the runner.
"""

from __future__ import annotations

from jaxflow.experiment import RunContext
from jaxflow.train.pretrain import pretrain


def main(config, run: RunContext) -> dict:
    return pretrain(config, run)

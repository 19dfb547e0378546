"""LM training: sharded train state, pure train step, held-out evaluation, pretraining with checkpoints."""

from jaxflow.train.evaluate import ExactMatchEvaluator
from jaxflow.train.lm_state import (
    LMFunctions,
    OptimConfig,
    init_params,
    init_train_state,
    lm_functions,
    make_optimizer,
    make_train_step,
    token_nll,
)
from jaxflow.train.loop import Fault, LoopCheckpointer, LoopResult, run_steps
from jaxflow.train.mixed_precision import F32MasterState, f32_master
from jaxflow.train.pretrain import PretrainStep, build_train_step
from jaxflow.train.state import TrainState, opt_state_shardings

__all__ = [
    "TrainState", "opt_state_shardings",
    "run_steps", "Fault", "LoopCheckpointer", "LoopResult",
    "OptimConfig", "make_optimizer", "LMFunctions", "lm_functions", "init_params", "init_train_state",
    "make_train_step", "token_nll",
    "F32MasterState", "f32_master",
    "ExactMatchEvaluator",
    "PretrainStep", "build_train_step",
]

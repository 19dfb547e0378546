"""``--set model.hf_path=DIR`` in the RL (sis_offpolicy) and pruning (calibration_tradeoffs)
configs, and the hook that loads the checkpoint in the trainers' parameter layout."""
import jax
import numpy as np
import pytest

from jaxflow.config import ConfigError, apply_overrides, get_experiment
from jaxflow.mesh import make_mesh
from jaxflow.models.hf_checkpoint import from_pretrained
from jaxflow.models.pretrained import load_policy
from jaxflow.models.tokenizer_hf import HFTokenizer
from jaxflow.train.lm_state import lm_functions
from tests._hf_fixtures import write_tiny_qwen3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("wiring") / "tiny")
    write_tiny_qwen3(path, seed=5)
    return path


@pytest.mark.parametrize("exp", ["sis_offpolicy", "calibration_tradeoffs"])
def test_hf_path_override(checkpoint, exp):
    config = get_experiment(exp).get_config("quick")
    assert apply_overrides(config, [f"model.hf_path={checkpoint}"]).model.hf_path == checkpoint
    with pytest.raises(ConfigError, match="'/nonexistent-dir': not a checkpoint directory"):
        apply_overrides(config, ["model.hf_path=/nonexistent-dir"])


def test_load_policy_gives_the_trainer_layout(checkpoint):
    mesh = make_mesh({"data": 4, "model": 2})
    config, params, tokenizer = load_policy(checkpoint, mesh)
    assert config.architecture == "qwen3" and config.hf_path == checkpoint
    assert isinstance(tokenizer, HFTokenizer)
    fns = lm_functions(config, mesh)
    got = jax.tree.map(lambda x: x.sharding.spec, params)
    assert got == jax.tree.map(lambda s: s.spec, fns.param_shardings)
    reference = from_pretrained(checkpoint)
    np.testing.assert_array_equal(params["layers"][0]["attn"]["wq"],
                                  reference.layers[0].attn.wq[...])

"""A checkpoint's tokenizer.json in place of the character tokenizer, and GRPO + SIS with
SparseRL-Sync on a loaded tiny Qwen3 checkpoint (finite loss, bit-exact bf16 syncs)."""
import math

import jax
import numpy as np
import pytest
from flax import nnx

from jaxflow.mesh import role_meshes
from jaxflow.models import from_pretrained
from jaxflow.models.tokenizer_hf import HFTokenizer
from jaxflow.rl.grpo import GRPOConfig, GRPOTrainer
from jaxflow.rl.policy_loss import PolicyLossConfig
from jaxflow.rl.tasks import AdditionRLTask, completion_text, encode_prompts
from jaxflow.sync import SyncConfig
from jaxflow.train.lm_state import OptimConfig
from tests._hf_fixtures import EOS, write_tiny_qwen3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3") / "tiny")
    write_tiny_qwen3(path)
    return path


def test_tokenizer_json_round_trips_and_knows_its_specials(checkpoint):
    tok = HFTokenizer.from_pretrained(checkpoint)
    eos = tok.tokenizer.token_to_id(EOS)
    assert tok.eos_id == tok.pad_id == eos and tok.bos_id is None
    ids = tok.encode("12+34=46")
    assert len(ids) < len("12+34=46")  # real BPE merges, not characters
    assert tok.decode(ids) == "12+34=46"
    assert tok.encode("7+8=", bos=True, eos=True) == tok.encode("7+8=") + [eos]
    assert tok.decode(tok.encode("3+4=") + [eos] + tok.encode("9")) == "3+4="
    # what RL tasks use: prompt rows, completion text up to EOS
    rows, lengths = encode_prompts(tok, ["1+2=", "10+20="], 8)
    assert rows.shape == (2, 8) and list(lengths) == [len(tok.encode("1+2=")),
                                                        len(tok.encode("10+20="))]
    assert completion_text(tok, tok.encode("30") + [eos, eos]) == "30"
    assert completion_text(tok, tok.encode("30")) is None


def test_grpo_sis_with_sparse_sync_on_a_loaded_qwen3(checkpoint):
    model = from_pretrained(checkpoint)
    tok = HFTokenizer.from_pretrained(checkpoint)
    assert model.config.vocab_size >= tok.vocab_size
    meshes = role_meshes({"trainer": 4, "rollout": 4})
    config = GRPOConfig(loss=PolicyLossConfig(correction="sis"), prompts_per_rollout=2,
                        group_size=4, max_new_tokens=3, sis_topk=4, lag=2, entropy_coef=0.05)
    trainer = GRPOTrainer(model.config, config, OptimConfig(lr=3e-3, warmup_steps=0),
                          AdditionRLTask(max_digits=1), tok, meshes, seed=0, total_rollouts=2,
                          sync=SyncConfig(codec="entropy"))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    state = trainer.init_state(params)
    before = jax.tree.map(np.asarray, params)
    for _ in range(2):
        state, metrics = trainer.step(state)
        assert math.isfinite(metrics["actor/loss"]) and math.isfinite(metrics["actor/grad_norm"])
        assert metrics["sync/synced"] == 1.0 and metrics["sync/bit_exact"] == 1.0
        assert 0 < metrics["sync/changed_fraction"] < 1
    after = jax.tree.map(np.asarray, state["policy"].params)
    assert any(not np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(before), jax.tree.leaves(after)))  # the checkpoint trained

"""Adversarial parameter trees shared by the sync tests."""

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16


def bf16_from_bits(pattern) -> np.ndarray:
    return np.asarray(pattern, np.uint16).view(BF16)


def adversarial_pair(seed: int = 0):
    """(old, new) trees covering NaN payloads, +-0.0, infs, subnormals, all/none changed,
    empty and scalar leaves, int and f32 leaves, sign flips and long gaps."""
    rng = np.random.default_rng(seed)
    special = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x7F81,
                        0x0001, 0x8001, 0x007F, 0x3F80, 0xBF80, 0x7F7F, 0xFF7F, 0x0080],
                       np.uint16)
    old_special = special.copy()
    new_special = special[[1, 0, 3, 2, 5, 4, 6, 8, 7, 10, 9, 11, 13, 12, 15, 14]]  # 11, 6 same
    random_old = rng.integers(0, 1 << 16, 700, dtype=np.uint16)
    random_new = random_old.copy()
    flip = rng.choice(700, 40, replace=False)
    random_new[flip] = rng.integers(0, 1 << 16, 40, dtype=np.uint16)
    random_new[flip[:5]] ^= 0x8000  # sign flips: 32768-ulp bit differences
    sparse_old = rng.integers(0, 1 << 16, 200_000, dtype=np.uint16)
    sparse_new = sparse_old.copy()
    sparse_new[[3, 70_000, 199_999]] += 1  # gaps beyond uint16: escapes
    smooth_old = (rng.standard_normal(3000).astype(np.float32) * 0.02).astype(BF16)
    smooth_new = smooth_old.copy().view(np.uint16)
    steps = rng.choice(3000, 18, replace=False)
    smooth_new[steps] += rng.choice(np.array([1, 0xFFFF, 2], np.uint16), 18)
    all_old = rng.integers(0, 1 << 16, (8, 16), dtype=np.uint16)
    all_new = all_old + 1
    noise_old = rng.integers(0, 1 << 16, 512, dtype=np.uint16)
    noise_new = noise_old ^ rng.integers(1, 1 << 16, 512, dtype=np.uint16)  # all, random
    f32_old = np.array([0.0, -0.0, np.nan, 1.5, np.inf], np.float32)
    f32_new = np.array([-0.0, 0.0, np.nan, 1.5, -np.inf], np.float32)
    f32_new.view(np.uint32)[2] = 0x7FC00123  # NaN with a payload
    old = {
        "special": bf16_from_bits(old_special),
        "random": bf16_from_bits(random_old),
        "sparse": bf16_from_bits(sparse_old),
        "smooth": smooth_old,
        "all_changed": bf16_from_bits(all_old),
        "noise": bf16_from_bits(noise_old),
        "unchanged": bf16_from_bits(rng.integers(0, 1 << 16, (4, 4), dtype=np.uint16)),
        "empty": np.zeros((0,), BF16),
        "empty2d": np.zeros((3, 0), BF16),
        "scalar": bf16_from_bits(np.array(0x3F80, np.uint16)),
        "nested": [np.int32(7), f32_old, np.arange(6, dtype=np.int32).reshape(2, 3)],
    }
    new = {
        "special": bf16_from_bits(new_special),
        "random": bf16_from_bits(random_new),
        "sparse": bf16_from_bits(sparse_new),
        "smooth": smooth_new.view(BF16),
        "all_changed": bf16_from_bits(all_new),
        "noise": bf16_from_bits(noise_new),
        "unchanged": old["unchanged"].copy(),
        "empty": np.zeros((0,), BF16),
        "empty2d": np.zeros((3, 0), BF16),
        "scalar": bf16_from_bits(np.array(0x8000, np.uint16)),
        "nested": [np.int32(8), f32_new, np.arange(6, dtype=np.int32).reshape(2, 3)],
    }
    return old, new


def tree_bits(tree) -> list[bytes]:
    import jax
    return [np.ascontiguousarray(np.asarray(x)).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def test_adversarial_pair_covers_the_required_cases():
    old, new = adversarial_pair()
    special = new["special"].view(np.uint16)
    assert {0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001} <= set(special.tolist())
    assert (old["all_changed"].view(np.uint16) != new["all_changed"].view(np.uint16)).all()
    assert np.array_equal(old["unchanged"].view(np.uint16), new["unchanged"].view(np.uint16))
    assert new["empty"].size == 0 and new["scalar"].shape == ()
    assert new["nested"][0].dtype == np.int32 and new["nested"][1].dtype == np.float32


def test_layout_of_a_tree_with_unhashable_node_metadata():
    """tree_layout caches layouts by structure; a custom node whose auxiliary data cannot be
    hashed or compared is laid out (and encoded) without the cache."""
    import jax
    import ml_dtypes
    import numpy as np

    from jaxflow.sync import encode
    from jaxflow.sync.diff import tree_layout

    @jax.tree_util.register_pytree_node_class
    class Box:
        def __init__(self, x, meta):
            self.x, self.meta = x, meta

        def tree_flatten(self):
            return (self.x,), self.meta

        @classmethod
        def tree_unflatten(cls, meta, children):
            return cls(children[0], meta)

    for meta in ({"tags": ["w"]}, np.arange(3)):  # unhashable; ambiguous under ==
        old = {"a": Box(np.zeros(8, ml_dtypes.bfloat16), meta)}
        new = {"a": Box(np.ones(8, ml_dtypes.bfloat16), meta)}
        assert [s.shape for s in tree_layout(old)[2]] == [(8,)]
        payload = encode(old, new, base_version=0, version=1)
        assert payload.version == 1 and len(payload.to_bytes()) > 0

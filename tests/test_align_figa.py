"""FIGA: token marks from edit operations, the loss, its baselines and the pair builder."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.align import (
    FigaConfig,
    addition_answers,
    build_pairs,
    dpo_loss,
    figa_loss,
    figa_mark_batch,
    figa_marks,
    figa_token_weights,
    interleave_rows,
    minimal_revision,
    sequence_logp,
    sft_loss,
)
from jaxflow.data.tokenizer import CharTokenizer

EOS = 2

# (original, revised, original marks, revised marks): every minimal edit script is unique.
HAND_CASES = {
    "replace": ([3, 4, 5, EOS], [3, 6, 5, EOS], [0, -1, 0, 0], [0, 1, 0, 1]),
    "insert": ([3, 4, EOS], [3, 5, 4, EOS], [0, 0, 0], [0, 1, 0, 1]),
    "delete": ([3, 5, 4, EOS], [3, 4, EOS], [0, -1, 0, 0], [0, 0, 1]),
    "all-equal": ([3, 4, EOS], [3, 4, EOS], [0, 0, 0], [0, 0, 1]),
    "all-different": ([3, 4, EOS], [5, 6, EOS], [-1, -1, 0], [1, 1, 1]),
    "empty": ([EOS], [5, 6, EOS], [0], [1, 1, 1]),  # an empty answer: just its EOS
}


@pytest.mark.parametrize("case", sorted(HAND_CASES))
def test_marks_equal_hand_computed(case):
    orig, rev, want_orig, want_rev = HAND_CASES[case]
    om, rm = figa_marks(orig, rev, eos_id=EOS, vocab_size=16)
    assert om.dtype == np.int32 and rm.dtype == np.int32
    np.testing.assert_array_equal(om, want_orig)
    np.testing.assert_array_equal(rm, want_rev)
    # without eos_id the end token is not marked (it is never an edit in these cases)
    _, rm_plain = figa_marks(orig, rev)
    want_plain = np.array(want_rev)
    want_plain[rev.index(EOS)] = 0
    np.testing.assert_array_equal(rm_plain, want_plain)


def test_mark_batch_pads_and_matches_single_pairs():
    cases = [HAND_CASES[k] for k in sorted(HAND_CASES)]
    batch = figa_mark_batch([c[0] for c in cases], [c[1] for c in cases], 5, eos_id=EOS,
                            vocab_size=16)
    for i, (orig, rev, om, rm) in enumerate(cases):
        np.testing.assert_array_equal(batch.original_marks[i, : len(orig)], om)
        np.testing.assert_array_equal(batch.revised_marks[i, : len(rev)], rm)
        np.testing.assert_array_equal(batch.original_tokens[i, : len(orig)], orig)
        assert batch.original_mask[i].sum() == len(orig) and batch.revised_mask[i].sum() == len(rev)
        assert np.all(batch.revised_marks[i, len(rev):] == 0)
        assert np.all(batch.original_tokens[i, len(orig):] == 0)


def test_marking_bad_inputs():
    with pytest.raises(ValueError, match=r"original is empty \(shape \(0,\)\)"):
        figa_marks([], [3, EOS])
    with pytest.raises(ValueError, match=r"revised \(shape \(2,\)\) has ids \[23\] outside the "
                                         r"vocabulary \[0, 23\)"):
        figa_marks([3, EOS], [23, EOS], vocab_size=23)
    with pytest.raises(ValueError, match=r"originals \(2 responses\) and revisions \(1\)"):
        figa_mark_batch([[3, EOS], [4, EOS]], [[3, EOS]])
    with pytest.raises(ValueError, match=r"pair 1: revised is empty"):
        figa_mark_batch([[3, EOS], [4, EOS]], [[3, EOS], []])
    with pytest.raises(ValueError, match=r"a response of 3 tokens does not fit length=2"):
        figa_mark_batch([[3, 4, EOS]], [[3, EOS]], 2)


# ----------------------------------------------------------------------------- the loss


def _random_rows(seed, B=6, T=5):
    rng = np.random.default_rng(seed)
    logp = np.log(rng.uniform(0.2, 0.95, (B, T))).astype(np.float32)  # NLL in (0.05, 1.6)
    revised = np.arange(B) % 2 == 0
    marks = np.where(revised[:, None], rng.integers(0, 2, (B, T)), -rng.integers(0, 2, (B, T)))
    mask = rng.random((B, T)) < 0.85
    return logp, marks.astype(np.int32), mask, revised


def _numpy_figa(logp, marks, mask, revised, alpha=1.0, beta=0.5, gamma=0.0, lo=0.0, hi=0.6):
    nll = -logp.astype(np.float64)
    rev = revised[:, None]
    w = np.where(rev, np.where(marks == 1, alpha, gamma),
                 np.where((marks == -1) & (nll >= lo) & (nll <= hi), -beta, 0.0))
    w = np.where(mask, w, 0.0)
    return np.sum(w * nll) / max(np.sum(w != 0), 1), w


@pytest.mark.parametrize("seed", [0, 1])
def test_loss_equals_numpy(seed):
    logp, marks, mask, revised = _random_rows(seed)
    loss, metrics = figa_loss(jnp.asarray(logp), jnp.asarray(marks), jnp.asarray(mask),
                              jnp.asarray(revised))
    ref, w = _numpy_figa(logp, marks, mask, revised)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-6)
    assert int(metrics["weighted_tokens"]) == np.sum(w != 0)
    assert 0 < int(metrics["negative_kept"]) < int(metrics["negative_tokens"])  # window bites
    cfg = FigaConfig(alpha=2.0, beta=0.3, gamma=0.1, neg_nll_min=0.6, neg_nll_max=1.0)
    loss2, _ = figa_loss(jnp.asarray(logp), jnp.asarray(marks), jnp.asarray(mask),
                         jnp.asarray(revised), config=cfg)
    ref2, _ = _numpy_figa(logp, marks, mask, revised, 2.0, 0.3, 0.1, 0.6, 1.0)
    np.testing.assert_allclose(float(loss2), ref2, rtol=1e-6)


def test_loss_with_marks_captured_by_a_jitted_function():
    """Concrete marks closed over by a jitted caller are validated on the host (they used to
    be turned into tracers by the range check: ConcretizationTypeError)."""
    logp, marks, mask, revised = (jnp.asarray(x) for x in _random_rows(0))
    loss = jax.jit(lambda lp: figa_loss(lp, marks, mask, revised)[0])(logp)
    assert float(loss) == pytest.approx(float(figa_loss(logp, marks, mask, revised)[0]), rel=1e-6)
    bad = marks * 2  # concrete, out of range: still refused under jit
    with pytest.raises(ValueError, match="marks must lie in"):
        jax.jit(lambda lp: figa_loss(lp, bad, mask, revised)[0])(logp)


def test_constant_weighting_equals_numpy():
    logp, marks, mask, revised = _random_rows(2)
    cfg = FigaConfig(weighting="constant")
    loss, _ = figa_loss(jnp.asarray(logp), jnp.asarray(marks), jnp.asarray(mask),
                        jnp.asarray(revised), config=cfg)
    w = np.where(mask, np.where(marks == 1, 1.0, -0.5), 0.0)
    np.testing.assert_allclose(float(loss), np.sum(w * -logp) / mask.sum(), rtol=1e-6)


def test_gradient_on_kept_negative_token_is_ascent_on_its_nll():
    # one revision row (marks +1 on token 1) and one original row (bad token 1, p = 0.8:
    # NLL 0.22 <= 0.6, so it is kept); logits over 4 tokens per position
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 4)), jnp.float32)
    targets = jnp.array([[0, 1, 2], [0, 3, 2]])
    logits = logits.at[1, 1].set(jnp.array([0.0, 0.0, 0.0, 3.0]))  # p(3) ~ 0.87
    marks = jnp.array([[0, 1, 0], [0, -1, 0]], jnp.int32)
    mask = jnp.ones((2, 3), bool)
    revised = jnp.array([True, False])

    def nll_of(lg):
        return -jnp.take_along_axis(jax.nn.log_softmax(lg), targets[..., None], -1)[..., 0]

    def loss_fn(lg):
        return figa_loss(-nll_of(lg), marks, mask, revised)[0]

    w = figa_token_weights(nll_of(logits), marks, mask, revised, config=FigaConfig())
    assert float(w[1, 1]) == -0.5 and float(w[0, 1]) == 1.0 and int(jnp.sum(w != 0)) == 2
    g = jax.grad(loss_fn)(logits)
    stepped = logits - 0.5 * g
    before, after = nll_of(logits), nll_of(stepped)
    assert float(after[1, 1]) > float(before[1, 1])  # the bad token's NLL goes up
    assert float(after[0, 1]) < float(before[0, 1])  # the fixed token's NLL goes down
    assert np.all(np.asarray(g)[:, [0, 2]] == 0)  # weight-0 tokens get no gradient


def test_nothing_weighted_gives_zero_loss_and_gradient():
    logp = jnp.full((2, 3), -0.1)
    zeros = jnp.zeros((2, 3), jnp.int32)
    loss, g = jax.value_and_grad(lambda lp: figa_loss(lp, zeros, jnp.ones((2, 3)),
                                                      jnp.array([True, False]))[0])(logp)
    assert float(loss) == 0 and np.all(np.asarray(g) == 0)


def test_loss_bad_inputs():
    logp = jnp.zeros((2, 3))
    marks = jnp.zeros((2, 3), jnp.int32)
    mask = jnp.ones((2, 3))
    rev = jnp.array([True, False])
    with pytest.raises(ValueError, match=r"marks shape \(2, 4\) does not match logp shape"):
        figa_loss(logp, jnp.zeros((2, 4), jnp.int32), mask, rev)
    with pytest.raises(ValueError, match=r"revised shape \(3,\) must be \[B\] = \(2,\)"):
        figa_loss(logp, marks, mask, jnp.ones(3, bool))
    with pytest.raises(ValueError, match=r"marks must lie in \{-1, 0, 1\}, got range \[0, 2\]"):
        figa_loss(logp, marks.at[0, 0].set(2), mask, rev)
    with pytest.raises(ValueError, match="marks must be integers"):
        figa_loss(logp, marks.astype(jnp.float32), mask, rev)
    with pytest.raises(ValueError, match="unknown weighting 'soft'"):
        FigaConfig(weighting="soft")
    with pytest.raises(ValueError, match="neg_nll_min <= neg_nll_max"):
        FigaConfig(neg_nll_min=0.7, neg_nll_max=0.6)


# ----------------------------------------------------------------------------- baselines


def test_dpo_and_sft_equal_numpy():
    rng = np.random.default_rng(3)
    pc, pr, rc, rr = (rng.normal(-3, 1, 5).astype(np.float32) for _ in range(4))
    loss, m = dpo_loss(*(jnp.asarray(x) for x in (pc, pr, rc, rr)), beta=0.1)
    z = 0.1 * ((pc - rc) - (pr - rr))
    np.testing.assert_allclose(float(loss), np.mean(np.log1p(np.exp(-z))), rtol=1e-6)
    assert float(m["reward_accuracy"]) == pytest.approx(np.mean(z > 0))
    g = jax.grad(lambda c: dpo_loss(c, jnp.asarray(pr), jnp.asarray(rc), jnp.asarray(rr))[0])(
        jnp.asarray(pc))
    assert np.all(np.asarray(g) < 0)  # raising the chosen log-prob lowers the loss
    logp = jnp.asarray(np.log(rng.uniform(0.1, 1, (3, 4))), jnp.float32)
    mask = jnp.asarray([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    lp, mk = np.asarray(logp), np.asarray(mask) > 0
    np.testing.assert_allclose(sequence_logp(logp, mask), np.where(mk, lp, 0).sum(1), rtol=1e-6)
    np.testing.assert_allclose(float(sft_loss(logp, mask)[0]), -lp[mk].mean(), rtol=1e-6)
    with pytest.raises(ValueError, match=r"ref_rejected shape \(4,\) must be \[P\] = \(5,\)"):
        dpo_loss(jnp.asarray(pc), jnp.asarray(pr), jnp.asarray(rc), jnp.asarray(rr[:4]))


# ----------------------------------------------------------------------------- pairs


def test_pairs_from_samples_with_oracle_revision():
    tok = CharTokenizer()
    texts = ["12+5=", "12+5=", "9+9=", "40+3="]
    prompts, lengths = tok.pad_batch([tok.encode(t, bos=True) for t in texts], 7)
    samples = [tok.encode("17", eos=True),   # right: no pair
               tok.encode("83", eos=True),   # wrong: two replaces (no common digit)
               tok.encode("8", eos=True),    # wrong: "18" needs one insert
               tok.encode("433")]            # no EOS (truncated): no pair
    tokens, _ = tok.pad_batch(samples, 4)
    rewards = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
    data = build_pairs(texts, prompts, lengths, tokens, rewards, tok, addition_answers, length=4)
    assert data.prompt_texts == ["12+5=", "9+9="]
    p = data.pairs
    assert tok.decode(p.revised_tokens[0]) == "17" and tok.decode(p.revised_tokens[1]) == "18"
    np.testing.assert_array_equal(p.original_marks, [[-1, -1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(p.revised_marks, [[1, 1, 1, 0], [1, 0, 1, 0]])
    rows = interleave_rows(data, np.array([1, 0]))
    np.testing.assert_array_equal(rows.revised, [True, False, True, False])
    np.testing.assert_array_equal(rows.tokens[0], p.revised_tokens[1])
    np.testing.assert_array_equal(rows.tokens[1], p.original_tokens[1])
    np.testing.assert_array_equal(rows.prompts[2], data.prompts[0])
    assert minimal_revision([5, 6], [[9, 9, 9], [5, 7], [5, 6, 1]]) == [5, 7]
    assert build_pairs(texts[:1], prompts[:1], lengths[:1], tokens[:1], rewards[:1], tok,
                       addition_answers, length=4) is None
    with pytest.raises(ValueError, match=r"rewards shape \(3,\) must have 4 rows"):
        build_pairs(texts, prompts, lengths, tokens, rewards[:3], tok, addition_answers, length=4)


def test_lowers_for_tpu_and_cuda():
    def loss_grad(logp, marks, mask, revised):
        return jax.grad(lambda lp: figa_loss(lp, marks, mask, revised)[0])(logp)

    args = (jax.ShapeDtypeStruct((4, 6), jnp.float32), jax.ShapeDtypeStruct((4, 6), jnp.int32),
            jax.ShapeDtypeStruct((4, 6), jnp.bool_), jax.ShapeDtypeStruct((4,), jnp.bool_))
    exported = jax.export.export(jax.jit(loss_grad), platforms=("tpu", "cuda"))(*args)
    assert exported.platforms == ("tpu", "cuda")

"""The numpy reference forward pass: its parts on small inputs, then the real model."""
import numpy as np
import pytest

from magnitude.tokenizer import Tokenizer
from reference import attention, reference_logits, rope


@pytest.fixture(scope="module")
def france(model_file):
    tok = Tokenizer.from_model(model_file)
    ids = tok.encode("The capital of France is")
    return tok, ids, reference_logits(model_file, ids)


def test_rope_position_zero_is_identity_and_norms_are_kept():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 8)).astype(np.float32)  # [n_tok, heads, hd]
    out = rope(x, np.arange(5), 10000.0)
    np.testing.assert_array_equal(out[0], x[0])
    # Each adjacent pair is rotated, so its length is kept.
    pair_norm = lambda a: np.hypot(a[..., 0::2], a[..., 1::2])  # noqa: E731
    np.testing.assert_allclose(pair_norm(out), pair_norm(x), rtol=1e-5)
    assert not np.allclose(out[1:], x[1:])


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 1, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 16)).astype(np.float32)
    score = lambda m, n: float(  # noqa: E731
        (rope(q, np.array([m]), 100.0) * rope(k, np.array([n]), 100.0)).sum())
    assert score(7, 3) == pytest.approx(score(14, 10), rel=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 4), rel=1e-3)


def test_rope_rotates_adjacent_pairs_not_halves():
    # Only x[0] set: the normal (adjacent-pair) convention moves it into x[1]; the
    # half-split convention would move it into x[hd/2].
    x = np.zeros((2, 1, 8), dtype=np.float32)
    x[:, 0, 0] = 1.0
    out = rope(x, np.arange(2), 10000.0)
    assert out[1, 0, 1] == pytest.approx(np.sin(1.0), rel=1e-6)
    assert out[1, 0, 0] == pytest.approx(np.cos(1.0), rel=1e-6)
    assert np.all(out[1, 0, 2:] == 0)


def test_attention_is_causal_and_groups_query_heads():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((4, 6, 8)).astype(np.float32)  # 6 query heads
    k = rng.standard_normal((4, 2, 8)).astype(np.float32)  # 2 kv heads: group of 3
    v = rng.standard_normal((4, 2, 8)).astype(np.float32)
    out = attention(q, k, v)
    # Position 0 sees only itself: each head returns its kv head's value at 0.
    for h in range(6):
        np.testing.assert_allclose(out[0, h], v[0, h // 3], rtol=1e-6)
    # Changing the last position changes nothing before it.
    k2, v2 = k.copy(), v.copy()
    k2[3] += 5.0
    v2[3] -= 5.0
    np.testing.assert_array_equal(attention(q, k2, v2)[:3], out[:3])


def test_real_model_predicts_paris(france):
    tok, ids, logits = france
    assert ids == [504, 3575, 282, 4649, 314]
    assert logits.shape == (5, 49152) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    top = np.argsort(-logits[-1])
    assert tok.decode([int(top[0])]) == " Paris"
    # A clear winner, not a coin toss: a broken RoPE or GQA mapping loses this margin.
    assert logits[-1, top[0]] - logits[-1, top[1]] > 1.0


def test_real_model_is_causal(model_file, france):
    _, ids, logits = france
    prefix = reference_logits(model_file, ids[:3])
    np.testing.assert_allclose(prefix, logits[:3], rtol=1e-4, atol=1e-3)
    changed = reference_logits(model_file, ids[:3] + [905, 17])
    np.testing.assert_allclose(changed[:3], logits[:3], rtol=1e-4, atol=1e-3)
    assert not np.allclose(changed[3:], logits[3:], atol=1e-2)


def test_reference_rejects_bad_ids(model_file):
    with pytest.raises(ValueError, match="49152"):
        reference_logits(model_file, [1, 49152])
    with pytest.raises(ValueError):
        reference_logits(model_file, [])

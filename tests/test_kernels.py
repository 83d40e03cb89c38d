"""The quantized kernels against slow, obvious numpy oracles.

Weights come from gguf.quants (the reference implementation of the GGUF block formats);
activations from a numpy transcription of ggml's quantize_row_q8_0/q8_1 reference. Every SIMD
path this CPU supports is run and must agree with the scalar path bit for bit.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize, quantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from magnitude import kernels as K
from magnitude._ext import kernels as _k

GGML = {"q4_0": GT.Q4_0, "q4_1": GT.Q4_1, "q8_0": GT.Q8_0}
PATHS = K.supported_paths()
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def restore_path():
    before = K.kernel_path()
    yield
    K.set_kernel_path(before)


# ---- numpy oracles ----

def np_quantize(x: np.ndarray, q8_1: bool) -> np.ndarray:
    """ggml quantize_row_q8_0_ref / q8_1_ref in numpy, float32 arithmetic as in C."""
    x = np.asarray(x, dtype=np.float32)
    T, n = x.shape
    xb = x.reshape(T, n // 32, 32)  # [T, blocks, 32]
    amax = np.abs(xb).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    v = np.clip(xb * inv[:, :, None], -127, 127).astype(np.float32)
    # roundf: half away from zero (np.round would round half to even); float64 makes +0.5 exact
    q = (np.sign(v) * np.floor(np.abs(v).astype(np.float64) + 0.5)).astype(np.int8)
    head = [d.astype(np.float16)[:, :, None].view(np.uint8)]
    if q8_1:
        s = (q.astype(np.int32).sum(axis=2).astype(np.float32) * d).astype(np.float16)
        head.append(s[:, :, None].view(np.uint8))
    return np.concatenate(head + [q.view(np.uint8)], axis=2).reshape(T, -1)


def act_parts(xq: np.ndarray, qtype: str):
    """(d [T, nb], s [T, nb] or None, q [T, nb, 32]) of quantized activations, as float64."""
    bb = K.ACT_BLOCK_BYTES[qtype]
    b = xq.reshape(xq.shape[0], -1, bb)
    d = b[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float64)
    s = b[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float64) if bb == 36 else None
    return d, s, b[:, :, bb - 32:].view(np.int8).astype(np.float64)


def ref_matmul(w_raw: np.ndarray, qtype: str, xq: np.ndarray):
    """float64 (y, sum of |terms|) for weights dequantized by gguf.quants. Q4_1 is
    sum (d_w q_w + m_w) d_x q_x with d_x sum(q_x) replaced by the stored s_x, as the format says."""
    wd = dequantize(w_raw, GGML[qtype]).astype(np.float64)  # [rows, cols]
    d, s, q = act_parts(xq, qtype)
    xd = (d[:, :, None] * q).reshape(xq.shape[0], -1)  # [T, cols]
    y, mag = xd @ wd.T, np.abs(xd) @ np.abs(wd).T
    if qtype == "q4_1":
        m = w_raw.reshape(w_raw.shape[0], -1, 20)[:, :, 2:4].copy().view(np.float16)[:, :, 0]
        m = m.astype(np.float64)  # [rows, nb]
        corr = s - d * q.sum(axis=2)  # [T, nb]
        y, mag = y + corr @ m.T, mag + np.abs(s) @ np.abs(m).T
    return y, mag


def ref_block_sums(w_raw: np.ndarray, qtype: str, xq_row: np.ndarray) -> np.ndarray:
    """Exact int64 per-block sums of q_w * q_x for each weight row: [rows, nb]."""
    bb = K.BLOCK_BYTES[qtype]
    blocks = w_raw.reshape(w_raw.shape[0], -1, bb)
    if qtype == "q8_0":
        qw = blocks[:, :, 2:].view(np.int8).astype(np.int64)
    else:
        packed = blocks[:, :, bb - 16:].astype(np.int64)
        qw = np.concatenate([packed & 15, packed >> 4], axis=2)  # low nibbles first
        if qtype == "q4_0":
            qw -= 8
    _, _, qx = act_parts(xq_row[None], qtype)
    return (qw * qx[0].astype(np.int64)).sum(axis=2)


def make_weights(rng, rows, cols, qtype, scale=1.0):
    w = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    return quantize(w, GGML[qtype])  # uint8 [rows, row_bytes]


# ---- quantizers ----

@st.composite
def float_rows(draw, max_t=4, max_blocks=6):
    T = draw(st.integers(1, max_t))
    n = 32 * draw(st.integers(1, max_blocks))
    kind = draw(st.sampled_from(["normal", "zeros", "constant", "extreme", "tiny", "mixed"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    x = rng.standard_normal((T, n))
    if kind == "zeros":
        x[:] = 0
    elif kind == "constant":
        x[:] = draw(st.floats(-1e3, 1e3, allow_nan=False))
    elif kind == "extreme":
        x *= 10.0 ** rng.integers(-30, 30, size=(T, n))
    elif kind == "tiny":
        x *= 1e-38  # d becomes a float subnormal: 1/d overflows
    elif kind == "mixed":
        x[:, ::3] = 0
        x[:, 1::7] *= 1e4
    return x.astype(np.float32)


@SETTINGS
@given(x=float_rows())
def test_quantizers_are_byte_exact_against_ggml_reference(x):
    with np.errstate(over="ignore"):
        want_0, want_1 = np_quantize(x, False), np_quantize(x, True)
    for path in PATHS:  # the SIMD quantizer must give the scalar one's bytes
        K.set_kernel_path(path)
        np.testing.assert_array_equal(K.quantize_q8_0(x), want_0, err_msg=path)
        np.testing.assert_array_equal(K.quantize_q8_1(x), want_1, err_msg=path)


@pytest.mark.parametrize("path", PATHS)
def test_quantizer_rounds_half_away_from_zero(path):
    K.set_kernel_path(path)
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 127.0  # d = 1 exactly, so x/d = x
    x[0, 1:7] = [0.5, -0.5, 2.5, -2.5, 0.49999997, -126.5]
    q = K.quantize_q8_0(x)[0, 2:].view(np.int8)
    assert list(q[:7]) == [127, 1, -1, 3, -3, 0, -127]


def test_quantize_1d_and_q8_0_matches_gguf_roundtrip():
    x = np.linspace(-3, 3, 64, dtype=np.float32)
    q = K.quantize_q8_0(x)
    assert q.shape == (68,)
    back = dequantize(q, GT.Q8_0)
    np.testing.assert_allclose(back, x, atol=3 / 127 / 2 + 1e-3)


# ---- matmul ----

@st.composite
def matmul_case(draw):
    qtype = draw(st.sampled_from(sorted(GGML)))
    rows = draw(st.integers(1, 40))
    cols = 32 * draw(st.integers(1, 12))
    T = draw(st.sampled_from([1, 2, 3, 5, 17, 33, 40]))  # GEMV, one GEMM tile, two tiles
    seed = draw(st.integers(0, 2**31))
    wscale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    xkind = draw(st.sampled_from(["normal", "zeros", "constant", "big", "small"]))
    return qtype, rows, cols, T, seed, wscale, xkind


def make_x(rng, T, cols, kind):
    x = rng.standard_normal((T, cols)).astype(np.float32)  # [T, cols]
    if kind == "zeros":
        x[:] = 0
    elif kind == "constant":
        x[:] = 0.75
    elif kind == "big":  # Q8_1's fp16 s = d*sum(q) overflows past |x| ~ 2000: a format limit
        x *= 300
    elif kind == "small":
        x *= 1e-4
    return x


@SETTINGS
@given(case=matmul_case())
def test_matmul_matches_float64_oracle_on_every_path(case):
    qtype, rows, cols, T, seed, wscale, xkind = case
    rng = np.random.default_rng(seed)
    w = make_weights(rng, rows, cols, qtype, wscale)
    x = make_x(rng, T, cols, xkind)
    xq = K.quantize_for(qtype, x)
    ref, mag = ref_matmul(w, qtype, xq)
    nb = cols // 32
    results = {}
    for path in PATHS:
        K.set_kernel_path(path)
        y = K.matmul(w, qtype, x)
        assert y.shape == (T, rows) and y.dtype == np.float32
        # float32 sums of nb block terms: rounding error grows at most ~ nb ulps of sum|terms|
        np.testing.assert_array_less(np.abs(y - ref), 1e-6 * (nb + 4) * mag + 1e-30)
        results[path] = y
    for path in PATHS:  # same int32 sums, same float expression, same order: same bits
        np.testing.assert_array_equal(results[path], results["scalar"], err_msg=path)


@pytest.mark.parametrize("qtype", sorted(GGML))
def test_block_sums_are_exact_on_every_path(qtype):
    rng = np.random.default_rng(1)
    cols = 256
    w = make_weights(rng, 8, cols, qtype)
    # worst case for int32 and for the AVX2 int16 pair sums: extreme nibbles and |q| = 127
    bb = K.BLOCK_BYTES[qtype]
    w.reshape(8, -1, bb)[0, 0, bb - 16:] = 0xFF if qtype != "q8_0" else 0
    if qtype == "q8_0":
        w.reshape(8, -1, bb)[1, 0, 2:] = np.int8(-128).view(np.uint8)  # |w| = 128 on the u8 side
        w.reshape(8, -1, bb)[2, 0, 2:] = 127
    x = rng.standard_normal(cols).astype(np.float32)
    x[:32] = 127.0
    x[32:64] = -127.0
    xq = K.quantize_for(qtype, x[None])[0]
    ref = ref_block_sums(w, qtype, xq)
    for path in PATHS:
        K.set_kernel_path(path)
        np.testing.assert_array_equal(_k.block_sums(K.QTYPES[qtype], w, xq), ref, err_msg=path)


@pytest.mark.parametrize("qtype", sorted(GGML))
def test_threads_give_identical_results(qtype):
    rng = np.random.default_rng(2)
    w = make_weights(rng, 203, 320, qtype)  # rows not a multiple of 8: a tail on each side
    x = rng.standard_normal((3, 320)).astype(np.float32)
    one = K.matmul(w, qtype, x, n_threads=1)
    for n in (2, 3, 7):
        np.testing.assert_array_equal(K.matmul(w, qtype, x, n_threads=n), one)


@SETTINGS
@given(qtype=st.sampled_from(sorted(GGML)), rows=st.integers(1, 30), T=st.integers(1, 70),
       data=st.data())
def test_any_row_range_matches_the_full_product(qtype, rows, T, data):
    """The executor's threads call mg_matmul on arbitrary [r0, r1): same bits, nothing else
    written."""
    r0 = data.draw(st.integers(0, rows))
    r1 = data.draw(st.integers(r0, rows))
    rng = np.random.default_rng(rows * 100 + T)
    w = make_weights(rng, rows, 64, qtype)
    xq = K.quantize_for(qtype, rng.standard_normal((T, 64)).astype(np.float32))
    full = K.matmul_q(w, qtype, xq)
    for path in PATHS:
        K.set_kernel_path(path)
        y = np.full((T, rows), np.nan, dtype=np.float32)
        _k.matmul_rows(K.QTYPES[qtype], w, 64, xq, y, r0, r1)
        np.testing.assert_array_equal(y[:, r0:r1], full[:, r0:r1], err_msg=path)
        assert np.isnan(y[:, :r0]).all() and np.isnan(y[:, r1:]).all()


@pytest.mark.parametrize("qtype", sorted(GGML))
def test_long_rows_match_oracle_and_scalar(qtype):
    """Rows of more than 512 blocks take the GEMV branch that converts activation scales in
    place rather than up front."""
    rng = np.random.default_rng(11)
    cols = 32 * 515
    w = make_weights(rng, 9, cols, qtype)
    xq = K.quantize_for(qtype, rng.standard_normal((1, cols)).astype(np.float32))
    ref, mag = ref_matmul(w, qtype, xq)
    K.set_kernel_path("scalar")
    scalar = K.matmul_q(w, qtype, xq)
    for path in PATHS:
        K.set_kernel_path(path)
        y = K.matmul_q(w, qtype, xq)
        np.testing.assert_array_equal(y, scalar, err_msg=path)
    np.testing.assert_array_less(np.abs(scalar - ref), 1e-6 * 520 * mag)


def test_matmul_q_writes_into_out_and_1d_input():
    rng = np.random.default_rng(3)
    w = make_weights(rng, 24, 64, "q4_1")
    x = rng.standard_normal(64).astype(np.float32)
    y1 = K.matmul(w, "q4_1", x)
    assert y1.shape == (24,)
    out = np.full((1, 24), np.nan, dtype=np.float32)
    r = K.matmul_q(w, "q4_1", K.quantize_q8_1(x[None]), out=out)
    assert r is out
    np.testing.assert_array_equal(out[0], y1)


# ---- float helpers ----

def test_rmsnorm_matches_numpy_and_may_alias():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 576)).astype(np.float32) * 5
    w = rng.standard_normal(576).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(K.rmsnorm(x, w, 1e-5), ref, rtol=2e-6, atol=1e-6)
    K.rmsnorm(x, w, 1e-5, out=x)
    np.testing.assert_allclose(x, ref, rtol=2e-6, atol=1e-6)


def np_rope(x, n_heads, head_dim, pos, base):
    x = x.astype(np.float64).reshape(len(pos), n_heads, head_dim // 2, 2)
    i = np.arange(head_dim // 2)
    theta = np.asarray(pos, np.float64)[:, None] * base ** (-2.0 * i / head_dim)  # [T, hd/2]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a, b = x[..., 0], x[..., 1]
    return np.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(len(pos), -1)


def test_rope_rotates_adjacent_pairs():
    rng = np.random.default_rng(5)
    pos = [0, 1, 7, 2047, 30000]
    x = rng.standard_normal((len(pos), 9 * 64)).astype(np.float32)
    y = K.rope(x, 9, 64, pos, 100000.0)
    np.testing.assert_allclose(y, np_rope(x, 9, 64, pos, 100000.0), rtol=1e-5, atol=2e-6)
    np.testing.assert_array_equal(y[0], x[0])  # position 0 is the identity
    # a rotation keeps the norm of every pair
    pairs = lambda a: np.hypot(a[..., 0::2], a[..., 1::2])  # noqa: E731
    np.testing.assert_allclose(pairs(y), pairs(x), rtol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_softmax_matches_float64(path):
    K.set_kernel_path(path)  # the SIMD paths use a vectorised exp: it must stay this accurate
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((5, 301)) * 30).astype(np.float32)
    x[1] = -1e30  # all equal, very negative: still uniform
    x[2] = np.linspace(-87, 0, 301)  # the whole range the exp is asked for
    x[3, :150] = -1e30  # exp underflows to 0 for half the row
    e = np.exp((x - x.max(axis=1, keepdims=True)).astype(np.float64))  # f32 subtraction, as C
    np.testing.assert_allclose(K.softmax(x), e / e.sum(axis=1, keepdims=True), rtol=1e-6,
                               atol=1e-37)


@pytest.mark.parametrize("path", PATHS)
def test_silu_add(path):
    K.set_kernel_path(path)
    rng = np.random.default_rng(6)
    g = np.concatenate([rng.standard_normal(500) * 10, np.linspace(-100, 100, 64),
                        [-200.0, 200.0, 0.0, -87.5, -88.5, 88.5]]).astype(np.float32)
    u = rng.standard_normal(g.shape).astype(np.float32)
    g64 = g.astype(np.float64)
    ref = g64 / (1 + np.exp(-g64)) * u
    np.testing.assert_allclose(K.silu_mul(g, u), ref, rtol=2e-6, atol=1e-30)
    np.testing.assert_array_equal(K.add(g, u), g + u)


@pytest.mark.parametrize("qtype", sorted(GGML))
def test_dequant_row_matches_gguf(qtype):
    rng = np.random.default_rng(7)
    w = make_weights(rng, 50, 96, qtype)
    full = dequantize(w, GGML[qtype])
    ids = np.array([0, 49, 3, 3])
    np.testing.assert_array_equal(K.dequant_row(w, qtype, ids), full[ids])
    np.testing.assert_array_equal(K.dequant_row(w, qtype, 5), full[5])


def np_attention(q, k, v, n_pos, n_head, n_kv, scale):
    hd = q.shape[0] // n_head
    out = np.zeros((n_head, hd))
    for h in range(n_head):
        kvh = h // (n_head // n_kv)
        kh = k[:n_pos, kvh * hd:(kvh + 1) * hd].astype(np.float64)  # [n_pos, hd]
        vh = v[:n_pos, kvh * hd:(kvh + 1) * hd].astype(np.float64)
        s = kh @ q[h * hd:(h + 1) * hd] * scale
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ vh
    return out.reshape(-1)


@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("n_threads,hd", [(1, 64), (2, 64), (4, 64), (1, 12), (2, 136)])
def test_attention_matches_numpy(f16, n_threads, hd):
    """head_dim 12 and 136 take the SIMD paths' fallback (not a multiple of 8 / over 128)."""
    rng = np.random.default_rng(8)
    n_head, n_kv, n_ctx = 9, 3, 40
    q = rng.standard_normal(n_head * hd).astype(np.float32)
    k = rng.standard_normal((n_ctx, n_kv * hd)).astype(np.float16 if f16 else np.float32)
    v = rng.standard_normal((n_ctx, n_kv * hd)).astype(k.dtype)
    for path in ("scalar", PATHS[-1]):
        K.set_kernel_path(path)
        for n_pos in (1, 17, 33):
            got = K.attention(q, k, v, n_pos, n_head, n_kv, n_threads=n_threads)
            ref = np_attention(q, k, v, n_pos, n_head, n_kv, 1 / np.sqrt(hd))
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    # causality: what lies past n_pos is never read
    k2, v2 = k.copy(), v.copy()
    k2[20:], v2[20:] = np.nan, np.nan
    np.testing.assert_array_equal(K.attention(q, k2, v2, 20, n_head, n_kv),
                                  K.attention(q, k, v, 20, n_head, n_kv))


def test_f32_to_f16_matches_numpy_rounding():
    rng = np.random.default_rng(9)
    x = np.concatenate([rng.standard_normal(1000) * 10.0 ** rng.integers(-9, 6, 1000),
                        [0.0, -0.0, 65504, 65520, 1e6, -1e6, 6e-8, 3e-8, 2.9e-8, np.inf,
                         -np.inf]]).astype(np.float32)
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16)
    np.testing.assert_array_equal(K.f32_to_f16(x).view(np.uint16), ref.view(np.uint16))


# ---- path selection and bad input ----

def test_every_supported_path_can_be_selected():
    assert PATHS[0] == "scalar"
    feats = K.cpu_features()
    for name in ("avx2", "avxvnni", "avx512vnni"):
        assert (name in PATHS) == feats[name]
    for path in PATHS:
        K.set_kernel_path(path)
        assert K.kernel_path() == path
    with pytest.raises(ValueError, match="not one of"):
        K.set_kernel_path("sse9")


def _import_with_env(value):
    code = "from magnitude import kernels as K; print(K.kernel_path())"
    env = dict(os.environ, MAGNITUDE_KERNEL=value)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_magnitude_kernel_env_var():
    r = _import_with_env("scalar")
    assert r.returncode == 0 and r.stdout.strip() == "scalar", r.stderr
    r = _import_with_env("avx9000")
    assert r.returncode != 0 and "MAGNITUDE_KERNEL='avx9000'" in r.stderr


def test_bad_inputs_raise_value_error():
    rng = np.random.default_rng(10)
    w = make_weights(rng, 8, 64, "q4_1")
    x = rng.standard_normal((2, 64)).astype(np.float32)
    with pytest.raises(ValueError, match="q4_2"):
        K.matmul(w, "q4_2", x)
    with pytest.raises(ValueError, match="x rows have 96 values"):
        K.matmul(w, "q4_1", np.zeros((1, 96), np.float32))
    with pytest.raises(ValueError, match="30 bytes"):
        K.matmul(w[:, :30].copy(), "q4_1", x)
    with pytest.raises(ValueError, match="uint8"):
        K.matmul(w.astype(np.int16), "q4_1", x)
    with pytest.raises(ValueError, match="activation rows are 68 bytes"):
        K.matmul_q(w, "q4_1", K.quantize_q8_0(x))  # Q8_0 activations for Q4_1 weights
    with pytest.raises(ValueError, match=r"out has shape \(2, 7\)"):
        K.matmul_q(w, "q4_1", K.quantize_q8_1(x), out=np.empty((2, 7), np.float32))
    bad = K.quantize_q8_1(x)
    bad[1, 36 + 4 + 5] = 0x80  # -128: the one int8 our quantizers never make
    with pytest.raises(ValueError, match="row 1 block 1 holds the value -128 at 5"):
        K.matmul_q(w, "q4_1", bad)
    with pytest.raises(ValueError, match="n_threads=0"):
        K.matmul(w, "q4_1", x, n_threads=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        K.quantize_q8_0(np.zeros(33, np.float32))
    with pytest.raises(ValueError, match="row id 8"):
        K.dequant_row(w, "q4_1", [8])
    with pytest.raises(ValueError, match="row id 9223372036854775808"):  # not wrapped negative
        K.dequant_row(w, "q4_1", np.array([2**63], np.uint64))
    with pytest.raises(ValueError, match="positions 2147483648"):
        K.rope(np.zeros((1, 8), np.float32), 2, 4, [2**31])
    with pytest.raises(ValueError, match="w must be a 1-D"):
        K.rmsnorm(np.zeros((2, 8), np.float32), np.ones((2, 4), np.float32))
    with pytest.raises(ValueError, match="empty"):
        K.softmax(np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="head_dim"):
        K.rope(np.zeros((1, 10), np.float32), 2, 5, [0])
    with pytest.raises(ValueError, match="positions given"):
        K.rope(np.zeros((2, 8), np.float32), 2, 4, [0])
    kv = np.zeros((4, 64), np.float32)
    with pytest.raises(ValueError, match="n_kv_head"):
        K.attention(np.zeros(128, np.float32), kv, kv, 2, 2, 3)
    with pytest.raises(ValueError, match="at least"):
        K.attention(np.zeros(128, np.float32), kv, kv, 5, 2, 1)
    with pytest.raises(ValueError, match="float16"):
        K.attention(np.zeros(128, np.float32), kv, kv.astype(np.float16), 2, 2, 1)
    with pytest.raises(ValueError, match="lengths differ"):
        K.silu_mul(np.zeros(3, np.float32), np.zeros(4, np.float32))

"""The quantized compute kernels, validated: for tests, benchmarks and users.

The executor calls the C functions of magnitude/_ext/mg_kernels.h directly; this module is the
checked, allocating, numpy-facing way in. Weights are raw GGUF blocks (uint8 [rows, row_bytes]);
activations are quantized per 32 values to Q8_0 (for Q4_0/Q8_0 weights) or Q8_1 (for Q4_1).

    w = model_tensor_bytes                  # uint8 [1536, 360]: 1536 rows of 576 Q4_1 values
    y = kernels.matmul(w, "q4_1", x)        # x float32 [T, 576] -> y float32 [T, 1536]
"""
from __future__ import annotations

import numpy as np

from ._ext import kernels as _k

HAVE_OPENMP = bool(_k.OPENMP)
PATHS = _k.PATH_NAMES  # ("scalar", "avx2", "avxvnni", "avx512vnni")
QTYPES = dict(_k.QTYPES)  # name -> ggml type id
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
ACT_BLOCK_BYTES = {"q4_0": 34, "q4_1": 36, "q8_0": 34}  # Q8_1 pairs with Q4_1, Q8_0 otherwise


def cpu_features() -> dict:
    f = _k.cpu_features()
    return {"avx2": bool(f & 1), "avxvnni": bool(f & 2), "avx512vnni": bool(f & 4)}


def supported_paths() -> list[str]:
    return list(_k.supported_paths())


def kernel_path() -> str:
    return PATHS[_k.kernel_path()]


def set_kernel_path(name: str) -> None:
    """Force a kernel path for this process ("scalar", "avx2", "avxvnni", "avx512vnni")."""
    if name not in PATHS:
        raise ValueError(f"kernel path {name!r} is not one of {', '.join(PATHS)}")
    _k.set_kernel_path(PATHS.index(name))


def _qtype(qtype: str) -> int:
    if qtype not in QTYPES:
        raise ValueError(f"qtype {qtype!r} is not supported; use one of {', '.join(QTYPES)}")
    return QTYPES[qtype]


def _float_rows(x, name="x") -> tuple[np.ndarray, bool]:
    """x as C-contiguous float32 [T, n]; also whether it was 1-D."""
    a = np.asarray(x)
    if a.ndim not in (1, 2):
        raise ValueError(f"{name} must be 1-D or 2-D, got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"{name} must be a float array, got dtype {a.dtype}")
    if a.size == 0:
        raise ValueError(f"{name} is empty (shape {a.shape})")
    return np.ascontiguousarray(a.reshape(-1, a.shape[-1]), dtype=np.float32), a.ndim == 1


def _int_vector(values, name: str, low: int, high: int) -> np.ndarray:
    """values as int64 [n], each checked in [low, high) BEFORE the cast (a uint64 past 2**63
    would otherwise wrap to a negative number)."""
    v = np.atleast_1d(np.asarray(values))
    if v.ndim != 1 or not np.issubdtype(v.dtype, np.integer):
        raise ValueError(f"{name} must be integers (one or a 1-D array), got {v.dtype} {v.shape}")
    for i in v.tolist():  # Python ints: exact whatever the dtype
        if not low <= i < high:
            raise ValueError(f"{name} {i} is outside {low}..{high - 1}")
    return np.ascontiguousarray(v, dtype=np.int64)


def _quantize(x, kind: int, bb: int) -> np.ndarray:
    a, flat = _float_rows(x)
    if a.shape[1] % 32:
        raise ValueError(f"row length {a.shape[1]} is not a multiple of 32 (the block size)")
    out = np.empty((a.shape[0], a.shape[1] // 32 * bb), dtype=np.uint8)  # [T, n] -> [T, blocks*bb]
    _k.quantize(a, out, kind)
    return out[0] if flat else out


def quantize_q8_0(x) -> np.ndarray:
    """float32 [T, n] (or [n]) -> uint8 [T, n/32*34]: ggml Q8_0 blocks (fp16 d, int8 qs[32])."""
    return _quantize(x, 0, 34)


def quantize_q8_1(x) -> np.ndarray:
    """float32 [T, n] (or [n]) -> uint8 [T, n/32*36]: ggml Q8_1 blocks (fp16 d, fp16 s, qs[32])."""
    return _quantize(x, 1, 36)


def quantize_for(qtype: str, x) -> np.ndarray:
    """The activation quantization that pairs with weights of `qtype`."""
    return quantize_q8_1(x) if _qtype(qtype) == QTYPES["q4_1"] else quantize_q8_0(x)


def _weight(w_raw, qtype: str) -> np.ndarray:
    w = np.asarray(w_raw)
    if w.dtype != np.uint8 or w.ndim != 2:
        raise ValueError(f"weights must be uint8 [rows, row_bytes] raw GGUF blocks, got "
                         f"{w.dtype} {w.shape}")
    if w.shape[1] == 0 or w.shape[1] % BLOCK_BYTES[qtype]:
        raise ValueError(f"weight rows are {w.shape[1]} bytes, not a whole number of "
                         f"{BLOCK_BYTES[qtype]}-byte {qtype} blocks")
    if not w.flags.c_contiguous:
        raise ValueError("weights must be C-contiguous (a row every row_bytes bytes)")
    return w


def matmul_q(w_raw, qtype: str, xq, out=None, n_threads: int | None = None) -> np.ndarray:
    """out[t, r] = weight row r . activation row t, from pre-quantized activations xq
    (uint8 [T, blocks*34 or 36], see quantize_for). Writes into `out` (float32 [T, rows],
    C-contiguous) without allocating when given."""
    qid = _qtype(qtype)
    w = _weight(w_raw, qtype)
    xq = np.asarray(xq)
    if xq.dtype != np.uint8 or xq.ndim != 2 or not xq.flags.c_contiguous:
        raise ValueError(f"xq must be C-contiguous uint8 [T, row_bytes], got {xq.dtype} "
                         f"{xq.shape}")
    cols = w.shape[1] // BLOCK_BYTES[qtype] * 32
    _check_act_values(xq, qtype)
    if out is None:
        out = np.empty((xq.shape[0], w.shape[0]), dtype=np.float32)  # [T, rows]
    elif not (isinstance(out, np.ndarray) and out.dtype == np.float32
              and out.flags.c_contiguous and out.ndim == 2):
        raise ValueError("out must be a C-contiguous float32 [T, rows] numpy array")
    _k.matmul_q(qid, w, cols, xq, out, n_threads)
    return out


def _check_act_values(xq: np.ndarray, qtype: str) -> None:
    """The SIMD paths put the sign of a Q8_0 weight onto the activation (ggml's sign trick), and
    -x overflows for x = -128: activation values must be in [-127, 127], as our quantizers (and
    ggml's) make them."""
    bb = ACT_BLOCK_BYTES[qtype]
    if xq.size == 0 or xq.shape[1] % bb:
        return  # the shape check in the extension names the problem
    qs = xq.reshape(xq.shape[0], -1, bb)[:, :, bb - 32:].view(np.int8)  # [T, blocks, 32]
    if (qs == -128).any():
        t, b, j = (int(i[0]) for i in np.nonzero(qs == -128))
        raise ValueError(f"activation row {t} block {b} holds the value -128 at {j}; quantized "
                         f"activations must be in [-127, 127] (use quantize_for)")


def matmul(w_raw, qtype: str, x, n_threads: int | None = None, out=None) -> np.ndarray:
    """float32 [T, rows] = x [T, cols] @ W.T for raw GGUF weights W (uint8 [rows, row_bytes]).
    x is quantized per 32 values first (Q8_1 for q4_1, Q8_0 otherwise). x may be 1-D."""
    w = _weight(w_raw, _check_name(qtype))
    a, flat = _float_rows(x)
    cols = w.shape[1] // BLOCK_BYTES[qtype] * 32
    if a.shape[1] != cols:
        raise ValueError(f"x rows have {a.shape[1]} values; the weight rows have {cols}")
    y = matmul_q(w, qtype, quantize_for(qtype, a), out=out, n_threads=n_threads)
    return y[0] if flat else y


def _check_name(qtype: str) -> str:
    _qtype(qtype)
    return qtype


def rmsnorm(x, w, eps: float = 1e-5, out=None) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w, per row. out may be x itself."""
    a, flat = _float_rows(x)
    wv = _vec(w, "w")
    y = _out_like(a, out)
    _k.rmsnorm(a, wv, y, float(eps))
    return y[0] if flat and out is None else y


def rope(x, n_heads: int, head_dim: int, pos, freq_base: float = 10000.0) -> np.ndarray:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of every head of token row t by
    pos[t] * freq_base^(-2i/head_dim) (llama "normal" RoPE). Returns a new array."""
    a, flat = _float_rows(x)
    a = a.copy()
    p = _int_vector(pos, "positions", 0, 2**31)
    _k.rope(a, int(n_heads), int(head_dim), p, float(freq_base))
    return a[0] if flat else a


def softmax(x) -> np.ndarray:
    """Softmax of each row (max-subtracted). Returns a new array."""
    a, flat = _float_rows(x)
    a = a.copy()
    _k.softmax(a)
    return a[0] if flat else a


def _vec(x, name):
    a = np.asarray(x)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"{name} must be a 1-D float array, got {a.dtype} {a.shape}")
    return np.ascontiguousarray(a, dtype=np.float32)


def silu_mul(g, u) -> np.ndarray:
    """g * sigmoid(g) * u, elementwise (the SwiGLU gate)."""
    g, u = _vec(g, "g"), _vec(u, "u")
    y = np.empty_like(g)
    _k.silu_mul(g, u, y)
    return y


def add(a, b) -> np.ndarray:
    a, b = _vec(a, "a"), _vec(b, "b")
    y = np.empty_like(a)
    _k.add(a, b, y)
    return y


def dequant_row(w_raw, qtype: str, ids) -> np.ndarray:
    """Rows `ids` of raw GGUF weights as float32 [len(ids), cols] (the embedding lookup);
    an int id gives one row [cols]."""
    qid = _qtype(qtype)
    w = _weight(w_raw, qtype)
    one = np.ndim(ids) == 0
    idv = _int_vector(ids, "row id", 0, w.shape[0])
    y = np.empty((idv.shape[0], w.shape[1] // BLOCK_BYTES[qtype] * 32), dtype=np.float32)
    _k.dequant_rows(qid, w, idv, y)
    return y[0] if one else y


def attention(q, k_cache, v_cache, n_pos: int, n_head: int, n_kv_head: int,
              scale: float | None = None, n_threads: int | None = None) -> np.ndarray:
    """One query token attending over positions [0, n_pos) of a K/V cache.
    q: [n_head*head_dim]; k_cache, v_cache: [n_ctx, n_kv_head*head_dim] float32 or float16.
    Head h reads kv head h // (n_head // n_kv_head). Returns [n_head*head_dim] float32."""
    qv = _vec(q, "q")
    if n_head <= 0 or qv.shape[0] % n_head:
        raise ValueError(f"q has {qv.shape[0]} values, not a multiple of n_head={n_head}")
    head_dim = qv.shape[0] // n_head
    if scale is None:
        scale = 1.0 / np.sqrt(head_dim)
    out = np.zeros_like(qv)
    _k.attention(qv, k_cache, v_cache, int(n_pos), int(n_head), int(n_kv_head), head_dim,
                 float(scale), out, n_threads)
    return out


def f32_to_f16(x) -> np.ndarray:
    """IEEE half of every value (round to nearest even), as float16."""
    a = _vec(x, "x")
    y = np.empty(a.shape, dtype=np.uint16)
    _k.f32_to_f16(a, y)
    return y.view(np.float16)


def _out_like(a: np.ndarray, out) -> np.ndarray:
    if out is None:
        return np.empty_like(a)
    if not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.flags.c_contiguous
            and out.shape in (a.shape, a.shape[1:] if a.shape[0] == 1 else a.shape)):
        raise ValueError(f"out must be a C-contiguous float32 array of shape {a.shape}")
    return out.reshape(a.shape)

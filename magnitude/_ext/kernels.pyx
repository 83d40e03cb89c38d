# cython: language_level=3
"""Thin wrappers over the C kernels in mg_kernels.h: validate, then run without the GIL.

Each wrapper checks dtype, contiguity and shapes and raises ValueError naming the values, so the
C code behind it can trust its arguments. Work is split over rows with OpenMP (prange) when
n_threads > 1; the C functions never start threads themselves.
Public, friendlier API: magnitude.kernels.
"""
from libc.stdint cimport uint8_t, uint16_t, int32_t, int64_t
from cython.parallel cimport prange

import numpy as np

cdef extern from "mg_kernels.h" nogil:
    int MG_Q4_0, MG_Q4_1, MG_Q8_0
    int64_t mg_block_bytes(int qtype)
    int64_t mg_act_block_bytes(int qtype)
    int mg_kernel_path()
    int mg_set_kernel_path(int path)
    int mg_cpu_features()
    int mg_env_kernel_path()
    void mg_quantize_q8_0(const float *x, uint8_t *out, int64_t n)
    void mg_quantize_q8_1(const float *x, uint8_t *out, int64_t n)
    void mg_matmul(int qtype, const uint8_t *w, int64_t row_bytes, int64_t cols,
                   const uint8_t *xq, int64_t xq_stride, int64_t T,
                   float *y, int64_t ldy, int64_t r0, int64_t r1)
    void mg_block_sums(int qtype, const uint8_t *w, int64_t row_bytes, const uint8_t *x,
                       int64_t nb, int32_t *out)
    void mg_rmsnorm(const float *x, const float *w, float *y, int64_t n, float eps)
    void mg_rope(float *x, int64_t n_heads, int64_t head_dim, int64_t pos, float freq_base)
    void mg_softmax(float *x, int64_t n)
    void mg_silu_mul(const float *g, const float *u, float *y, int64_t n)
    void mg_add(const float *a, const float *b, float *y, int64_t n)
    void mg_dequant_row(int qtype, const uint8_t *row, float *y, int64_t n)
    void mg_attention(const float *q, const void *k_cache, const void *v_cache, int kv_f16,
                      int64_t kv_stride, int64_t n_pos, int64_t n_head, int64_t n_kv_head,
                      int64_t head_dim, float scale, float *out, float *scratch,
                      int64_t h0, int64_t h1)
    void mg_f32_to_f16(const float *x, uint16_t *y, int64_t n)
    void mg_barrier()

# HAVE_OPENMP is a compile-time name (setup.py's compile_time_env): a plain assignment to it does
# not compile, so the module attribute of that name is set through globals()
OPENMP = HAVE_OPENMP
globals()["HAVE_OPENMP"] = OPENMP

PATH_NAMES = ("scalar", "avx2", "avxvnni", "avx512vnni")
QTYPES = {"q4_0": MG_Q4_0, "q4_1": MG_Q4_1, "q8_0": MG_Q8_0}
cdef enum:
    MG_Q8_1 = 9  # ggml's id for Q8_1: the op table's QUANTIZE takes it (any other means Q8_0)
Q8_1 = MG_Q8_1


def _check_env_path():
    from magnitude.errors import ConfigError  # a ValueError, and what the CLI reports cleanly
    code = mg_env_kernel_path()
    if code == -2:
        import os
        raise ConfigError(f"MAGNITUDE_KERNEL={os.environ['MAGNITUDE_KERNEL']!r} is not a kernel "
                         f"path; use one of {', '.join(PATH_NAMES)} (or unset it)")
    if code == -3:
        import os
        raise ConfigError(f"MAGNITUDE_KERNEL={os.environ['MAGNITUDE_KERNEL']!r}: this CPU lacks "
                         f"that instruction set; it supports {', '.join(supported_paths())}")
    mg_kernel_path()  # settle the path now, before any thread can race to do it


def cpu_features():
    """Bitmask: 1 avx2(+fma+f16c), 2 avxvnni, 4 avx512vnni(+f+bw+vl)."""
    return mg_cpu_features()


def supported_paths():
    f = mg_cpu_features()
    return ["scalar"] + [PATH_NAMES[p] for p in (1, 2, 3) if f >> (p - 1) & 1]


def kernel_path():
    return mg_kernel_path()


def set_kernel_path(int path):
    if path < 0 or path > 3:
        raise ValueError(f"kernel path {path} is not one of 0..3 ({', '.join(PATH_NAMES)})")
    if mg_set_kernel_path(path) != 0:
        raise ValueError(f"this CPU lacks the {PATH_NAMES[path]} instruction set; it supports "
                         f"{', '.join(supported_paths())}")


cdef int _qtype_id(qtype) except -1:
    if qtype not in (MG_Q4_0, MG_Q4_1, MG_Q8_0):
        raise ValueError(f"qtype {qtype!r} is not supported; use {MG_Q4_0} (Q4_0), "
                         f"{MG_Q4_1} (Q4_1) or {MG_Q8_0} (Q8_0)")
    return qtype


cdef int _threads(n_threads) except -1:
    if n_threads is None:
        return 1
    if int(n_threads) < 1:
        raise ValueError(f"n_threads={n_threads!r} must be at least 1")
    return int(n_threads)


def quantize(const float[:, ::1] x, uint8_t[:, ::1] out, int kind):
    """Quantize each row of x to Q8_0 (kind 0) or Q8_1 (kind 1) blocks in out."""
    cdef int64_t T = x.shape[0], n = x.shape[1], t
    cdef int64_t bb = 34 if kind == 0 else 36
    if kind not in (0, 1):
        raise ValueError(f"kind {kind} must be 0 (Q8_0) or 1 (Q8_1)")
    if n % 32 != 0:
        raise ValueError(f"row length {n} is not a multiple of 32 (the block size)")
    if out.shape[0] != T or out.shape[1] != n // 32 * bb:
        raise ValueError(f"out has shape ({out.shape[0]}, {out.shape[1]}); it needs "
                         f"({T}, {n // 32 * bb}) for {T} rows of {n} values")
    with nogil:
        for t in range(T):
            if kind == 0:
                mg_quantize_q8_0(&x[t, 0] if n else NULL, &out[t, 0] if n else NULL, n)
            else:
                mg_quantize_q8_1(&x[t, 0] if n else NULL, &out[t, 0] if n else NULL, n)


cdef void _matmul_chunks(int qtype, const uint8_t *w, int64_t row_bytes, int64_t cols,
                         const uint8_t *xq, int64_t xq_stride, int64_t T, float *y, int64_t ldy,
                         int64_t rows, int nt) noexcept nogil:
    # chunks of a multiple of 8 rows (the SIMD pass width), about one per thread
    cdef int64_t chunk = ((rows + nt - 1) // nt + 7) // 8 * 8
    cdef int64_t n_chunks = (rows + chunk - 1) // chunk
    cdef int64_t c, r0, r1
    if nt <= 1 or n_chunks <= 1:
        mg_matmul(qtype, w, row_bytes, cols, xq, xq_stride, T, y, ldy, 0, rows)
        return
    for c in prange(n_chunks, num_threads=nt, schedule="static"):
        r0 = c * chunk
        r1 = min(r0 + chunk, rows)
        mg_matmul(qtype, w, row_bytes, cols, xq, xq_stride, T, y, ldy, r0, r1)


def matmul_q(int qtype, const uint8_t[:, ::1] w, int64_t cols, const uint8_t[:, ::1] xq,
             float[:, ::1] y, n_threads=None):
    """y[t, r] = dot(weight row r, activation row t). w: [rows, row_bytes] raw GGUF blocks;
    xq: [T, cols/32 * (36 for Q4_1 else 34)] quantized activations; y: [T, rows] float32."""
    _qtype_id(qtype)
    cdef int nt = _threads(n_threads)
    cdef int64_t rows = w.shape[0], row_bytes = w.shape[1], T = xq.shape[0]
    cdef int64_t wb = mg_block_bytes(qtype), xb = mg_act_block_bytes(qtype)
    if cols <= 0 or cols % 32 != 0:
        raise ValueError(f"cols={cols} must be a positive multiple of 32 (the block size)")
    if row_bytes != cols // 32 * wb:
        raise ValueError(f"weight rows are {row_bytes} bytes; {cols} values of this type take "
                         f"{cols // 32 * wb} ({cols // 32} blocks of {wb} bytes)")
    if xq.shape[1] != cols // 32 * xb:
        raise ValueError(f"activation rows are {xq.shape[1]} bytes; {cols} values need "
                         f"{cols // 32 * xb} ({cols // 32} blocks of {xb} bytes)")
    if y.shape[0] != T or y.shape[1] != rows:
        raise ValueError(f"out has shape ({y.shape[0]}, {y.shape[1]}); it needs ({T}, {rows})")
    if rows == 0 or T == 0:
        return
    with nogil:
        _matmul_chunks(qtype, &w[0, 0], row_bytes, cols, &xq[0, 0], xq.shape[1], T,
                       &y[0, 0], rows, rows, nt)


def matmul_rows(int qtype, const uint8_t[:, ::1] w, int64_t cols, const uint8_t[:, ::1] xq,
                float[:, ::1] y, int64_t r0, int64_t r1):
    """mg_matmul on rows [r0, r1) only, as the executor calls it from each of its threads."""
    if not 0 <= r0 <= r1 <= w.shape[0]:
        raise ValueError(f"row range [{r0}, {r1}) is not inside [0, {w.shape[0]}]")
    matmul_q(qtype, w, cols, xq[:0], y[:0])  # its shape checks; zero tokens computes nothing
    if y.shape[0] != xq.shape[0]:
        raise ValueError(f"out has {y.shape[0]} rows for {xq.shape[0]} activation rows")
    if r1 > r0 and xq.shape[0]:
        with nogil:
            mg_matmul(qtype, &w[0, 0], w.shape[1], cols, &xq[0, 0], xq.shape[1], xq.shape[0],
                      &y[0, 0], y.shape[1], r0, r1)


def block_sums(int qtype, const uint8_t[:, ::1] w, const uint8_t[::1] x):
    """Test hook: int32 [8, nb] block sums of 8 weight rows against one activation row, as the
    selected kernel path computes them."""
    _qtype_id(qtype)
    cdef int64_t row_bytes = w.shape[1], nb = row_bytes // mg_block_bytes(qtype)
    if w.shape[0] != 8 or row_bytes % mg_block_bytes(qtype) or nb == 0:
        raise ValueError(f"w has shape ({w.shape[0]}, {row_bytes}); it needs 8 rows of whole "
                         f"blocks of {mg_block_bytes(qtype)} bytes")
    if x.shape[0] != nb * mg_act_block_bytes(qtype):
        raise ValueError(f"x has {x.shape[0]} bytes; it needs {nb * mg_act_block_bytes(qtype)}")
    out = np.empty((8, nb), dtype=np.int32)  # [8 rows, nb blocks]
    cdef int32_t[:, ::1] o = out
    mg_block_sums(qtype, &w[0, 0], row_bytes, &x[0], nb, &o[0, 0])
    return out


cdef _check_rows(name, a, rows, n):
    if a.shape[0] != rows or a.shape[1] != n:
        raise ValueError(f"{name} has shape ({a.shape[0]}, {a.shape[1]}); it needs ({rows}, {n})")


def rmsnorm(const float[:, ::1] x, const float[::1] w, float[:, ::1] y, float eps,
            n_threads=None):
    cdef int64_t T = x.shape[0], n = x.shape[1], t
    cdef int nt = _threads(n_threads)
    if w.shape[0] != n:
        raise ValueError(f"weight has {w.shape[0]} values; rows have {n}")
    _check_rows("out", y, T, n)
    if not eps >= 0:
        raise ValueError(f"eps={eps} must be >= 0")
    if n == 0:
        return
    for t in prange(T, nogil=True, num_threads=nt, schedule="static"):
        mg_rmsnorm(&x[t, 0], &w[0], &y[t, 0], n, eps)


def rope(float[:, ::1] x, int64_t n_heads, int64_t head_dim, const int64_t[::1] pos,
         float freq_base, n_threads=None):
    cdef int64_t T = x.shape[0], t
    cdef int nt = _threads(n_threads)
    if n_heads <= 0 or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"n_heads={n_heads}, head_dim={head_dim}: both must be positive and "
                         f"head_dim even")
    if x.shape[1] != n_heads * head_dim:
        raise ValueError(f"rows have {x.shape[1]} values; {n_heads} heads of {head_dim} need "
                         f"{n_heads * head_dim}")
    if pos.shape[0] != T:
        raise ValueError(f"{pos.shape[0]} positions given for {T} rows")
    if not freq_base > 0:
        raise ValueError(f"freq_base={freq_base} must be > 0")
    for t in prange(T, nogil=True, num_threads=nt, schedule="static"):
        mg_rope(&x[t, 0], n_heads, head_dim, pos[t], freq_base)


def softmax(float[:, ::1] x):
    cdef int64_t T = x.shape[0], n = x.shape[1], t
    if n == 0:
        return
    with nogil:
        for t in range(T):
            mg_softmax(&x[t, 0], n)


def silu_mul(const float[::1] g, const float[::1] u, float[::1] y):
    cdef int64_t n = g.shape[0]
    if u.shape[0] != n or y.shape[0] != n:
        raise ValueError(f"lengths differ: g {n}, u {u.shape[0]}, out {y.shape[0]}")
    if n:
        with nogil:
            mg_silu_mul(&g[0], &u[0], &y[0], n)


def add(const float[::1] a, const float[::1] b, float[::1] y):
    cdef int64_t n = a.shape[0]
    if b.shape[0] != n or y.shape[0] != n:
        raise ValueError(f"lengths differ: a {n}, b {b.shape[0]}, out {y.shape[0]}")
    if n:
        with nogil:
            mg_add(&a[0], &b[0], &y[0], n)


def dequant_rows(int qtype, const uint8_t[:, ::1] w, const int64_t[::1] ids, float[:, ::1] y):
    """y[i] = row ids[i] of w dequantized (the embedding lookup)."""
    _qtype_id(qtype)
    cdef int64_t rows = w.shape[0], row_bytes = w.shape[1], n = y.shape[1], i
    cdef int64_t wb = mg_block_bytes(qtype)
    if row_bytes % wb or row_bytes == 0:
        raise ValueError(f"weight rows are {row_bytes} bytes, not a whole number of {wb}-byte "
                         f"blocks")
    _check_rows("out", y, ids.shape[0], row_bytes // wb * 32)
    for i in range(ids.shape[0]):
        if ids[i] < 0 or ids[i] >= rows:
            raise ValueError(f"row id {ids[i]} is out of range [0, {rows})")
    with nogil:
        for i in range(ids.shape[0]):
            mg_dequant_row(qtype, &w[ids[i], 0], &y[i, 0], n)


def attention(const float[::1] q, k_cache, v_cache, int64_t n_pos, int64_t n_head,
              int64_t n_kv_head, int64_t head_dim, float scale, float[::1] out,
              n_threads=None):
    """Causal attention of one query over positions [0, n_pos) of a [n_ctx, n_kv_head*head_dim]
    K/V cache (float32 or float16), grouped-query. Heads are split across threads."""
    cdef int nt = _threads(n_threads)
    if n_head <= 0 or n_kv_head <= 0 or head_dim <= 0 or n_head % n_kv_head:
        raise ValueError(f"n_head={n_head}, n_kv_head={n_kv_head}, head_dim={head_dim}: all "
                         f"must be positive and n_head a multiple of n_kv_head")
    if q.shape[0] != n_head * head_dim or out.shape[0] != n_head * head_dim:
        raise ValueError(f"q has {q.shape[0]} and out {out.shape[0]} values; both need "
                         f"{n_head * head_dim}")
    kv_f16 = _check_cache("k_cache", k_cache, n_pos, n_kv_head * head_dim)
    if _check_cache("v_cache", v_cache, n_pos, n_kv_head * head_dim) != kv_f16:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    cdef int64_t stride = k_cache.shape[1]
    if v_cache.shape[1] != stride:
        raise ValueError(f"k_cache rows have {stride} values, v_cache rows {v_cache.shape[1]}")
    if n_pos <= 0:
        raise ValueError(f"n_pos={n_pos} must be at least 1 (the query's own position)")
    cdef const uint8_t[:, ::1] kb = k_cache.view(np.uint8)
    cdef const uint8_t[:, ::1] vb = v_cache.view(np.uint8)
    cdef float[:, ::1] scratch = np.empty((nt, n_pos), dtype=np.float32)  # [thread, pos]
    cdef int f16 = kv_f16
    cdef int64_t h, tid
    cdef int64_t per = (n_head + nt - 1) // nt
    for tid in prange(nt, nogil=True, num_threads=nt, schedule="static"):
        if tid * per < n_head:
            mg_attention(&q[0], &kb[0, 0], &vb[0, 0], f16, stride, n_pos, n_head, n_kv_head,
                         head_dim, scale, &out[0], &scratch[tid, 0], tid * per,
                         min(tid * per + per, n_head))


cdef int _check_cache(name, a, int64_t n_pos, int64_t width) except -1:
    if not isinstance(a, np.ndarray) or a.ndim != 2 or a.dtype not in (np.float32, np.float16):
        raise ValueError(f"{name} must be a 2-D float32 or float16 numpy array, got "
                         f"{type(a).__name__} {getattr(a, 'dtype', '')} "
                         f"{getattr(a, 'shape', '')}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if a.shape[0] < n_pos or a.shape[1] < width:
        raise ValueError(f"{name} has shape {a.shape}; it needs at least ({n_pos}, {width})")
    return a.dtype == np.float16


def f32_to_f16(const float[::1] x, uint16_t[::1] y):
    if y.shape[0] != x.shape[0]:
        raise ValueError(f"out has {y.shape[0]} values, x {x.shape[0]}")
    if x.shape[0]:
        with nogil:
            mg_f32_to_f16(&x[0], &y[0], x.shape[0])


_check_env_path()


# The op-table interpreter the executor runs (Program), compiled into this same module.
include "runtime.pxi"

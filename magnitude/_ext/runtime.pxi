# Included at the end of kernels.pyx, so the executor and the kernel wrappers are ONE module:
# one copy of the selected kernel path, one set of C declarations.
"""The op-table interpreter: runs a whole planned graph in one nogil call.

The executor compiles the graph's nodes into a flat array of Op structs holding raw pointers
into the arena, the KV store and the memory-mapped weights. `Program.run` then opens ONE
OpenMP parallel region for the whole forward pass: every thread walks the same op list, does
its share of each op (rows, tokens or heads) and meets the others at a barrier before the next
op. No Python, no allocation and no thread start-up per op: on a 600-op decode step that is
the difference between ~1 ms of dispatch and a few microseconds.

Safety: bounds checks are off. Every pointer and size here was checked in Python
(magnitude/executor.py) when the table was built, and run() checks its own arguments.
"""
from cython.parallel cimport parallel
from libc.math cimport NAN
from libc.stdlib cimport calloc, free

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    static int mg_thread_id(void) { return omp_get_thread_num(); }
    static int mg_num_threads(void) { return omp_get_num_threads(); }
    #else
    static int mg_thread_id(void) { return 0; }
    static int mg_num_threads(void) { return 1; }
    #endif
    """
    int mg_thread_id() nogil
    int mg_num_threads() nogil

# Op kinds; the executor uses the same numbers (OP_KINDS below).
cdef enum:
    EMBED = 0
    RMSNORM = 1
    QUANTIZE = 2
    MATMUL = 3
    ROPE = 4
    KV_WRITE = 5
    ATTENTION = 6
    ADD = 7
    SILU_MUL = 8

OP_KINDS = {"embed": EMBED, "rmsnorm": RMSNORM, "quantize": QUANTIZE, "matmul": MATMUL,
            "rope": ROPE, "kv_write": KV_WRITE, "attention": ATTENTION, "add": ADD,
            "silu_mul": SILU_MUL}

# Each op's fields; which ones an op uses is written next to its case in run_op.
cdef struct Op:
    int kind
    int qtype          # weight type (MATMUL, EMBED) or activation type (QUANTIZE: 8 q8_0, 9 q8_1)
    int flag           # RMSNORM: last row only; KV_WRITE/ATTENTION: f16 cache
    int sync           # 1: all threads meet after this op (the executor decides, see there)
    int64_t fixed_tok  # > 0: the op always covers this many token rows, else the run's n_tok
    char *a            # first input
    char *b            # second input (weight for MATMUL/RMSNORM/EMBED, K cache for ATTENTION)
    char *c            # output (K cache for KV_WRITE)
    char *d            # V cache (KV_WRITE, ATTENTION)
    char *s            # scratch (ATTENTION: one row per thread)
    int64_t a_stride, b_stride, c_stride, d_stride, s_stride   # bytes per row
    int64_t n          # values per row (cols for MATMUL)
    int64_t rows       # MATMUL output rows
    int64_t n_head, n_kv_head, head_dim
    float eps, freq_base, scale


cdef inline void split(int64_t total, int64_t grain, int tid, int nth,
                       int64_t *lo, int64_t *hi) noexcept nogil:
    """Thread tid's share [lo, hi) of total units, cut at multiples of grain. A pure function
    of (total, tid, nth): the same unit always goes to the same thread, which the executor's
    barrier elision relies on (a single row always lands on thread nth-1)."""
    cdef int64_t chunks = (total + grain - 1) // grain
    cdef int64_t c0 = chunks * tid // nth
    cdef int64_t c1 = chunks * (tid + 1) // nth
    lo[0] = min(c0 * grain, total)
    hi[0] = min(c1 * grain, total)


cdef void run_op(const Op *op, int64_t n_tok, int64_t pos0, int tid, int nth) noexcept nogil:
    cdef int64_t T = op.fixed_tok if op.fixed_tok > 0 else n_tok
    cdef int64_t lo, hi, t, h, u
    if op.kind == MATMUL:       # a: activations [T, n] blocks, b: weight, c: [T, rows] f32
        # Split rows, not tokens: every thread streams a disjoint slice of the weight once.
        split(op.rows, 16, tid, nth, &lo, &hi)
        if lo < hi:
            mg_matmul(op.qtype, <uint8_t *> op.b, op.b_stride, op.n, <uint8_t *> op.a,
                      op.a_stride, T, <float *> op.c, op.c_stride // 4, lo, hi)
    elif op.kind == ATTENTION:  # a: q [T, n_head*hd], b/d: K/V caches, c: out, s: scratch rows
        split(T * op.n_head, 1, tid, nth, &lo, &hi)
        u = lo
        while u < hi:   # runs of heads of one token
            t = u // op.n_head
            h = min(hi, (t + 1) * op.n_head) - t * op.n_head
            mg_attention(<float *> (op.a + t * op.a_stride), op.b, op.d, op.flag,
                         op.b_stride // (2 if op.flag else 4), pos0 + t + 1,
                         op.n_head, op.n_kv_head, op.head_dim, op.scale,
                         <float *> (op.c + t * op.c_stride), <float *> (op.s + tid * op.s_stride),
                         u - t * op.n_head, h)
            u = t * op.n_head + h
    else:
        split(T, 1, tid, nth, &lo, &hi)
        for t in range(lo, hi):
            run_row(op, t, T, pos0)


cdef void run_row(const Op *op, int64_t t, int64_t T, int64_t pos0) noexcept nogil:
    """One token row of a row-wise op."""
    cdef int64_t src
    cdef int32_t tok
    cdef int64_t i
    if op.kind == EMBED:        # a: token ids i32, b: embedding weight [rows, n], c: [T, n] f32
        tok = (<int32_t *> op.a)[t]
        if tok < 0 or tok >= op.rows:  # never read outside the table: poison the row instead
            for i in range(op.n):
                (<float *> (op.c + t * op.c_stride))[i] = NAN
            return
        mg_dequant_row(op.qtype, <uint8_t *> (op.b + tok * op.b_stride),
                       <float *> (op.c + t * op.c_stride), op.n)
    elif op.kind == RMSNORM:    # a: x [T, n], b: weight [n], c: [T, n] (or [1, n]: last row)
        src = T - 1 if op.flag else t
        if op.flag and t != 0:
            return
        mg_rmsnorm(<float *> (op.a + src * op.a_stride), <float *> op.b,
                   <float *> (op.c + t * op.c_stride), op.n, op.eps)
    elif op.kind == QUANTIZE:   # a: x [T, n] f32, c: [T, n] blocks
        if op.qtype == MG_Q8_1:
            mg_quantize_q8_1(<float *> (op.a + t * op.a_stride), <uint8_t *> (op.c + t * op.c_stride), op.n)
        else:
            mg_quantize_q8_0(<float *> (op.a + t * op.a_stride), <uint8_t *> (op.c + t * op.c_stride), op.n)
    elif op.kind == ROPE:       # a: x [T, n_head*hd], c: rotated copy
        copy_row(<float *> (op.a + t * op.a_stride), <float *> (op.c + t * op.c_stride), op.n)
        mg_rope(<float *> (op.c + t * op.c_stride), op.n_head, op.head_dim, pos0 + t, op.freq_base)
    elif op.kind == KV_WRITE:   # a: k [T, n], b: v [T, n] -> row pos0+t of caches c (K), d (V)
        store_row(<float *> (op.a + t * op.a_stride), op.c + (pos0 + t) * op.c_stride, op.n, op.flag)
        store_row(<float *> (op.b + t * op.b_stride), op.d + (pos0 + t) * op.d_stride, op.n, op.flag)
    elif op.kind == ADD:        # a + b -> c, [T, n]
        mg_add(<float *> (op.a + t * op.a_stride), <float *> (op.b + t * op.b_stride),
               <float *> (op.c + t * op.c_stride), op.n)
    elif op.kind == SILU_MUL:   # silu(a) * b -> c, [T, n]
        mg_silu_mul(<float *> (op.a + t * op.a_stride), <float *> (op.b + t * op.b_stride),
                    <float *> (op.c + t * op.c_stride), op.n)


cdef inline void copy_row(const float *x, float *y, int64_t n) noexcept nogil:
    cdef int64_t i
    for i in range(n):
        y[i] = x[i]


cdef inline void store_row(const float *x, char *dst, int64_t n, int f16) noexcept nogil:
    if f16:
        mg_f32_to_f16(x, <uint16_t *> dst, n)
    else:
        copy_row(x, <float *> dst, n)


cdef void run_all(const Op *ops, Py_ssize_t n_ops, int64_t n_tok, int64_t pos0,
                  int n_threads) noexcept nogil:
    """ops[0 .. n_ops-1] in order; with several threads, one parallel region for all of them."""
    cdef Py_ssize_t i
    cdef int tid, nth
    if n_threads == 1:
        for i in range(n_ops):
            run_op(&ops[i], n_tok, pos0, 0, 1)
        return
    with parallel(num_threads=n_threads):
        # The runtime may grant fewer threads than asked: split by what we really got.
        tid = mg_thread_id()
        nth = mg_num_threads()
        for i in range(n_ops):
            run_op(&ops[i], n_tok, pos0, tid, nth)
            if ops[i].sync:
                mg_barrier()  # op i+1 touches bytes some thread used in op i


cdef class Program:
    """A compiled op table. Built by magnitude.executor from checked pointers; `keep` holds the
    arrays those pointers point into, so they live as long as the program."""
    cdef Op *ops
    cdef readonly Py_ssize_t n_ops
    cdef readonly int64_t max_tok, n_ctx
    cdef readonly int max_threads
    cdef object keep

    def __cinit__(self, list specs, int64_t max_tok, int64_t n_ctx, int max_threads, keep):
        self.ops = <Op *> calloc(max(1, len(specs)), sizeof(Op))
        if self.ops == NULL:
            raise MemoryError("op table")
        self.n_ops = len(specs)
        self.max_tok, self.n_ctx, self.max_threads = max_tok, n_ctx, max_threads
        self.keep = keep
        for i, spec in enumerate(specs):
            fill(&self.ops[i], spec)

    def __dealloc__(self):
        free(self.ops)

    def run(self, int64_t n_tok, int64_t pos0, int n_threads=1, Py_ssize_t start=0,
            Py_ssize_t stop=-1):
        """Run ops [start, stop) (default: all) for tokens at positions pos0 .. pos0+n_tok-1."""
        if stop < 0:
            stop = self.n_ops
        if not 0 <= start <= stop <= self.n_ops:
            raise ValueError(f"op range [{start}, {stop}) outside 0..{self.n_ops}")
        if not 1 <= n_tok <= self.max_tok:
            raise ValueError(f"n_tok={n_tok} outside the planned 1..{self.max_tok}")
        if pos0 < 0 or pos0 + n_tok > self.n_ctx:
            raise ValueError(f"positions {pos0}..{pos0 + n_tok - 1} outside the context "
                             f"0..{self.n_ctx - 1}")
        if not 1 <= n_threads <= self.max_threads:
            raise ValueError(f"n_threads={n_threads} outside the planned 1..{self.max_threads}")
        with nogil:
            run_all(self.ops + start, stop - start, n_tok, pos0, n_threads)


cdef void fill(Op *op, dict spec) except *:
    op.kind = OP_KINDS[spec["kind"]]
    op.qtype = spec.get("qtype", 0)
    op.flag = spec.get("flag", 0)
    op.sync = spec.get("sync", 1)
    op.fixed_tok = spec.get("fixed_tok", 0)
    op.a = <char *> <size_t> spec.get("a", 0)
    op.b = <char *> <size_t> spec.get("b", 0)
    op.c = <char *> <size_t> spec.get("c", 0)
    op.d = <char *> <size_t> spec.get("d", 0)
    op.s = <char *> <size_t> spec.get("s", 0)
    op.a_stride = spec.get("a_stride", 0)
    op.b_stride = spec.get("b_stride", 0)
    op.c_stride = spec.get("c_stride", 0)
    op.d_stride = spec.get("d_stride", 0)
    op.s_stride = spec.get("s_stride", 0)
    op.n = spec.get("n", 0)
    op.rows = spec.get("rows", 0)
    op.n_head = spec.get("n_head", 0)
    op.n_kv_head = spec.get("n_kv_head", 0)
    op.head_dim = spec.get("head_dim", 0)
    op.eps = spec.get("eps", 0.0)
    op.freq_base = spec.get("freq_base", 0.0)
    op.scale = spec.get("scale", 0.0)

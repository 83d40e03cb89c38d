"""Speed of the quantized matmul kernels, per kernel path and thread count.

    python benchmarks/kernel_bench.py            # everything (about a minute)
    python benchmarks/kernel_bench.py --quick    # SmolLM2 shapes only, fewer repeats

GEMV (one token, the decode step): median time, weight GB/s at the median and at the best run,
and the best as a share of the single-core read bandwidth measured in the same run (numpy sum
over a 400 MB array). On a shared, loaded machine the median drifts with other processes; the
best run is the kernel's own speed.
GEMM (prefill): tokens/s at T = 32, 128, 512 on SmolLM2's FFN-up shape.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from magnitude import kernels as K  # noqa: E402

BLOCK = K.BLOCK_BYTES
SMOL = [("attn q/o", 576, 576, "q4_1"), ("attn k/v", 192, 576, "q4_1"),
        ("ffn up/gate", 1536, 576, "q4_1"), ("ffn down", 576, 1536, "q4_1"),
        ("output (tied)", 49152, 576, "q8_0")]
# past the last-level cache (a 40 MB matrix still reads at ~18 GB/s here: it sits in L3)
DRAM = [("dram q4_1", 65536, 4096, "q4_1"), ("dram q8_0", 32768, 4096, "q8_0")]


def read_bandwidth(mb=400, repeats=5) -> float:
    """Single-thread read bandwidth (GB/s): numpy sum over a DRAM-sized array."""
    a = np.ones(mb * 2**20 // 8, dtype=np.float64)
    best = min(_timed(lambda: a.sum()) for _ in range(repeats))
    return a.nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def random_weights(rows, cols, qtype, rng) -> np.ndarray:
    """Random raw blocks with sane scales (fp16 d and m around 0.01): the kernels' speed does
    not depend on the values, and quantizing 100 MB of floats would dominate the run."""
    bb = BLOCK[qtype]
    w = rng.integers(0, 256, size=(rows, cols // 32, bb), dtype=np.uint8)  # [rows, blocks, bb]
    nscales = 2 if qtype == "q4_1" else 1
    w[:, :, :2 * nscales] = np.full(nscales, 0.01, np.float16).view(np.uint8)
    return w.reshape(rows, -1)


def timings(fn, repeats) -> np.ndarray:
    fn()  # warm-up
    return np.array([_timed(fn) for _ in range(repeats)])


def gemv_table(shapes, paths, threads, bw, repeats, rng):
    print(f"\nGEMV (T=1), per path/threads: median ms | GB/s median | GB/s best | best as share "
          f"of {bw:.1f} GB/s")
    cols_ = [f"{p}/{n}t" for p in paths for n in threads]
    print(f"{'matrix':<12}{'rows x cols':>12}{'MB':>7}" + "".join(f"{c:>28}" for c in cols_))
    for name, rows, cols, qt in shapes:
        w = random_weights(rows, cols, qt, rng)
        xq = K.quantize_for(qt, rng.standard_normal((1, cols)).astype(np.float32))
        out = np.empty((1, rows), dtype=np.float32)
        # small matrices: repeat inside one timing so the figure is not call overhead
        inner = max(1, int(2e6 // w.nbytes))
        line = f"{name:<12}{f'{rows}x{cols}':>12}{w.nbytes / 1e6:>7.1f}"
        for p in paths:
            K.set_kernel_path(p)
            for n in threads:
                def run():
                    for _ in range(inner):
                        K.matmul_q(w, qt, xq, out=out, n_threads=n)
                ts = timings(run, repeats) / inner
                med, best = w.nbytes / np.median(ts) / 1e9, w.nbytes / ts.min() / 1e9
                line += f"{np.median(ts) * 1e3:>9.3f}{med:>6.1f}{best:>6.1f}{best / bw:>6.0%} "
        print(line)


def gemm_table(paths, threads, repeats, rng, Ts=(32, 128, 512)):
    rows, cols, qt = 1536, 576, "q4_1"
    print(f"\nGEMM (prefill) on ffn up {rows}x{cols} {qt}: tokens/s at the best run "
          f"(and integer Gop/s, 2 ops per multiply-add)")
    w = random_weights(rows, cols, qt, rng)
    print(f"{'T':>6}" + "".join(f"{p + '/' + str(n) + 't':>18}" for p in paths for n in threads))
    for T in Ts:
        xq = K.quantize_for(qt, rng.standard_normal((T, cols)).astype(np.float32))
        out = np.empty((T, rows), dtype=np.float32)
        line = f"{T:>6}"
        for p in paths:
            K.set_kernel_path(p)
            for n in threads:
                t = timings(lambda: K.matmul_q(w, qt, xq, out=out, n_threads=n), repeats).min()
                line += f"{T / t:>11.0f} {2 * rows * cols * T / t / 1e9:>5.1f}G"
        print(line)


def model_step_table(path, paths, threads, repeats):
    """Every weight matrix of the model once, as one decode step reads them (one token)."""
    import gguf

    ids = {int(v): k for k, v in K.QTYPES.items()}
    mats = []
    for t in gguf.GGUFReader(path).tensors:
        if int(t.tensor_type) in ids and len(t.shape) == 2:
            qt = ids[int(t.tensor_type)]
            w = np.asarray(t.data).reshape(int(t.shape[1]), -1)  # [rows, row_bytes]
            cols = w.shape[1] // BLOCK[qt] * 32
            xq = K.quantize_for(qt, np.ones((1, cols), np.float32))
            mats.append((w, qt, xq, np.empty((1, w.shape[0]), np.float32)))
    total = sum(m[0].nbytes for m in mats)
    print(f"\nModel decode step: all {len(mats)} weight matrices of {os.path.basename(path)} "
          f"({total / 1e6:.0f} MB), one token: best ms | GB/s")
    line = ""
    for p in paths:
        K.set_kernel_path(p)
        for n in threads:
            def step():
                for w, qt, xq, out in mats:
                    K.matmul_q(w, qt, xq, out=out, n_threads=n)
            t = timings(step, repeats).min()
            line += f"{p}/{n}t {t * 1e3:.2f} ms {total / t / 1e9:.1f} GB/s   "
    print(line)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="SmolLM2 shapes only, fewer repeats")
    ap.add_argument("--paths", default=",".join(K.supported_paths()),
                    help="comma-separated kernel paths (default: all this CPU supports)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--no-gemm", action="store_true")
    ap.add_argument("--model", default=None,
                    help="GGUF file for the decode-step figure (default: the SmolLM2 package's)")
    args = ap.parse_args(argv)
    paths = args.paths.split(",")
    threads = [int(t) for t in args.threads.split(",")]
    repeats = 5 if args.quick else 15
    rng = np.random.default_rng(0)
    print(f"cpu features {K.cpu_features()}, default path {K.kernel_path()}, "
          f"OpenMP {K.HAVE_OPENMP}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    bw = read_bandwidth(repeats=3 if args.quick else 5)
    print(f"one-core read bandwidth (numpy sum, 400 MB): {bw:.1f} GB/s")
    shapes = SMOL if args.quick else SMOL + DRAM
    gemv_table(shapes, paths, threads, bw, repeats, rng)
    if not args.no_gemm:
        gemm_table(paths, threads, max(3, repeats // 3), rng)
    model = args.model or _default_model()
    if model:
        model_step_table(model, [p for p in paths if p != "scalar"], threads, repeats)


def _default_model():
    try:
        from magnitude.gguf_model import default_model_path
        return default_model_path()
    except Exception:  # the package or its model file is missing: skip that table
        return None


if __name__ == "__main__":
    main()

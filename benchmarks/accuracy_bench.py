"""How close are the integer kernels to float? Logits on a 150-token passage against the numpy
float32 reference (tests/reference.py), and against llama.cpp on the same file if installed
(pip install llama-cpp-python==0.3.36; a benchmark peer only).

    python benchmarks/accuracy_bench.py
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import magnitude  # noqa: E402
from reference import PASSAGE, reference_logits  # noqa: E402


def llamacpp_logits(path, ids):
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=path, n_ctx=256, n_threads=1, verbose=False, logits_all=True)
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)])


def compare(a, b) -> str:
    top1 = (a.argmax(1) == b.argmax(1)).mean()
    return f"top-1 agree {100 * top1:5.1f}%   max |diff| {np.abs(a - b).max():.3f}   " \
           f"mean |diff| {np.abs(a - b).mean():.3f}"


def main():
    eng = magnitude.load(threads=1, max_context_length=256)
    ids = eng.tokenizer.encode(PASSAGE)[:150]
    ours = eng.eval_logits(ids)
    ref = reference_logits(eng.model, ids)
    print(f"{len(ids)} tokens, logits spread (std) {ref.std(1).mean():.2f}")
    print(f"magnitude vs float reference : {compare(ours, ref)}")
    peer = llamacpp_logits(eng.model.path, ids)
    if peer is not None:
        print(f"llama.cpp vs float reference : {compare(peer, ref)}")
        print(f"magnitude vs llama.cpp       : {compare(ours, peer)}")


if __name__ == "__main__":
    main()

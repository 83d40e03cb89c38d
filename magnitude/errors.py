"""Errors raised by Magnitude. Every message names the offending value and, where there is
one, the way to fix it."""


class MagnitudeError(Exception):
    """Base class of every error Magnitude raises on purpose."""


class ModelError(MagnitudeError):
    """The model file is missing, not GGUF, truncated, or holds something we cannot run."""


class GraphError(MagnitudeError):
    """The op graph is malformed (unknown tensor, written twice, read before written, ...)."""


class PlanError(MagnitudeError):
    """A memory plan is broken (overlapping live tensors, tensor past the arena end, ...)."""


class ConfigError(MagnitudeError, ValueError):
    """An engine or generation setting is out of range."""


class ContextLengthError(MagnitudeError, ValueError):
    """The prompt (plus the tokens to generate) does not fit in the context."""

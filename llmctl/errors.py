"""The exceptions llmctl raises for problems a user can fix.

The CLI turns each into one line `Error: <message>` (plus `Hint: <hint>` when there is one) and a
non-zero exit (`exit_code`: 1, or 2 for a ConfigError, the exit code click gives its own usage
errors, which llmctl/cli.py renders in the same two lines); library callers catch them like any
exception. Anything else escaping is a bug.
"""


class LlmctlError(Exception):
    """A user-facing error: a one-line message and an optional hint saying what to do."""

    exit_code = 1

    def __init__(self, message, hint=None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self):
        return self.message


class FormatError(LlmctlError):
    """A file is not a valid llm.c binary (wrong magic/version/size, truncated, corrupt)."""


class DataError(LlmctlError):
    """Input data is missing or unusable (no files match a glob, shard too small, bad source)."""


class ConfigError(LlmctlError):
    """Settings that cannot work together (T > maxT, -d not a multiple of B*T*P, ...)."""

    exit_code = 2


class DistError(LlmctlError):
    """A distributed-training failure: a dead or hung rank, a rejected peer, a port in use."""


# the optional packages pretrained GPT-2 and the Hugging Face export need (llmctl/hf/)
INSTALL_COMMAND = "pip install 'huggingface_hub>=0.34' 'safetensors>=0.4'"


def missing_dependency(pkg):
    """The error for an optional package (huggingface_hub, safetensors) that is not installed."""
    return LlmctlError(f"the Python package {pkg} is not installed; pretrained GPT-2 needs it",
                       f"install it: {INSTALL_COMMAND}")

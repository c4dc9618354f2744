"""llmctl: prepare data for, train, evaluate and sample GPT-2 on CPUs, byte-compatible with llm.c."""
__version__ = "0.1.0"

"""`llmctl.data`: another name of llmctl.windows (TokenWindows, WindowBatches), for code that
imports them from here. What it is not: a module of its own."""
from llmctl.windows import TokenWindows, WindowBatches

__all__ = ["TokenWindows", "WindowBatches"]

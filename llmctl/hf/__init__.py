"""Pretrained GPT-2 in and out of llmctl without PyTorch: Hugging Face Hub names and model
directories -> cached llm.c checkpoints (hub.py, convert.py), llm.c checkpoints -> Hugging Face
directories (export.py). See docs/pretrained.md."""
from llmctl.hf.export import export_checkpoint
from llmctl.hf.hub import (OPENAI_GPT2, converted_cache_dir, is_pretrained_spec, parse_spec, pretrained_checkpoint,
                           pretrained_header)

__all__ = ["pretrained_checkpoint", "pretrained_header", "is_pretrained_spec", "parse_spec", "converted_cache_dir",
           "export_checkpoint", "OPENAI_GPT2"]

"""`llmctl prepro`: raw text -> GPT-2 tokens -> llm.c `.bin` files (token shards, eval files).

One module per concern: sources.py (--source / cache / datasets / HTTP fallback), writer.py
(parallel tokenization + llm.c's fineweb sharding rule), tinyshakespeare.py, hellaswag.py,
text.py (user corpora, TinyStories, FineWeb). The functions below are what the CLI and
dev/data/*.py call; each returns a summary dict (what `--json` prints).
"""
from llmctl.prepro.hellaswag import prepro_hellaswag
from llmctl.prepro.text import prepro_fineweb, prepro_text, prepro_tinystories
from llmctl.prepro.tinyshakespeare import prepro_tinyshakespeare

__all__ = ["prepro_tinyshakespeare", "prepro_hellaswag", "prepro_text", "prepro_tinystories",
           "prepro_fineweb"]

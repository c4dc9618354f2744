"""The token-id facts several modules need, one name each: GPT-2's vocabulary and its end of text.

What it is: the numbers llm.c hard-codes for GPT-2 (train_gpt2.c's vocab_size 50257 and
padded_vocab_size 50304, the tokenizer's <|endoftext|> 50256, which dev/data/*.py put before every
document) and for the llama-3 shards llm.c's data scripts write (uint32 ids).
What it is not: settings (each flag's default is in train_config.py, each default path in
paths.py) or a model shape (model/config.py).
"""
GPT2_VOCAB_SIZE = 50257
GPT2_EOT = 50256                 # <|endoftext|>, the last id of the vocabulary
GPT2_PADDED_VOCAB_SIZE = 50304   # the vocabulary padded to a multiple of 128 (llm.c's Vp)
LLAMA3_EOT = 128000              # <|begin_of_text|>, what llm.c's llama-3 prepro places before every document
LLAMA3_VOCAB_SIZE = 128256

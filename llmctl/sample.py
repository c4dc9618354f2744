"""Text generation from a GPT-2 model: the sampling loop over the model's KV-cached forward.

What it is:
- `generate`: the sampling loop, `llmctl sample` and training's `-s/-g` samples call it. It runs
  the prompt once through the model's `forward_cached` and then one position per token.
  Plain sampling (temperature 1, no top-k/top-p) is llm.c's `sample_softmax` (llmc/sampler.h)
  with llm.c's xorshift64* `random_f32` coins; temperature 0 is greedy (argmax, ties to the
  lowest id); top-k / top-p filter the distribution, then the coin walks the CDF in id order.
- `StreamDecoder`: token ids -> printable text as they arrive (incremental UTF-8, control bytes
  escaped for terminals).
What it is not: a forward pass (the model's, llmctl/model/gpt2.py)
and not batched sampling (samples run one after another from one RNG stream).

Mirrors: llmc/sampler.h, llm.c's xorshift (`random_u32`/`random_f32` in train_gpt2.c), and
train_gpt2.c's sampling loop in `main`.
"""
import codecs
import math
import unicodedata

import numpy as np

from llmctl.errors import ConfigError
from llmctl.constants import GPT2_EOT as EOT
from llmctl.model.gpt2 import KVCache

# Temperatures below this are greedy (argmax, no coin drawn). Any logit gap above ~1e-4 already
# gives the runner-up < exp(-100) at T = 1e-6, and a subnormal T (1e-320) would make z / T
# overflow to inf - inf = NaN, which samples the last id (EOT) instead of the best one.
GREEDY_BELOW = 1e-6


# ----------------------------------------------------------------------------------------------
# sampling

class Xorshift:
    """llm.c's sampler RNG (train_gpt2.c random_u32 / random_f32): xorshift64*."""

    _MASK = (1 << 64) - 1

    def __init__(self, seed=1337):
        check_seed(seed)
        self.state = int(seed)

    def random_u32(self):
        s = self.state
        s ^= s >> 12
        s ^= (s << 25) & self._MASK
        s ^= s >> 27
        self.state = s
        return ((s * 0x2545F4914F6CDD1D) & self._MASK) >> 32

    def random_f32(self):
        return (self.random_u32() >> 8) / 16777216.0


def sample_token(logits, coin, temperature=1.0, top_k=None, top_p=None, n_threads=1):
    """One token id from logits (V,) float32 with a coin in [0,1) (plain sampling's exps on
    n_threads: the same id for any count).

    temperature 1, no top-k/top-p: exactly llm.c's sample_softmax(logits, V, coin).
    Otherwise probabilities = softmax(logits / temperature) restricted to the top_k largest
    and/or the smallest set of most likely ids whose mass reaches top_p (always >= 1 id),
    renormalised; the coin walks their CDF in id order. temperature 0 = argmax (callers skip
    the coin)."""
    from llmctl._ext.sampler import sample_softmax

    logits = np.ascontiguousarray(logits, dtype=np.float32)
    V = logits.shape[0]
    if temperature < GREEDY_BELOW:
        return int(np.argmax(logits))
    k = int(top_k) if top_k else 0
    if k >= V:
        k = 0
    p_top = float(top_p) if top_p is not None else 1.0
    if temperature == 1.0 and k == 0 and p_top >= 1.0:
        return int(sample_softmax(logits, float(coin), n_threads))
    z = logits.astype(np.float64)
    z = (z - z.max()) / float(temperature)  # <= 0 everywhere: exp never overflows
    keep = np.arange(V)
    if k > 0:
        keep = np.argpartition(-z, k - 1)[:k]
    if p_top < 1.0:
        cand = keep
        zc = z[cand]
        pc = np.exp(zc - zc.max())
        pc /= pc.sum()
        order = np.argsort(-pc, kind="stable")
        csum = np.cumsum(pc[order])
        n_keep = int(np.searchsorted(csum, p_top, side="left")) + 1  # first prefix reaching p
        keep = cand[order[:min(n_keep, order.size)]]
    probs = np.zeros(V, dtype=np.float64)
    zk = z[keep]
    probs[keep] = np.exp(zk - zk.max())
    cdf = np.cumsum(probs)
    i = int(np.searchsorted(cdf, coin * cdf[-1], side="right"))
    if i >= V or probs[i] == 0.0:  # rounding at the top end: take the last kept id
        i = int(np.max(keep))
    return i


def check_seed(seed):
    """ConfigError (exit 2) unless seed is a xorshift64* state in 1..2**64-1: state 0 never
    changes (every coin is 0, so every sample is the lowest-id token), and a seed outside the
    range would silently alias another one mod 2**64."""
    if not 1 <= int(seed) <= Xorshift._MASK:
        raise ConfigError(f"--seed {seed}: must be in 1..{Xorshift._MASK} (llm.c's xorshift64* state)",
                          hint="xorshift state 0 never changes, so every coin would be 0; pass e.g. --seed 1337 "
                               "(the default)")


def check_sampling(temperature=1.0, top_k=None, top_p=None, seed=None):
    """ConfigError (exit 2) unless temperature is finite and >= 0, top_p in (0, 1], top_k >= 0
    and the seed (when given) a valid xorshift state (check_seed)."""
    if seed is not None:
        check_seed(seed)
    if not (math.isfinite(float(temperature)) and temperature >= 0):
        raise ConfigError(f"--temperature {temperature}: must be a finite number >= 0",
                          hint="0 = greedy, 1 = the model's distribution")
    if top_p is not None and not (math.isfinite(float(top_p)) and 0.0 < top_p <= 1.0):
        raise ConfigError(f"--top-p {top_p}: must be in (0, 1]", hint="1 = off")
    if top_k is not None and top_k < 0:
        raise ConfigError(f"--top-k {top_k}: must be >= 0", hint="0 = off")


def default_start(vocab_size, eot=EOT):
    """The token a prompt-less sample starts from, as train's sampler does: EOT if the vocabulary
    has it, else token 0. -> (token, note or None); the note says why token 0 was used."""
    if eot < vocab_size:
        return eot, None
    return 0, (f"the model's vocabulary has {vocab_size} tokens, so it has no <|endoftext|> "
               f"({eot}); starting from token 0 instead")


def check_sample_length(config, n_prompt, max_new_tokens):
    """How many new tokens fit after a prompt of n_prompt tokens (prompt + new <= maxT).
    -> (n, message or None); raises ConfigError if the prompt alone does not fit."""
    maxT = config.max_seq_len
    if n_prompt < 1:
        raise ConfigError("the prompt is empty", hint="pass --prompt TEXT or omit it to start from <|endoftext|>")
    if n_prompt >= maxT:
        raise ConfigError(f"the prompt is {n_prompt} tokens; the model's context is maxT = {maxT}, "
                          "leaving no room to generate", hint="use a shorter prompt")
    room = maxT - n_prompt
    if max_new_tokens > room:
        return room, (f"-n {max_new_tokens} does not fit: prompt {n_prompt} + new tokens must be "
                      f"<= maxT {maxT}; generating {room} tokens")
    return max_new_tokens, None


def generate(model, prompt_tokens, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
             seed=1337, use_cache=True, stop_at_eot=True, on_token=None, rng=None, eot=EOT):
    """Generate up to max_new_tokens ids after prompt_tokens; returns the generated ids (the EOT
    that stopped generation included). An empty prompt starts from [eot], like llm.c.

    on_token(id) is called as each id is chosen. `rng` (an Xorshift) continues an existing coin
    stream; otherwise a fresh one is seeded with `seed`. use_cache=False recomputes the full
    forward over all positions at every step (llm.c's way; for benchmarks and tests).
    Raises ConfigError if prompt + max_new_tokens exceeds the model's maxT."""
    cfg = model.config
    prompt = [int(t) for t in prompt_tokens] or [default_start(cfg.vocab_size, eot)[0]]
    if any(t < 0 or t >= cfg.vocab_size for t in prompt):
        raise ConfigError(f"prompt token ids must be in [0, {cfg.vocab_size})",
                          hint="this model's vocabulary is smaller than GPT-2's; use a shorter/plainer prompt")
    n, msg = check_sample_length(cfg, len(prompt), int(max_new_tokens))
    if msg is not None:
        raise ConfigError(msg, hint="lower -n or shorten the prompt")
    check_sampling(temperature, top_k, top_p)
    rng = rng if rng is not None else Xorshift(seed)
    # the sampler's exps on the model's OpenMP threads only where its decode products run on them
    # too: between BLAS calls (fp32's one-row products) an OpenMP region leaves its threads
    # spinning against BLAS's (fp32 decoding ran at half speed)
    nt = model.n_threads if model.ops.gemv_on_openmp else 1
    out = []
    if use_cache:
        cache = KVCache(cfg, 1, len(prompt) + n)
        h = model.forward_cached(cache, np.array([prompt], dtype=np.int32))
        lbuf = np.empty(cfg.vocab_size, np.float32)   # each token's logits, read before the next are made
        logits = model.logits_from_hidden(h[0, -1], lbuf)
    else:
        seq = list(prompt)
        logits = _full_forward_last_logits(model, seq, cfg.vocab_size)
    for i in range(n):
        if temperature < GREEDY_BELOW:  # greedy; no coin drawn, as for temperature 0
            tok = int(np.argmax(logits))
        else:
            tok = sample_token(logits, rng.random_f32(), temperature, top_k, top_p, nt)
        out.append(tok)
        if on_token is not None:
            on_token(tok)
        if (stop_at_eot and tok == eot) or i == n - 1:
            break
        if use_cache:
            h = model.forward_cached(cache, np.array([[tok]], dtype=np.int32))
            logits = model.logits_from_hidden(h[0, -1], lbuf)
        else:
            seq.append(tok)
            logits = _full_forward_last_logits(model, seq, cfg.vocab_size)
    return out


def _full_forward_last_logits(model, seq, V):
    model.forward(np.array([seq], dtype=np.int32), keep_activations=False)
    return np.array(model.logits()[0, len(seq) - 1, :V], dtype=np.float32)


# ----------------------------------------------------------------------------------------------
# streaming text

def escape_controls(s):
    # keep \n and \t; show any other control character (ESC, CR, DEL, C1 ...) as an escape
    if all(c in "\n\t" or unicodedata.category(c) != "Cc" for c in s):
        return s
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else
                   (f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}") for c in s)


class StreamDecoder:
    """Token ids -> text pieces as they arrive. Bytes of a character split across tokens are held
    back until complete; invalid UTF-8 becomes U+FFFD. With escape=True control characters other
    than newline and tab are printed as \\xNN (safe for terminals)."""

    def __init__(self, tokenizer, escape=True):
        self.tokenizer = tokenizer
        self.escape = escape
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id):
        s = self._dec.decode(self.tokenizer.decode_bytes([int(token_id)]))
        return escape_controls(s) if self.escape else s

    def flush(self):
        s = self._dec.decode(b"", final=True)
        return escape_controls(s) if self.escape else s


def sample(model, prompt_tokens, num_samples=1, max_new_tokens=64, temperature=1.0, top_k=None,
           top_p=None, seed=1337, use_cache=True, tokenizer=None, on_text=None, escape=True,
           on_sample_start=None, on_sample_end=None):
    """`llmctl sample`: num_samples generations from one seeded coin stream.
    on_text(sample_index, text_piece) streams printable text; on_sample_start(i) and
    on_sample_end(i, result) bracket each sample. -> list of dicts {prompt_tokens, tokens, text,
    stopped_at_eot} (tokens = generated ids incl. a final EOT; text = their decoding without it;
    stopped_at_eot: generation ended at EOT rather than after max_new_tokens)."""
    from llmctl.tokenizer import get_tokenizer

    tok = tokenizer or get_tokenizer()
    rng = Xorshift(seed)
    results = []
    for s in range(num_samples):
        if on_sample_start is not None:
            on_sample_start(s)
        dec = StreamDecoder(tok, escape=escape)

        def on_token(t, s=s, dec=dec):
            if t == tok.eot:
                return
            piece = dec.feed(t)
            if on_text is not None and piece:
                on_text(s, piece)

        ids = generate(model, prompt_tokens, max_new_tokens, temperature, top_k, top_p,
                       use_cache=use_cache, on_token=on_token, rng=rng,
                       eot=tok.eot)
        tail = dec.flush()
        if tail and on_text is not None:
            on_text(s, tail)
        at_eot = bool(ids) and ids[-1] == tok.eot
        text_ids = ids[:-1] if at_eot else ids
        start = [default_start(model.config.vocab_size, tok.eot)[0]]
        results.append({"prompt_tokens": [int(t) for t in prompt_tokens] or start,
                        "tokens": ids, "text": tok.decode(text_ids), "stopped_at_eot": at_eot})
        if on_sample_end is not None:
            on_sample_end(s, results[-1])
    return results

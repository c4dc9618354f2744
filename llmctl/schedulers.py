"""Learning-rate schedules: llm.c's `llmc/schedulers.h` (cosine, linear, constant, wsd), step 0-based.

What it is: `get_learning_rate(kind, step, lr, warmup, num_steps, final_frac)` and a small
`LRScheduler` holding those settings, computed in float32 like llm.c's C floats so the `lr:` values
in main.log match llm.c's to the printed digits.
What it is not: an optimizer, or a schedule llm.c does not have.
Reference: llm.c's `llmc/schedulers.h`.
"""
import math

import numpy as np

from llmctl.errors import ConfigError

SCHEDULERS = ("cosine", "linear", "constant", "wsd")

_f32 = np.float32


def _warmup(lr, step, warmup):
    return lr * _f32(step + 1) / _f32(warmup)


def _decay_ratio(step, start, end):
    r = _f32(step - start) / _f32(end - start)
    if not (0.0 <= r <= 1.0):
        raise ValueError(f"step {step} is outside the decay window [{start}, {end}]")
    return r


def lr_cosine(step, lr, warmup, num_steps, final_frac):
    lr = _f32(lr)
    if step < warmup:
        return _warmup(lr, step, warmup)
    r = _decay_ratio(step, warmup, num_steps)
    coeff = _f32(0.5) * (_f32(1.0) + np.cos(_f32(math.pi * float(r))))
    min_lr = lr * _f32(final_frac)
    return min_lr + coeff * (lr - min_lr)


def lr_linear(step, lr, warmup, num_steps, final_frac):
    lr = _f32(lr)
    if step < warmup:
        return _warmup(lr, step, warmup)
    r = _decay_ratio(step, warmup, num_steps)
    min_lr = lr * _f32(final_frac)
    return lr - r * (lr - min_lr)


def lr_constant(step, lr, warmup, num_steps, final_frac):
    # llm.c's constant schedule has no warmup either
    return _f32(lr)


def lr_wsd(step, lr, warmup, num_steps, final_frac):
    # warmup, stable until 80% of the steps, then 1 - sqrt decay (arXiv:2405.18392)
    lr = _f32(lr)
    decay_point = int(_f32(0.8) * _f32(num_steps))
    if step < warmup:
        return _warmup(lr, step, warmup)
    if step < decay_point:
        return lr
    r = _decay_ratio(step, decay_point, num_steps)
    min_lr = lr * _f32(final_frac)
    return min_lr + (_f32(1.0) - np.sqrt(r)) * (lr - min_lr)


_FUNCS = {"cosine": lr_cosine, "linear": lr_linear, "constant": lr_constant, "wsd": lr_wsd}


def get_learning_rate(kind, step, lr, warmup, num_steps, final_frac):
    """The learning rate at 0-based `step` of `num_steps` (a Python float holding a float32)."""
    try:
        fn = _FUNCS[kind]
    except KeyError:
        raise ConfigError(f"unknown learning-rate schedule {kind!r}",
                          hint=f"use one of: {', '.join(SCHEDULERS)}") from None
    return float(fn(step, lr, warmup, num_steps, final_frac))


class LRScheduler:
    """llm.c's LearningRateScheduler: fixed settings, `lr_at(step)` per step."""

    def __init__(self, kind, lr, warmup, num_steps, final_frac):
        if kind not in _FUNCS:
            raise ConfigError(f"unknown learning-rate schedule {kind!r}",
                              hint=f"use one of: {', '.join(SCHEDULERS)}")
        if warmup < 0:
            raise ConfigError(f"warmup iterations must be >= 0, got {warmup}")
        self.kind, self.lr, self.warmup = kind, lr, warmup
        self.num_steps, self.final_frac = num_steps, final_frac

    def lr_at(self, step):
        return get_learning_rate(self.kind, step, self.lr, self.warmup, self.num_steps,
                                 self.final_frac)

"""llm.c's OutlierDetector (llmc/outlier_detector.h) for `llmctl train -sl/-sg`.

What it is: `OutlierDetector(window=128)`, a sliding window of the last `window` values with
running double-precision sums, updated exactly as llm.c's `update_detector` does it (same
operations in the same order, so the same z-scores bit for bit):
- while fewer than `window` values have been seen, the value is stored and NaN is returned;
- afterwards the oldest value is replaced by the new one FIRST, and the z-score of the new value
  is taken against that window (which includes it): mean = sum/W, population variance
  sum_sq/W - mean^2 (running sums, not recomputed), z = (x - mean)/sqrt(var); 0.0 when the
  std is exactly 0, NaN when rounding makes the variance negative (C's sqrt of a negative).
Values that trigger a skip are still added (llm.c master has no roll-back; an unmerged llm.c
branch with a 64-value window that un-adds skipped values is not mirrored).
`skip_update(z, threshold)` is train_gpt2.cu's test `isfinite(z) && threshold != 0 &&
z > threshold` with both cast to float32 (`as_float32`).
`state_dict()` / `load_state_dict()` give the exact state (floats as hex) so a resumed run continues
bit for bit; llm.c itself does not save the detectors (its windows restart empty on resume).
What it is not: the decision of what to feed it or what to print (llmctl/train.py).
"""
import math

import numpy as np

WINDOW = 128  # llm.c OUTLIER_DETECTOR_WINDOW_SIZE


class OutlierDetector:
    def __init__(self, window=WINDOW):
        if int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = int(window)
        self.buffer = [0.0] * self.window
        self.count = 0
        self.index = 0
        self.sum = 0.0
        self.sum_sq = 0.0

    def update(self, x):
        """Add x; return its z-score against the window that now holds it (NaN until full)."""
        x = float(x)
        W = self.window
        if self.count < W:
            self.buffer[self.count] = x
            self.sum += x
            self.sum_sq += x * x
            self.count += 1
            return math.nan
        old = self.buffer[self.index]
        self.sum -= old
        self.sum_sq -= old * old
        self.buffer[self.index] = x
        self.sum += x
        self.sum_sq += x * x
        self.index = (self.index + 1) % W
        mean = self.sum / W
        variance = self.sum_sq / W - mean * mean
        if math.isnan(variance) or variance < 0.0:
            return math.nan  # C: sqrt(negative) is NaN, and so is z
        std = math.sqrt(variance)
        if std == 0.0:
            return 0.0
        return (x - mean) / std

    def state_dict(self):
        """JSON-ready exact state: floats as float.hex strings (round-trip bit for bit)."""
        return {"window": self.window, "count": self.count, "index": self.index,
                "sum": self.sum.hex(), "sum_sq": self.sum_sq.hex(),
                "buffer": [v.hex() for v in self.buffer]}

    def load_state_dict(self, d):
        """Restore state_dict()'s output; ValueError/KeyError/TypeError if it is malformed."""
        window, count, index = int(d["window"]), int(d["count"]), int(d["index"])
        buf = [float.fromhex(s) for s in d["buffer"]]
        if window != self.window or len(buf) != window:
            raise ValueError(f"window {window} with {len(buf)} values, expected {self.window}")
        if not (0 <= count <= window and 0 <= index < window):
            raise ValueError(f"count {count} / index {index} out of range for window {window}")
        self.count, self.index, self.buffer = count, index, buf
        self.sum, self.sum_sq = float.fromhex(d["sum"]), float.fromhex(d["sum_sq"])


def as_float32(x):
    """x rounded to float32 (llm.c's `float`), back as a Python float; overflow gives inf."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def skip_update(z, threshold):
    """train_gpt2.cu: `isfinite(z) && threshold != 0.0f && z > threshold`, both as float32."""
    z32, t32 = as_float32(z), as_float32(threshold)
    return math.isfinite(z32) and t32 != 0.0 and z32 > t32

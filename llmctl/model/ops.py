"""The model's precision behind one object: the kernels whose arithmetic fp32 and bf16 do differently.

What it is: `Kernels`, the compiled kernel modules the model calls (one namespace, so a benchmark
can time every call by wrapping its attributes), and `ops_for(precision, ...)`: an `Fp32Ops` or
a `Bf16Ops`. Both have the same methods, which are exactly the places where mixed precision
changes the computation:
  layernorm / gelu   write a matmul input (bf16: rounded to bf16 by the kernel itself); the
                     layernorm adds a residual into its input first where given (one pass)
  mm_input           the copy of an fp32 activation a matmul reads (bf16: a cast; fp32: itself)
  cast_layer         before a layer runs: the layer's weights in the matmul precision (bf16 after
                     layer_weights(): cast into one layer's buffer now, unless hold() cast every
                     layer's into memory the model lent until release(); otherwise nothing to do)
  matmul             out = inp @ W^T + b, W the model's weight in the matmul precision
  matmul_backward    dinp, dW, db += their gradients (bf16: dout rounded to bf16 for the GEMMs);
                     accumulate=False: dinp written, not added to; dweight_accumulate=False:
                     dW likewise (bf16, first_write: a beta-0 GEMM; fp32: a fill first)
  layernorm_backward dinp, dweight, dbias += the layernorm's gradients; bf16 also writes the
                     residual stream's gradient as the next backward GEMM reads it (bf16) and
                     sums that GEMM's bias gradient, in the same pass (-> True: matmul_backward
                     then takes dout=None, db=None)
  act_grad           the buffer such a dinp goes into when only the GELU's or the attention's
                     backward reads it (bf16: a bf16 array, the GEMM rounds it as they would)
  gelu_backward      d(fch) as the fc layer's matmul_backward reads it (bf16: rounded, with the
                     fc bias gradient summed in the same pass)
  gelu_forward_backward   a backward that recomputes the GELU does it in gelu_backward's pass
                     over fch, d(fch) written over d(gelu) in place (-> as gelu_backward, and
                     the buffer the fc layer's matmul_backward then reads as dout_mm)
  logits_dtype       the lm head's logits as the training forward holds them (bf16: the GEMM
                     rounds them, as autocast's lm head; the KV-cached forward's stay fp32)
  loss_forward       the losses of a block of logits (fp32: probs over them in place; bf16:
                     the logits kept), what loss_backward then reads
  loss_backward      dlogits of a block of rows, as the lm head's matmul_backward reads it
                     (loss_forward_backward: the softmax and losses first, row by row)
  logits_fp32        the held logits as float32 (bf16: widened, exactly)
  attention_forward / attention_backward   the flash-style attention over T positions (bf16:
                     QK^T, PV and the backward's products on bf16 operands, fp32 accumulation)
Everything else (residuals, the softmax statistics, the loss, AdamW, the master weights) is fp32
in both, and so is the KV-cached attention of sampling and HellaSwag (_ext/kvcache.pyx).
What it is not: the model (llmctl/model/gpt2.py: buffers, the layer loop) or a kernel.
"""
import numpy as np

from llmctl.errors import ConfigError


class Kernels:
    """The compiled kernel modules, or a ConfigError saying how to build them."""

    def __init__(self):
        try:
            from llmctl._ext import adamw, attention, convert, decode, kvcache, layers, matmul
        except ImportError as e:
            from llmctl._ext import load_error

            raise ConfigError(*load_error(e)) from e
        self.matmul, self.layers, self.attention = matmul, layers, attention
        self.adamw, self.convert, self.kvcache, self.decode = adamw, convert, kvcache, decode


class Fp32Ops:
    """fp32 everywhere: llm.c's train_gpt2.c."""

    act_dtype = np.float32
    logits_dtype = np.float32
    held = None   # Bf16Ops.hold's loan
    # whether matmul_backward(dweight_accumulate=False) is a beta-0 GEMM (no fill before it): the
    # model then never fills spent gradients (GPT2.zero_grad(lazy=True)); fp32 keeps llm.c's
    # accumulating kernels and its fills
    first_write = False
    # a one-row matmul (decode) runs on NumPy's BLAS and its own threads, not on OpenMP's
    gemv_on_openmp = False

    def __init__(self, k, params, engine):
        """k: Kernels; params: dict name -> fp32 parameter view; engine: the GEMM engine (None: default)."""
        self.k, self.p, self.engine = k, params, engine

    def weight(self, name, l):
        return (self.p[name] if l is None else self.p[name][l]).reshape(-1)

    def cast_layer(self, l, nt):
        pass

    def hold(self, buf, nt):
        return False

    def release(self):
        pass

    def park(self, grads):
        return False

    def unpark(self):
        pass

    def params_changed(self):
        pass

    def layernorm(self, out, mean, rstd, x, w, b, N, C, nt, residual=None):
        self.k.layers.layernorm_forward(out, mean, rstd, x, w, b, N, C, nt, residual=residual)

    def gelu(self, out, x, n, nt):
        self.k.layers.gelu_forward(out, x, n, nt)

    def mm_input(self, dst, x, nt):
        return x

    def matmul(self, out, inp, name, l, bias, N, C, OC, nt):
        W = self.weight(name, l)[:OC * C]
        if N == 1:
            # one row (a decode step) is matrix-vector: BLAS sgemv through NumPy streams the
            # weights several times faster than a GEMM with M = 1
            np.matmul(W.reshape(OC, C), inp, out=out)
            if bias is not None:
                out += bias
            return
        self.k.matmul.matmul_forward(out, inp, W, bias, N, C, OC, nt, self.engine)

    # llm.c's backward kernels accumulate (+=); where the model wants a gradient written
    # (accumulate=False), fp32 zeroes it first and keeps llm.c's kernels and their bits
    def matmul_backward(self, dinp, dW, db, dout, dout_mm, inp, name, l, N, C, OC, nt, accumulate=True,
                        dweight_accumulate=True):
        if not accumulate and dinp is not None:
            self.k.layers.zero_fill(dinp, nt)
        if not dweight_accumulate and dW is not None:
            self.k.layers.zero_fill(dW, nt)
        self.k.matmul.matmul_backward(dinp, dW, db, dout, inp, self.weight(name, l), N, C, OC, nt, self.engine)

    def act_grad(self, free, n):
        """Where a backward GEMM writes an activation gradient (accumulate=False) that only
        gelu_backward or attention_backward reads: n elements of `free` (fp32, dead until then)."""
        return free[:n]

    def layernorm_backward(self, dinp, dw, db, dy, x, w, mean, rstd, N, C, nt, dout_mm=None, db_next=None):
        """llm.c's layernorm_backward (+=). -> False: the next matmul_backward casts dinp itself."""
        self.k.layers.layernorm_backward(dinp, dw, db, dy, x, w, mean, rstd, N, C, nt)
        return False

    def gelu_backward(self, free, dout_mm, db, x, dy, N, OC, nt):
        """-> (dout, dbias) for the fc layer's matmul_backward: d(fch) = gelu'(x) dy written over
        `free` (fp32, N*OC, no longer needed), its bias gradient still to sum (db)."""
        self.k.layers.zero_fill(free, nt)
        self.k.layers.gelu_backward(free, x, dy, N * OC, nt)
        return free, db

    def gelu_forward_backward(self, out, dy, db, x, dout_mm, N, OC, nt):
        """-> (dout, dbias, dout_mm) as gelu_backward, from one pass over x that also writes GELU(x)
        into out (gelu's bits) and d(fch) over dy in place (gelu_backward's)."""
        self.k.layers.gelu_forward_backward(out, dy, x, N * OC, nt)
        return dy, db, dout_mm

    def attention_forward(self, out, lse, qkv, B, T, C, NH, nt):
        self.k.attention.attention_forward(out, lse, qkv, B, T, C, NH, nt)

    def attention_backward(self, free, dout_mm, db, dout, qkv, out, lse, B, T, C, NH, nt):
        """-> (dout, dbias) for the qkv layer's matmul_backward: d(qkv) written over `free` (fp32,
        B*T*3C), its bias gradient still to sum (db)."""
        dqkv = free[:B * T * 3 * C]   # written whole: no zero fill first
        self.k.attention.attention_backward(dqkv, dout, qkv, out, lse, B, T, C, NH, nt, accumulate=False)
        return dqkv, db

    def loss_forward(self, losses, logits, targets, N, V, Vp, nt):
        """losses of a block of logits; their probs over them, in place, for loss_backward."""
        self.k.layers.softmax_crossentropy_forward(losses, logits, logits, targets, N, V, Vp, nt)

    def logits_fp32(self, logits):
        return logits

    def loss_backward(self, dst16, probs, targets, dlosses, N, V, Vp, nt):
        """-> (dout, dout_mm) for matmul_backward: dlogits overwrite the probs in place."""
        self.k.layers.softmax_crossentropy_backward(probs, probs, targets, dlosses, N, V, Vp, nt)
        return probs, None

    def loss_forward_backward(self, losses, dst16, logits, targets, dlosses, N, V, Vp, nt):
        """losses of a block of logits, then loss_backward's dlogits over them in place: one kernel,
        the same bits as the two calls."""
        self.k.layers.softmax_crossentropy_forward_backward(losses, logits, logits, targets, dlosses,
                                                            N, V, Vp, nt)
        return logits, None


class Bf16Ops(Fp32Ops):
    """Mixed precision as PyTorch autocast on CPU: bf16 matmul inputs, fp32 accumulation and outputs."""

    act_dtype = np.uint16
    logits_dtype = np.uint16
    first_write = True

    LAYER_WEIGHTS = ("qkvw", "attprojw", "fcw", "fcprojw")

    def __init__(self, k, params, engine, params_bf16):
        """params_bf16: dict name -> the bf16 copy of the weights the matmuls read."""
        super().__init__(k, params, engine)
        self.pb = params_bf16
        self.lw, self.lw_layer, self.held, self.held_buf = None, -1, None, None
        self.slots, self.parked = None, set()   # park()'s gradient rows, the layers cast there
        self._lw_offs = None   # (buffer key, offsets): layer_weights_in's last answer
        # decode's one-row products run on OpenMP's threads (gemv_bf16.h, oneDNN), or, emulated
        # on fp32 sgemm ("blas") where this CPU has no copy of the GEMV, on the BLAS's own
        self.gemv_on_openmp = (k.matmul.gemv_bf16_available()
                               or (engine or k.matmul.get_bf16_engines()[0]) != "blas")

    def layer_weights(self, params_bf16):
        """From now on params_bf16 (dict name -> bf16 copy) holds wte (the lm head's) and wpe only, and
        each layer's weights are cast from the fp32 parameters into one layer's buffer as the layer
        runs (cast_layer), forward and backward (recompute level 3: less memory, a cast pass per
        layer run; the backward's are saved where the gradients are spent: park)."""
        self.pb = params_bf16
        if self.lw is None:
            sizes = [self.p[n][0].size for n in self.LAYER_WEIGHTS]
            buf, off = np.zeros(sum(sizes), np.uint16), np.cumsum([0] + sizes)
            self.lw = {n: buf[off[i]:off[i + 1]] for i, n in enumerate(self.LAYER_WEIGHTS)}
        self.lw_layer = -1
        self.unpark()

    def hold(self, buf, nt):
        """Layer weights: cast every layer's into buf (uint16, its contents dead until release())
        and read them from there, not cast a layer at a time, until release() or params_changed().
        -> whether they fit (else nothing is held). The model lends it the training activations
        between steps, so that a sampled or scored cached forward, a layer and a token at a time,
        reads bf16 weights as a model with the whole copy does."""
        if self.lw is None or self.held is not None:
            return self.held is not None
        L = self.p[self.LAYER_WEIGHTS[0]].shape[0]
        if buf.size < L * sum(w.size for w in self.lw.values()):
            return False
        held, at = [], 0
        for l in range(L):
            layer = {}
            for n in self.LAYER_WEIGHTS:
                layer[n], at = buf[at:at + self.lw[n].size], at + self.lw[n].size
                self.k.convert.cast_to_bf16(layer[n], self.p[n][l].reshape(-1), nt)
            held.append(layer)
        self.held, self.held_buf = held, buf
        return True

    def release(self):
        """The buffer hold() was lent is about to be written: stop reading weights there."""
        self.held = self.held_buf = None

    def park(self, grads):
        """For the training forward about to run, whose backward overwrites every layer's weight
        gradients (spent gradients): layer l >= 1 casts its weights into layer l-1's gradient rows
        (grads: name -> (L, ...) fp32 views), half their bytes, instead of the layer buffer, which
        keeps layer 0's. Those rows are junk until layer l-1's backward writes them, which comes
        after layer l's backward has read its weights there, so the backward casts nothing.
        -> whether it parks (only with the layers casting their own weights, none lent)."""
        self.unpark()
        if self.lw is None or self.held is not None:
            return False
        self.slots = {n: grads[n] for n in self.LAYER_WEIGHTS}
        return True

    def unpark(self):
        """The gradient rows park() used are written or read as gradients from now on."""
        self.slots, self.parked = None, set()

    def layer_weights_in(self, params_bf16):
        """(buf, offsets) of every layer's matmul weights in one bf16 buffer, as decode.pyx reads
        them: offsets (L, 4) int64 in elements, the columns LAYER_WEIGHTS; buf the loan of hold()
        or else params_bf16 (the whole copy). None while the layers cast their own one at a time."""
        if self.held is not None:
            buf = self.held_buf
        elif self.lw is None:
            buf = params_bf16
        else:
            return None
        base = buf.__array_interface__["data"][0]
        # a decode step asks every token: the layout only depends on which buffer it is
        key = (base, buf.size, self.held is not None)
        if self._lw_offs is None or self._lw_offs[0] != key:
            L = self.p[self.LAYER_WEIGHTS[0]].shape[0]
            offs = [[(self.weight(n, l).__array_interface__["data"][0] - base) // buf.itemsize
                     for n in self.LAYER_WEIGHTS] for l in range(L)]
            self._lw_offs = (key, np.array(offs, dtype=np.int64))
        return buf, self._lw_offs[1]

    def weight(self, name, l):
        if l is None or self.lw is None:
            return (self.pb[name] if l is None else self.pb[name][l]).reshape(-1)
        if self.held is not None:
            return self.held[l][name]
        if l in self.parked:
            return self._slot(name, l)
        if self.lw_layer != l:
            raise RuntimeError(f"bf16 weights of layer {l} requested, the layer buffer holds layer "
                               f"{self.lw_layer}: call cast_layer({l}) first")
        return self.lw[name]

    def cast_layer(self, l, nt):
        """Layer l's weights cast to bf16 into the layer buffer (the same rounding as AdamW's
        copy), unless it holds them already (the last layer of a forward is the first of the
        backward) or every layer's are held."""
        if self.lw is None or self.held is not None or l in self.parked:
            return
        if self.slots is not None and l > 0:
            for n in self.LAYER_WEIGHTS:
                self.k.convert.cast_to_bf16(self._slot(n, l), self.p[n][l].reshape(-1), nt)
            self.parked.add(l)
        elif self.lw_layer != l:
            self.lw_layer = -1
            for n in self.LAYER_WEIGHTS:
                self.k.convert.cast_to_bf16(self.lw[n], self.p[n][l].reshape(-1), nt)
            self.lw_layer = l

    def _slot(self, name, l):
        return self.slots[name][l - 1].reshape(-1).view(np.uint16)[:self.lw[name].size]

    def params_changed(self):
        self.lw_layer, self.held, self.held_buf = -1, None, None
        self.unpark()

    def layernorm(self, out, mean, rstd, x, w, b, N, C, nt, residual=None):
        self.k.layers.layernorm_forward_bf16(out, mean, rstd, x, w, b, N, C, nt, residual=residual)

    def gelu(self, out, x, n, nt):
        self.k.layers.gelu_forward_bf16(out, x, n, nt)

    def mm_input(self, dst, x, nt):
        if x.dtype == self.act_dtype:   # written in bf16 by its kernel (the training attention)
            return x
        self.k.convert.cast_to_bf16(dst, x, nt)
        return dst

    def matmul(self, out, inp, name, l, bias, N, C, OC, nt):
        W = self.weight(name, l)[:OC * C]
        self.k.matmul.matmul_forward_bf16(out, inp, W, bias, N, C, OC, nt, self.engine)

    def matmul_backward(self, dinp, dW, db, dout, dout_mm, inp, name, l, N, C, OC, nt, accumulate=True,
                        dweight_accumulate=True):
        """dout fp32 (cast into dout_mm, the same pass summing db), or None: dout_mm already holds it."""
        self.k.matmul.matmul_backward_bf16(dinp, dW, db, dout, dout_mm[:N * OC], inp, self.weight(name, l),
                                           N, C, OC, nt, self.engine, accumulate, dweight_accumulate)

    def layernorm_backward(self, dinp, dw, db, dy, x, w, mean, rstd, N, C, nt, dout_mm=None, db_next=None):
        """One pass (layers.layernorm_backward_bf16): dinp += its gradient (fp32's bits), dw and db
        += theirs, and with dout_mm the final dinp rounded into it for the next backward GEMM, whose
        bias gradient db_next (or None) gets dinp's column sums. -> whether dout_mm was written."""
        self.k.layers.layernorm_backward_bf16(dinp, dw, db, dy, x, w, mean, rstd, N, C, nt,
                                              None if dout_mm is None else dout_mm[:N * C], db_next)
        return dout_mm is not None

    def act_grad(self, free, n):
        """n bf16 values in free's memory: the GEMM writes the gradient rounded to bf16, which is
        all the GELU's table backward and the attention (which rounds its dout itself) read of
        it, as autocast's bf16 matmul outputs have bf16 gradients."""
        return free.reshape(-1).view(np.uint16)[:n]

    def gelu_backward(self, free, dout_mm, db, x, dy, N, OC, nt):
        """-> (None, None): d(fch) written in bf16 into dout_mm and its bias gradient summed into
        db in one pass (layers.gelu_backward_bf16); `free` is not needed."""
        self.k.layers.gelu_backward_bf16(dout_mm[:N * OC], db, x, dy, N, OC, nt)
        return None, None

    def gelu_forward_backward(self, out, dy, db, x, dout_mm, N, OC, nt):
        """-> (None, None, dy): GELU(x) into out and d(fch) in bf16 over dy (the bf16 d(gelu)) in
        place, its bias gradient summed into db, in one pass over x (layers.gelu_forward_backward_bf16:
        gelu's and gelu_backward's bits). dout_mm is not written: the fcproj weight gradient, made
        after this, still reads its dout there."""
        self.k.layers.gelu_forward_backward_bf16(out, dy[:N * OC], db, x, N, OC, nt)
        return None, None, dy[:N * OC]

    def attention_forward(self, out, lse, qkv, B, T, C, NH, nt):
        self.k.attention.attention_forward_bf16(out, lse, qkv, B, T, C, NH, nt)

    def attention_backward(self, free, dout_mm, db, dout, qkv, out, lse, B, T, C, NH, nt):
        """-> (None, None): d(qkv) written in bf16 into dout_mm and its bias gradient summed into
        db by the attention's backward itself (no fp32 d(qkv), no cast pass); `free` is not needed."""
        self.k.attention.attention_backward_bf16(dout_mm[:B * T * 3 * C], dout, qkv, out, lse, B, T, C, NH, nt,
                                                 accumulate=False, dbias=db)
        return None, None

    def loss_forward(self, losses, logits, targets, N, V, Vp, nt):
        """losses of a block of bf16 logits, which stay as they are for loss_backward (no probs)."""
        self.k.layers.softmax_crossentropy_forward_backward_bf16(losses, None, logits, targets, None, N, V, Vp, nt)

    def logits_fp32(self, logits):
        out = np.empty(logits.size, np.float32)
        self.k.convert.widen_bf16(out, logits.reshape(-1), 1)
        return out.reshape(logits.shape)

    def loss_backward(self, dst16, logits, targets, dlosses, N, V, Vp, nt):
        """-> (None, dlogits in bf16, written straight into dst16): from the bf16 logits loss_forward
        kept, their softmax made again row by row (the same bits as loss_forward_backward's)."""
        d16 = dst16[:N * Vp]
        self.k.layers.softmax_crossentropy_forward_backward_bf16(np.empty(N, np.float32), d16, logits, targets,
                                                                 dlosses, N, V, Vp, nt)
        return None, d16

    def loss_forward_backward(self, losses, dst16, logits, targets, dlosses, N, V, Vp, nt):
        """The same bits as the two calls in one kernel: each row's probs kept in a row buffer of
        its thread while its dlogits are written, and the logits block only read."""
        d16 = dst16[:N * Vp]
        self.k.layers.softmax_crossentropy_forward_backward_bf16(losses, d16, logits, targets, dlosses,
                                                                 N, V, Vp, nt)
        return None, d16


def ops_for(precision, kernels, params, engine, params_bf16=None):
    if precision == "fp32":
        return Fp32Ops(kernels, params, engine)
    return Bf16Ops(kernels, params, engine, params_bf16)

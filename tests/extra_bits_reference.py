"""Shared by the extra-bits tests: random inputs, truncation and packing references, and numpy
references of torch.optim's SGD and Adam/AdamW arithmetic (fused multiply-adds where torch's
CPU kernels compute one, torch's own square root)."""

import numpy as np
import torch
from reference import fma32


F32 = np.float32


def random_float32(n, seed=0, lo=-30, hi=30):
    g = np.random.default_rng(seed)
    x = (g.standard_normal(n) * np.exp2(g.uniform(lo, hi, n))).astype(F32)
    return torch.from_numpy(x)


def truncate_bits(w: torch.Tensor, dtype, k) -> torch.Tensor:
    """W truncated toward zero to (16-bit precision + k) bits, in float64 arithmetic."""
    m16, emin = (7, -126) if dtype == torch.bfloat16 else (10, -14)
    x = w.double().numpy()
    a = np.abs(x)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    step = np.exp2(np.maximum(e, emin) - m16 - k)
    return torch.from_numpy(np.sign(x) * np.floor(a / step) * step).float()


def pack_reference(values, q):
    """docs/design.md §5's packing as a bit string: element j of each 32-element block at bits [j q, (j + 1) q)
    of the block's q words, least significant bit first; the last block padded with zeros. int32s."""
    n = -(-len(values) // 32) * 32
    bits = "".join(format(v, f"0{q}b")[::-1] for v in values) + "0" * q * (n - len(values))
    words = [int(bits[32 * j:32 * j + 32][::-1], 2) for j in range(n * q // 32)]
    return [wd - 2**32 if wd >= 2**31 else wd for wd in words]


def torch_sqrt(x):
    """torch's CPU float32 square root (MKL's on MKL builds: not always correctly rounded)."""
    return torch.from_numpy(np.ascontiguousarray(x)).sqrt().numpy()


class RefSGD:
    """torch.optim.SGD's single-tensor formulas in numpy float32, operation by operation, with a
    fused multiply-add (fma32) where torch's CPU kernels compute one (add with alpha)."""

    def __init__(self, w, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
                 state_round=None):
        self.w, self.buf = [x.copy() for x in w], [None] * len(w)
        # the buffer's storage: each in-place update of a bfloat16 buffer rounds it
        self.state_round = state_round or (lambda a: a)
        self.h = (F32(-lr), F32(momentum), F32(1 - dampening), F32(weight_decay), nesterov, maximize, momentum != 0)

    def step(self, grads):
        neg_lr, mom, omd, wd, nesterov, maximize, has_m = self.h
        R = self.state_round
        for i, g in enumerate(grads):
            d = -g if maximize else g
            if wd != 0:
                d = fma32(wd, self.w[i], d)
            if has_m:
                if self.buf[i] is None:
                    buf = d.copy()  # torch's clone of the gradient: stored rounded, used as it is
                else:
                    buf = R(fma32(omd, d, R(self.buf[i] * mom)))
                d = fma32(mom, buf, d) if nesterov else buf
                self.buf[i] = R(buf)
            self.w[i] = fma32(neg_lr, d, self.w[i])


class RefAdam:
    """torch.optim.Adam/AdamW's single-tensor formulas in numpy float32, with torch's fused
    multiply-adds (add with alpha, lerp, addcmul) and torch's own square root. With
    ``cuda=True``, the association of torch's CUDA foreach kernels (ForeachFunctors.cuh:
    ``self + value * op(t1, t2)``, one fused multiply-add) and a correctly rounded square root."""

    def __init__(self, w, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                 maximize=False, decoupled=False, state_round=None, cuda=False):
        self.cuda = cuda
        self.w = [x.copy() for x in w]
        self.state_round = state_round  # applied to the stored moments after each step
        self.m = [np.zeros_like(x) for x in w]
        self.v = [np.zeros_like(x) for x in w]
        self.vmax = [np.zeros_like(x) for x in w]
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.amsgrad, self.maximize, self.decoupled, self.t = amsgrad, maximize, decoupled, 0

    def step(self, grads):
        self.t += 1
        b1, b2 = self.betas
        bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        neg_ss, bc2s = F32(-(self.lr / bc1)), F32(bc2 ** 0.5)
        lw = F32(1 - b1)
        for i, g in enumerate(grads):
            g = -g if self.maximize else g
            w = self.w[i]
            if self.decoupled and self.wd != 0:
                w = w * F32(1 - self.lr * self.wd)
            elif self.wd != 0:
                g = fma32(F32(self.wd), w, g)  # grad.add(param, alpha=wd)
            m = self.m[i]  # lerp: one rounding after the difference
            self.m[i] = fma32(lw, g - m, m) if abs(lw) < 0.5 else fma32(lw - F32(1), g - m, g)
            kept = self.v[i] * F32(b2)  # mul_ then addcmul_
            self.v[i] = fma32(F32(1 - b2), g * g, kept) if self.cuda else fma32(F32(1 - b2) * g, g, kept)
            v = self.v[i]
            if self.amsgrad:
                self.vmax[i] = np.maximum(self.vmax[i], self.v[i])
                v = self.vmax[i]
            denom = (np.sqrt(v) if self.cuda else torch_sqrt(v)) / bc2s + F32(self.eps)
            if self.cuda:  # addcdiv_
                self.w[i] = fma32(neg_ss, self.m[i] / denom, w)
            else:
                self.w[i] = w + (neg_ss * self.m[i]) / denom
            if self.state_round is not None:
                self.m[i], self.v[i], self.vmax[i] = map(self.state_round, (self.m[i], self.v[i], self.vmax[i]))


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.GELU(), torch.nn.Linear(32, 4))

"""``lowfp reproduce``: the comparison behind each paper lowfp implements, in miniature, on a task
where precision matters (next-character prediction on Python's standard library, ``pysource``),
with several seeds, and a report whose verdicts are computed from the runs.

    lowfp reproduce [mpt|s2fp8|extrabits|assignment|accumulation|nvfp4|all] [--out DIR] [--seeds N] [--epochs E]

Each experiment is a few *arms* (TrainConfig changes on one base run) and the paper's claims as
comparisons of two arms' final test loss (cross-entropy per character; lower is better):

- ``better(a, b)``: a ends below b by more than the noise margin;
- ``close(a, b)``: a ends no more than the tolerance above b (it "reaches" b);
- ``fails(a, b)``: a diverges, or ends far above b.

The accumulation experiment adds claims measured on GEMMs rather than trained
(``lowfp.experiments.accumulation``: an FP8 GEMM's error against the exact sum).

Arms run with the same seeds (the same initial weights and batch order), so a claim is judged
on the per-seed differences a − b: the difference is their mean, and the noise margin is their
spread (max − min), at least NOISE_FLOOR (for arms without common seeds: the difference of the
means and twice the larger spread of either arm). The tolerance of ``close`` is the larger of
the margin and CLOSE × b's loss; "far" for ``fails`` is the larger of the margin and FAIL × b's
loss. A claim is *reproduced* when the
data show it beyond the margin, *not reproduced* when they show the opposite, and *inconclusive*
in between. Runs are keyed by their configuration in ``DIR/results.json``: an interrupted run
resumes, and experiments share identical runs (the float32 baseline).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from .. import __version__
from .optional import import_optional
from . import accumulation, train
from . import description
from .sweep import config_key, run_configs

__all__ = ["Arm", "Claim", "Experiment", "EXPERIMENTS", "BASE", "verdict", "arm_stats",
           "run_reproduce", "main"]

NOISE_FLOOR = 0.005  # nats: the smallest margin (one seed has no spread)
CLOSE = 0.02         # "reaches": within 2 % of the reference's loss
FAIL = 0.10          # "fails": 10 % above the reference's loss, or diverged

# The default task: a 2-block GPT (width 64) on 460 Ki characters of the standard library, 2
# epochs of AdamW (a few seconds a run on 2 CPU cores).
BASE = train.TrainConfig(model="gpt", data="pysource", width=0.5, epochs=2, batch_size=64,
                         optimizer="adamw", lr=3e-3, weight_decay=0.01, assignment="fp32",
                         loss_scale="dynamic", schedule="cosine")


@dataclass(frozen=True)
class Arm:
    key: str
    label: str
    changes: Tuple[Tuple[str, object], ...] = ()

    def config(self, base: train.TrainConfig, seed: int, resolved: Dict[str, float]) -> train.TrainConfig:
        changes = {k: (resolved[v] if isinstance(v, str) and v in resolved else v)
                   for k, v in self.changes}
        return replace(base, seed=seed, **changes)


def arm(key: str, label: str, **changes) -> Arm:
    return Arm(key, label, tuple(sorted(changes.items())))


@dataclass(frozen=True)
class Claim:
    text: str
    kind: str  # "better", "close", "fails", or "measured" (on GEMMs: accumulation.claims)
    a: str
    b: str


@dataclass(frozen=True)
class Experiment:
    key: str
    title: str
    claim: str                       # the paper's claim, in words
    arms: Tuple[Arm, ...]
    claims: Tuple[Claim, ...]
    base_changes: Tuple[Tuple[str, object], ...] = ()
    epochs_factor: float = 1         # epochs = this × the base's (rounded, at least 1)
    width_factor: float = 1          # width = this × the base's
    # (arm, loss-scaled arm): plot the first's activation-gradient exponents against float16's
    # range, and shifted by the second's final loss scale
    gradients: Tuple[str, ...] = ()
    # claims measured on GEMMs rather than trained (accumulation.py), in the verdicts after the
    # training claims
    gemm_errors: bool = False

    def base(self, base: train.TrainConfig) -> train.TrainConfig:
        return replace(base, epochs=max(1, round(base.epochs * self.epochs_factor)),
                       width=base.width * self.width_factor, **dict(self.base_changes))


FP32 = arm("fp32", "float32")
_FP16 = dict(assignment="uniform", hi="float16", lo_forward="float16", lo_backward="float16")
_LO8 = dict(lo_forward="fp(4,3,4)", lo_backward="fp(5,2,0)")
# A 5-significant-bit accumulator (float32's exponent range) for the weight-gradient GEMMs, whose
# reduction runs over the batch's 4096 characters; the chunked arm sums chunks of 64 products,
# then the chunks' sums, both in the same format (Sakr et al.'s chunk-based accumulation).
_SHORT_SUM = "fp(8,4,0,specials='ieee')"
_SHORT = dict(accumulate=f'Accumulate("{_SHORT_SUM}")', accumulate_gemms="wgrad")
_CHUNKED = dict(accumulate=f'Accumulate("{_SHORT_SUM}", order="blocked", block=64, outer="{_SHORT_SUM}")',
                accumulate_gemms="wgrad")

# The NVFP4 pretraining report's recipe: lowfp's "nvfp4" GemmRecipe (16×16 weight blocks, stochastic
# gradients, the Hadamard transform on the weight gradient's operands) with the last 15 % of the
# linear layers (here the output head) left in float32.
_NVFP4 = dict(recipe="nvfp4", high_precision=0.15)

EXPERIMENTS: Dict[str, Experiment] = {e.key: e for e in (
    Experiment(
        "mpt", "Mixed Precision Training (Micikevicius et al., ICLR 2018)",
        "Storing activations and gradients in float16 loses small gradients to underflow and "
        "trains worse; dynamic loss scaling recovers float32's result; float16 weights updated "
        "without a float32 master copy train worse still.",
        (FP32, arm("fp16", "float16, no loss scaling", loss_scale="none", **_FP16),
         arm("fp16-scaled", "float16, dynamic loss scaling", **_FP16),
         arm("fp16-no-master", "float16, dynamic loss scaling, weights rounded to float16 "
             "after each step (no float32 master)", round_weights="float16", **_FP16)),
        (Claim("without loss scaling float16 trains worse than with it", "better", "fp16-scaled", "fp16"),
         Claim("dynamic loss scaling reaches float32", "close", "fp16-scaled", "fp32"),
         Claim("float16 weights without a float32 master train worse", "better", "fp16-scaled",
               "fp16-no-master")),
        # large batches: the mean loss over 64 Ki characters makes gradients small enough to
        # underflow float16, as in the paper's detection and speech models
        base_changes=(("batch_size", 1024), ("lr", 1e-2)), epochs_factor=1.5,
        gradients=("fp32", "fp16-scaled")),
    Experiment(
        "s2fp8", "Shifted and Squeezed 8-bit Floating Point (Cambier et al., ICLR 2020)",
        "Rounding every tensor to float8_e5m2 without loss scaling fails to train; S2FP8's "
        "per-tensor shift and squeeze reaches float32's result with no loss scaling and no layer "
        "kept in high precision.",
        (FP32, arm("e5m2", "float8_e5m2, no loss scaling", assignment="uniform",
                   lo_forward="float8_e5m2", lo_backward="float8_e5m2", loss_scale="none"),
         arm("s2fp8", "S2FP8, no loss scaling", assignment="uniform", lo_forward="s2fp8",
             lo_backward="s2fp8", loss_scale="none")),
        (Claim("float8_e5m2 without loss scaling fails", "fails", "e5m2", "fp32"),
         Claim("S2FP8 reaches float32", "close", "s2fp8", "fp32"))),
    Experiment(
        "extrabits", "Memory Efficient Mixed-Precision Optimizers (Lewandowski et al., 2023)",
        "16-bit weights with 8 extra bits match a float32 master; 8-bit weights with 8 extra bits "
        "nearly do (ResNet-18/CIFAR-10: fp32 94.64, fp8+8 93.96), with 4 extra bits they fall "
        "behind (65.53) and without extra bits they fail (8.78).",
        (FP32, arm("bf16+8", "bfloat16 + 8 extra bits", optimizer="extrabits-adamw", extra_bits=8),
         arm("fp8+8", "float8_e5m2 + 8 extra bits", optimizer="extrabits-adamw", extra_bits=8,
             weight_format="float8_e5m2"),
         arm("fp8+4", "float8_e5m2 + 4 extra bits", optimizer="extrabits-adamw", extra_bits=4,
             weight_format="float8_e5m2"),
         arm("fp8+1", "float8_e5m2 + 1 extra bit", optimizer="extrabits-adamw", extra_bits=1,
             weight_format="float8_e5m2")),
        (Claim("bfloat16 + 8 extra bits reaches float32", "close", "bf16+8", "fp32"),
         Claim("float8 + 8 extra bits reaches float32", "close", "fp8+8", "fp32"),
         Claim("float8 + 8 extra bits beats float8 + 4", "better", "fp8+8", "fp8+4"),
         Claim("float8 weights with (almost) no extra bits fail", "fails", "fp8+1", "fp32"))),
    Experiment(
        "assignment", "Training with Mixed-Precision Floating-Point Assignments (Lee et al., TMLR 2023)",
        "At an equal low-precision ratio the size-ordered assignment ours(r) trains better than "
        "the operator-based op; the uniform 8-bit assignment loses accuracy; promoting "
        "overflowing tensors prevents divergence at a few percent of memory.",
        (FP32, arm("uniform", "uniform fp(4,3,4)/fp(5,2,0)", assignment="uniform", **_LO8),
         arm("op", "op", assignment="op", **_LO8),
         arm("ours", "ours(r = op's ratio)", assignment="ours", r="ratio_of_op", **_LO8),
         # at lr 0.05 the MLPs' outputs outgrow fp(4,3,4)'s largest value, 30
         arm("fp32-hot", "float32 at lr 0.05", lr=5e-2),
         arm("uniform-hot", "uniform at lr 0.05", assignment="uniform", lr=5e-2, **_LO8),
         arm("uniform-hot-no-promotion", "uniform at lr 0.05, no promotion", assignment="uniform",
             lr=5e-2, promote=False, **_LO8)),
        (Claim("ours(r) beats op at op's low-precision ratio", "better", "ours", "op"),
         Claim("the uniform 8-bit assignment trains worse than float32", "better", "fp32", "uniform"),
         Claim("promotion keeps uniform from diverging or degrading", "better", "uniform-hot",
               "uniform-hot-no-promotion"))),
    Experiment(
        "accumulation", "Accumulation precision (DeepSeek-V3, 2024, §3.3.2; Sakr et al., ICLR 2019)",
        "Hopper's FP8 tensor cores keep about 14 bits of a GEMM's running sum: at K = 4096 the "
        "result errs by nearly 2 %, and promoting partial sums to float32 every 128 products fixes "
        "it (DeepSeek-V3). Too short an accumulator swamps small products and trains worse, the "
        "more so the longer the reduction; chunk-based accumulation lets the same short "
        "accumulator match float32 (Sakr et al.).",
        (FP32, arm("short", "weight-gradient GEMMs summed in fp(8,4,0)", **_SHORT),
         arm("chunked", "the same, in chunks of 64", **_CHUNKED)),
        (Claim("a short accumulator without chunking trains worse than float32", "better", "fp32", "short"),
         Claim("with chunking the same accumulator reaches float32", "close", "chunked", "fp32")),
        # every emulated GEMM is lowfp.gemm on the CPU: half the width, one epoch
        epochs_factor=1 / 2, width_factor=0.5, gemm_errors=True),
    Experiment(
        "nvfp4", "NVFP4 pretraining (NVIDIA, arXiv 2509.25149); MXFP8 scale rounding (arXiv 2506.08027)",
        "The NVFP4 recipe (about 15 % of the linear layers, the last, kept in high precision; the "
        "random Hadamard transform on the weight-gradient GEMM's operands; 16×16 weight blocks; "
        "stochastic rounding of gradients) trains close to the high-precision baseline, and each "
        "of its parts matters: without one, or with every layer in NVFP4, training is worse. "
        "MXFP8 with the OCP floor scale rule can diverge where cuBLAS's rceil rule matches BF16.",
        (FP32, arm("nvfp4", "NVFP4 recipe", **_NVFP4),
         arm("no-hadamard", "NVFP4 recipe without the Hadamard transform",
             **{**_NVFP4, "recipe_changes": "hadamard_seed=None"}),
         arm("nearest-grads", "NVFP4 recipe, gradients rounded to nearest",
             **{**_NVFP4, "recipe_changes": "grad_rounding='nearest'"}),
         arm("1x16-weights", "NVFP4 recipe, 1×16 weight blocks",
             **{**_NVFP4, "recipe_changes": "weight='nvfp4'"}),
         arm("all-nvfp4", "NVFP4 recipe on every linear layer", recipe="nvfp4"),
         arm("mxfp8-floor", "MXFP8, floor scales (OCP)", recipe="mxfp8"),
         arm("mxfp8-rceil", "MXFP8, rceil scales (cuBLAS)", recipe="mxfp8-rceil")),
        (Claim("the NVFP4 recipe reaches float32", "close", "nvfp4", "fp32"),
         Claim("every layer in NVFP4 trains worse than the recipe", "better", "nvfp4", "all-nvfp4"),
         Claim("without the Hadamard transform training is worse", "better", "nvfp4", "no-hadamard"),
         Claim("gradients rounded to nearest train worse than stochastically", "better", "nvfp4",
               "nearest-grads"),
         Claim("1×16 weight blocks train worse than 16×16", "better", "nvfp4", "1x16-weights"),
         Claim("MXFP8 with floor scales trains worse than with rceil", "better", "mxfp8-rceil",
               "mxfp8-floor"),
         Claim("MXFP8 with rceil scales reaches float32", "close", "mxfp8-rceil", "fp32")),
        # every emulated GEMM rounds its operands on the CPU: as accumulation, half the width and
        # one epoch (the float32 runs are the same)
        epochs_factor=1 / 2, width_factor=0.5),
)}


# -- statistics and verdicts -----------------------------------------------------------------------

@dataclass
class ArmStats:
    losses: List[float]      # final test loss per seed (inf: diverged)
    accs: List[float]
    ratio_lo: float
    diverged: int
    seeds: Optional[List[int]] = None

    @property
    def n(self) -> int:
        return len(self.losses)

    @property
    def mean(self) -> float:
        return sum(self.losses) / self.n if self.n else math.nan

    @property
    def spread(self) -> float:
        finite = [v for v in self.losses if math.isfinite(v)]
        return max(finite) - min(finite) if len(finite) > 1 else 0.0


def arm_stats(runs: Sequence[dict]) -> ArmStats:
    losses = []
    for r in runs:
        v = r.get("final_loss")
        losses.append(math.inf if r["diverged"] or v is None or not math.isfinite(v) else float(v))
    return ArmStats(losses, [float(r["final_acc"]) for r in runs],
                    sum(r["ratio_lo"] for r in runs) / max(1, len(runs)),
                    sum(bool(r["diverged"]) for r in runs), [r["config"]["seed"] for r in runs])


def _difference(a: ArmStats, b: ArmStats) -> Tuple[float, float, bool]:
    """(a − b, noise margin, paired): per-seed differences where both arms ran the same seeds
    and neither diverged; else the difference of the means."""
    if a.seeds is not None and a.seeds == b.seeds and all(
            math.isfinite(x) and math.isfinite(y) for x, y in zip(a.losses, b.losses)):
        d = [x - y for x, y in zip(a.losses, b.losses)]
        return sum(d) / len(d), max(max(d) - min(d), NOISE_FLOOR), True
    return a.mean - b.mean, max(2 * max(a.spread, b.spread), NOISE_FLOOR), False


def verdict(claim: Claim, a: ArmStats, b: ArmStats) -> Tuple[str, str]:
    """(verdict, the numbers behind it) of ``claim`` on the two arms' statistics."""
    if a.n == 0 or b.n == 0:
        return "inconclusive", "no runs"
    d, margin, paired = _difference(a, b)  # d > 0: a ends above (worse than) b
    fmt = lambda v: f"{v:.4f}" if math.isfinite(v) else "diverged"  # noqa: E731
    said = f"{claim.a} {fmt(a.mean)} vs {claim.b} {fmt(b.mean)}"
    if paired:
        said += f" (per seed {d:+.4f} on average)"
    if math.isinf(a.mean) and math.isinf(b.mean):
        return "inconclusive", f"{said}: both diverged"
    if claim.kind == "better":
        detail = f"{said}, margin {margin:.4f}"
        if d < -margin:
            return "reproduced", detail
        if d > margin:
            return "not reproduced", detail
        return "inconclusive", detail + " (within the noise)"
    if claim.kind == "close":
        tol = max(margin, CLOSE * b.mean)
        detail = f"{said}, tolerance {tol:.4f}"
        return ("reproduced", detail) if d <= tol else ("not reproduced", detail)
    if claim.kind == "fails":
        far = max(margin, FAIL * b.mean)
        detail = f"{said}, far = {far:.4f} above"
        if d > far:
            return "reproduced", detail
        if d <= margin:
            return "not reproduced", detail
        return "inconclusive", detail + " (worse, not failed)"
    raise ValueError(f"claim kind must be better, close or fails, got {claim.kind!r}")


# -- running ---------------------------------------------------------------------------------------

def _ratio_of(cfg: train.TrainConfig) -> float:
    """The low-precision ratio cfg's assignment gives its model (traced, not trained)."""
    return float(train.initial_assignment(cfg).ratio_lo)


def plan(experiments: Sequence[str], base: train.TrainConfig, seeds: Sequence[int]
         ) -> Dict[str, Dict[str, List[train.TrainConfig]]]:
    """Per experiment, per arm, one config per seed."""
    out: Dict[str, Dict[str, List[train.TrainConfig]]] = {}
    for key in experiments:
        exp = EXPERIMENTS[key]
        b = exp.base(base)
        resolved = {}
        if any(v == "ratio_of_op" for a in exp.arms for _, v in a.changes):
            op = next(a for a in exp.arms if a.key == "op")
            resolved["ratio_of_op"] = round(_ratio_of(op.config(b, seeds[0], {})), 4)
        out[key] = {a.key: [a.config(b, s, resolved) for s in seeds] for a in exp.arms}
    return out


def run_reproduce(experiments: Sequence[str], base: train.TrainConfig, out: str, *,
                  seeds: Sequence[int] = (0, 1, 2), jobs: int = 0, fresh: bool = False,
                  log=None) -> dict:
    """Run (or resume) the experiments into ``out`` and write ``out/report.md`` with its
    figures; returns {"report": path, "verdicts": {experiment: [(claim, verdict, detail)]}}."""
    log = log or functools.partial(print, flush=True)
    t0 = time.perf_counter()
    grid = plan(experiments, base, seeds)
    configs = [c for arms in grid.values() for cs in arms.values() for c in cs]
    for c in configs:
        train.check_config(c)
    os.makedirs(out, exist_ok=True)
    labels = {config_key(asdict(c)): (e, a) for e, arms in grid.items() for a, cs in arms.items() for c in cs}

    def describe(run):
        e, a = labels.get(config_key(run["config"]), ("?", "?"))
        return (f"{e}/{a}, seed {run['config']['seed']}: test loss "
                f"{run['final_loss'] if run['final_loss'] is not None else math.nan:.4f}")
    done = run_configs([asdict(c) for c in configs], os.path.join(out, "results.json"), jobs=jobs,
                       fresh=fresh, log=log, describe=describe, name="lowfp reproduce")
    runs = {e: {a: [done[config_key(asdict(c))] for c in cs] for a, cs in arms.items()}
            for e, arms in grid.items()}
    verdicts, measured = {}, {}
    for e, arms in runs.items():
        stats = {a: arm_stats(rs) for a, rs in arms.items()}
        verdicts[e] = [(c, *verdict(c, stats[c.a], stats[c.b])) for c in EXPERIMENTS[e].claims]
        if EXPERIMENTS[e].gemm_errors:
            measured[e] = accumulation.gemm_errors()
            verdicts[e] += [(Claim(text, "measured", "", ""), v, detail)
                             for text, v, detail in accumulation.claims(measured[e])]
    path = write_report(out, base, seeds, runs, verdicts, time.perf_counter() - t0, measured)
    for e, vs in verdicts.items():
        for c, v, detail in vs:
            log(f"{e}: {c.text}: {v.upper()} ({detail})")
    log(f"report: {path}")
    return {"report": path, "verdicts": verdicts, "runs": runs}


# -- the report ------------------------------------------------------------------------------------

def _plot(path: str, title: str, exp: Experiment, arms: Dict[str, List[dict]]) -> bool:
    try:
        plt = import_optional("matplotlib.pyplot", "the report's figures")
    except ImportError:
        return False
    one_epoch = all(len(r["epochs"]) == 1 for rs in arms.values() for r in rs)
    many = one_epoch and len(exp.arms) > 5  # (the arms' names side by side need room)
    fig, ax = plt.subplots(figsize=(9.6 if many else 6.4, 4.0))
    if one_epoch:
        # one epoch: each arm's final losses side by side, one dot per seed
        for i, a in enumerate(exp.arms):
            ys = [r["epochs"][0].get("test_loss", math.nan) for r in arms[a.key]]
            ax.plot([i] * len(ys), ys, "o", color=f"C{i}", label=a.label, markersize=5, alpha=0.8)
        ax.set_xticks(range(len(exp.arms)), [a.key for a in exp.arms], rotation=20 if many else 0,
                      ha="right" if many else "center")
        ax.set_xlim(-0.5, len(exp.arms) - 0.5)
        ax.set_xlabel("arm (one dot per seed, after 1 epoch)")
    else:
        for a in exp.arms:
            rs = arms[a.key]
            epochs = min(len(r["epochs"]) for r in rs)
            xs = list(range(1, epochs + 1))
            for i, r in enumerate(rs):
                ys = [e.get("test_loss", math.nan) for e in r["epochs"][:epochs]]
                ax.plot(xs, ys, color=f"C{exp.arms.index(a)}", alpha=0.8,
                        label=a.label if i == 0 else None, marker="o", markersize=3)
        ax.xaxis.set_major_locator(import_optional("matplotlib.ticker", "the report's figures")
                                   .MaxNLocator(integer=True))
        ax.set_xlabel("epoch")
    ax.set_ylabel("test loss (cross-entropy)")
    ax.set_title(title, fontsize=9)
    if many:  # beside the dots, not over them
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# below 2^-25, half float16's smallest subnormal 2^-24, values round to zero; below its smallest
# normal 2^-14 they keep fewer significant bits
FLOAT16_ZERO, FLOAT16_NORMAL = -25, -14


def gradient_exponents(runs: Sequence[dict]) -> Optional[Tuple[int, List[int], int]]:
    """(lowest exponent, counts per binade, zeros) of the activation gradients the runs sampled
    (the last step of each epoch), summed; None for runs from before they were recorded."""
    hists = [e["gradient_exponents"] for r in runs for e in r["epochs"] if "gradient_exponents" in e]
    if not hists:
        return None
    counts = [sum(c) for c in zip(*(h["counts"] for h in hists))]
    return hists[0]["low"], counts, sum(h["zeros"] for h in hists)


def share_below(hist: Tuple[int, List[int], int], exponent: int, shift: int = 0) -> float:
    """The share of the nonzero gradients below 2^exponent once multiplied by 2^shift."""
    low, counts, _ = hist
    below = sum(c for i, c in enumerate(counts) if low + i + shift < exponent)
    return below / max(1, sum(counts))


def _final_scale_exponent(runs: Sequence[dict]) -> Optional[int]:
    scales = [r["epochs"][-1].get("loss_scale") for r in runs]
    if not scales or any(s is None or s <= 0 for s in scales):
        return None
    return min(int(math.log2(s)) for s in scales)


def _gradients_section(out: str, exp: Experiment, arms: Dict[str, List[dict]]) -> List[str]:
    """The report's paragraph and figure on the gradients of exp.gradients' arms."""
    plain, scaled = exp.gradients
    hist = gradient_exponents(arms[plain])
    if hist is None:
        return []
    shift = _final_scale_exponent(arms[scaled])
    labels = {a.key: a.label for a in exp.arms}
    low, counts, zeros = hist
    total = sum(counts) + zeros
    text = (f"Activation gradients of the {labels[plain]} runs (the loss's gradient at every "
            f"layer's output, last step of each epoch; {total} values, "
            f"{100 * zeros / max(1, total):.1f} % exactly zero): of the nonzero ones "
            f"{100 * share_below(hist, FLOAT16_ZERO):.1f} % lie below 2^{FLOAT16_ZERO}, half "
            "float16's smallest subnormal, and round to zero in float16, and "
            f"{100 * share_below(hist, FLOAT16_NORMAL):.1f} % below its smallest normal "
            f"2^{FLOAT16_NORMAL} (fewer significant bits).")
    if shift is not None:
        text += (f" Multiplied by 2^{shift}, the smallest final loss scale of the "
                 f"{labels[scaled]} runs, {100 * share_below(hist, FLOAT16_ZERO, shift):.2f} % "
                 f"remain below 2^{FLOAT16_ZERO}.")
    lines = ["", text]
    try:
        plt = import_optional("matplotlib.pyplot", "the report's figures")
    except ImportError:
        return lines
    n = max(1, sum(counts))
    xs = [low + i for i in range(len(counts))]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.bar(xs, [c / n for c in counts], width=1.0, align="edge", color="C0", alpha=0.7,
           label=labels[plain])
    if shift is not None:
        ax.step([x + shift for x in xs] + [xs[-1] + shift + 1], [c / n for c in counts] + [0],
                where="post", color="C2", label=f"× 2^{shift} (loss scale)")
    used = [x for x, c in zip(xs, counts) if c]
    left, right = used[0] - 1, used[-1] + 2 + max(0, shift or 0)
    ax.axvspan(left, FLOAT16_ZERO, color="C3", alpha=0.12, label="rounds to zero in float16")
    ax.axvline(FLOAT16_ZERO, color="C3", lw=1)
    ax.axvline(FLOAT16_NORMAL, color="C1", lw=1, ls="--", label="float16's smallest normal")
    ax.set_xlim(left, right)
    ax.set_xlabel("log2 |activation gradient|")
    ax.set_ylabel("share of nonzero values")
    ax.set_title(f"{exp.title}: gradients", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{exp.key}-gradients.png"), dpi=110)
    plt.close(fig)
    return lines + ["", f"![{exp.key} gradients]({exp.key}-gradients.png)"]


def _underflow(runs: Sequence[dict]) -> str:
    """The share of backward values (activation and weight gradients) that underflowed to zero,
    averaged over the runs' epochs ("–" for runs from before it was recorded)."""
    values = [e["backward_underflow"] for r in runs for e in r["epochs"] if "backward_underflow" in e]
    return f"{100 * sum(values) / len(values):.3f} %" if values else "–"


def write_report(out: str, base: train.TrainConfig, seeds: Sequence[int],
                 runs: Dict[str, Dict[str, List[dict]]], verdicts, seconds: float,
                 measured: Optional[Dict[str, "accumulation.GemmErrors"]] = None) -> str:
    every = {id(r): r for arms in runs.values() for rs in arms.values() for r in rs}.values()
    run_minutes = sum(r["seconds"] for r in every) / 60
    lines = ["# lowfp reproduce", "",
             f"lowfp {__version__}, Python {platform.python_version()}, {platform.machine()}, "
             f"{os.cpu_count()} CPUs; seeds {list(seeds)}; {len(every)} runs, "
             f"{run_minutes:.1f} min of training in all (this call: {seconds / 60:.1f} min). "
             "Verdicts are computed from the runs (see `lowfp.experiments.reproduce`): arms "
             "share seeds (initial weights, batch order), and a claim is *reproduced* when the "
             "mean per-seed difference shows it beyond the noise margin (the spread of those "
             f"differences, at least {NOISE_FLOOR}), *not reproduced* when it shows the "
             "opposite, *inconclusive* in between. Loss: final test cross-entropy (nats per "
             "character; lower is better).", "",
             f"Base run: {base.model} (width {base.width:g}) on {base.data}, {base.epochs} epochs "
             f"of {base.optimizer} (lr {base.lr:g}, batch {base.batch_size}).", "",
             "| paper | claim | verdict | numbers |", "|---|---|---|---|"]
    for e, vs in verdicts.items():
        for c, v, detail in vs:
            lines.append(f"| {e} | {c.text} | **{v}** | {detail} |")
    for e, arms in runs.items():
        exp = EXPERIMENTS[e]
        b = exp.base(base)
        lines += ["", f"## {exp.title}", "", f"> {exp.claim}", "",
                  f"{b.epochs} epoch(s), width {b.width:g}, batch {b.batch_size}, lr {b.lr:g}.", "",
                  "| arm | test loss per seed | mean | spread | test accuracy | low-precision ratio "
                  "| gradients lost to underflow | promotions per run |",
                  "|---|---|---|---|---|---|---|---|"]
        for a in exp.arms:
            s = arm_stats(arms[a.key])
            per = ", ".join(f"{v:.4f}" if math.isfinite(v) else "diverged" for v in s.losses)
            mean = f"{s.mean:.4f}" if math.isfinite(s.mean) else "diverged"
            acc = sum(s.accs) / max(1, len(s.accs))
            lines.append(f"| {a.label} (`{a.key}`) | {per} | {mean} | {s.spread:.4f} | {acc:.4f} | "
                         f"{s.ratio_lo:.3f} | {_underflow(arms[a.key])} | "
                         f"{sum(len(r['promotions']) for r in arms[a.key]) / max(1, s.n):g} |")
        lines += ["", "Verdicts:", ""]
        for c, v, detail in verdicts[e]:
            lines.append(f"- {c.text}: **{v}** ({detail})")
        if _plot(os.path.join(out, f"{e}.png"), exp.title, exp, arms):
            lines += ["", f"![{e}]({e}.png)"]
        if exp.gradients:
            lines += _gradients_section(out, exp, arms)
        if measured and e in measured:
            lines += accumulation.section(out, measured[e])
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


# -- command line ----------------------------------------------------------------------------------

def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="lowfp reproduce", description=description(__doc__))
    p.add_argument("experiments", nargs="*", default=["all"],
                   help=f"which: {', '.join(EXPERIMENTS)} or all (default)")
    p.add_argument("--out", default="lowfp-reproduce", help="results, report and figures")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=BASE.epochs)
    p.add_argument("--width", type=float, default=BASE.width)
    p.add_argument("--data", default=BASE.data, choices=train.datasets.DATASETS)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--model", default=None, help="default: gpt for pysource, resnet18 otherwise")
    p.add_argument("--device", default="cpu")
    p.add_argument("--jobs", type=int, default=0, help="parallel runs (0: one per CPU)")
    p.add_argument("--fresh", action="store_true", help="ignore the results already in --out")
    args = p.parse_args(argv)
    names = list(EXPERIMENTS) if args.experiments in (["all"], []) else args.experiments
    bad = [n for n in names if n not in EXPERIMENTS]
    if bad:
        print(f"lowfp reproduce: unknown experiment {bad[0]!r}; choose from {', '.join(EXPERIMENTS)} "
              "or all", file=sys.stderr)
        return 2
    if args.seeds < 1 or args.epochs < 1 or args.width <= 0:
        print("lowfp reproduce: --seeds, --epochs and --width must be positive", file=sys.stderr)
        return 2
    model = args.model or ("gpt" if args.data == "pysource" else "resnet18")
    base = replace(BASE, epochs=args.epochs, width=args.width, data=args.data,
                   data_dir=args.data_dir, model=model, device=args.device)
    try:
        run_reproduce(names, base, args.out, seeds=list(range(args.seeds)), jobs=args.jobs,
                      fresh=args.fresh)
    except ValueError as err:
        print(f"lowfp reproduce: {err}", file=sys.stderr)
        return 2
    return 0

"""``lowfp train``: train a model under a precision assignment and report accuracy, ratio_lo, the
aggregate and promotions per epoch."""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import assign
from ..emulate import emulate
from ..formats import parse_call, to_format
from ..quantize import quantize_
from ..accumulate import Accumulate
from ..scaled import ACCUMULATE_GEMMS, RECIPES, GemmRecipe, high_precision_ends
from ..scaler import DynamicLossScaler
from . import data as datasets
from . import models
from . import description

__all__ = ["TrainConfig", "check_config", "run", "add_arguments", "config_from_args", "main"]

OPTIMIZERS = ("sgd", "adamw", "extrabits-sgd", "extrabits-adamw")
GEMM_RECIPES = ("none",) + tuple(RECIPES)
ASSIGNMENTS = tuple(assign.STRATEGIES)


@dataclass
class TrainConfig:
    model: str = "resnet"
    width: float = 0.5
    data: str = "digits"
    data_dir: Optional[str] = None
    assignment: str = "ours"
    r: float = 0.5
    order: str = "decreasing"
    promote: bool = True
    threshold: float = 0.01
    hi: Optional[str] = None  # None: fp(6,9,0), or a 16-bit model's own dtype (Candidates)
    lo_forward: str = "fp(4,3,4)"
    lo_backward: str = "fp(5,2,0)"
    recipe: str = "none"
    # Changes to the recipe's fields, as keyword arguments of literals: "grad_rounding='nearest',
    # hadamard_seed=None, weight='nvfp4'" (the NVFP4 report's ablations)
    recipe_changes: str = ""
    # The last round(fraction × count) linear layers keep the model's dtype (high_precision_ends;
    # the NVFP4 report keeps about 15 % in BF16)
    high_precision: float = 0.0
    # How the GEMMs named in accumulate_gemms sum their products (docs/design.md §10): a
    # lowfp.accumulate preset or an Accumulate's text, "Accumulate('bfloat16', order='blocked',
    # block=64)"; "none": torch's float32
    accumulate: str = "none"
    accumulate_gemms: str = "fprop,dgrad,wgrad"
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    extra_bits: int = 8
    rounding: str = "nearest"
    weight_format: Optional[str] = None
    param_dtype: str = "bfloat16"  # the ExtraBits optimizers' 16-bit weights
    round_weights: Optional[str] = None  # a format the weights are rounded to after each step
    step_in_backward: bool = False
    loss_scale: str = "dynamic"
    epochs: int = 5
    batch_size: int = 64
    schedule: str = "cosine"
    seed: int = 0
    device: str = "cpu"


def check_config(cfg: TrainConfig) -> None:
    """Raise ValueError naming the first option of ``cfg`` that is not allowed."""
    if cfg.model not in models.MODELS:
        raise ValueError(f"model must be one of {tuple(models.MODELS)}, got {cfg.model!r}")
    if (cfg.data == "pysource") != (cfg.model == "gpt"):
        raise ValueError("model gpt trains on character windows (--data pysource), the others on "
                         f"images; got model {cfg.model!r} with data {cfg.data!r}")
    if cfg.assignment not in ASSIGNMENTS:
        raise ValueError(f"assignment must be one of {ASSIGNMENTS}, got {cfg.assignment!r}")
    if cfg.recipe not in GEMM_RECIPES:
        raise ValueError(f"recipe must be one of {GEMM_RECIPES}, got {cfg.recipe!r}")
    gemm_recipe(cfg)
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {cfg.optimizer!r}")
    if cfg.schedule not in ("cosine", "constant"):
        raise ValueError(f"schedule must be 'cosine' or 'constant', got {cfg.schedule!r}")
    if cfg.epochs < 1 or cfg.batch_size < 1:
        raise ValueError("epochs and batch_size must be positive")
    if cfg.round_weights is not None:
        if cfg.optimizer.startswith("extrabits"):
            raise ValueError("round_weights is for torch's optimizers (the ExtraBits ones keep "
                             "their weights on a grid already: use weight_format)")
        to_format(cfg.round_weights, "round_weights")
    if cfg.param_dtype not in ("bfloat16", "float16"):
        raise ValueError(f"param_dtype must be 'bfloat16' or 'float16', got {cfg.param_dtype!r}")
    if cfg.weight_format is not None and not cfg.optimizer.startswith("extrabits"):
        raise ValueError("weight_format needs an extrabits optimizer (--optimizer extrabits-sgd "
                         "or extrabits-adamw)")
    if cfg.step_in_backward and not cfg.optimizer.startswith("extrabits"):
        raise ValueError("step_in_backward needs an extrabits optimizer (--optimizer extrabits-sgd "
                         "or extrabits-adamw)")
    if cfg.loss_scale not in ("dynamic", "none"):
        try:
            if float(cfg.loss_scale) <= 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"loss_scale must be 'dynamic', 'none' or a positive number, "
                             f"got {cfg.loss_scale!r}") from None


def gemm_recipe(cfg: TrainConfig, model: Optional[torch.nn.Module] = None):
    """The GemmRecipe of cfg's recipe, its changes and accumulation, or None (torch's GEMMs); with
    ``high_precision`` and a model, the mapping of module patterns that keeps its last linear
    layers out of it."""
    recipe = None if cfg.recipe == "none" else RECIPES[cfg.recipe]
    if cfg.recipe_changes.strip():
        if recipe is None:
            raise ValueError("recipe_changes needs a recipe (--recipe)")
        call = parse_call(f"GemmRecipe({cfg.recipe_changes})", ("GemmRecipe",))
        if call is None or call[0]:
            raise ValueError(f"recipe_changes must be keyword arguments of GemmRecipe, as "
                             f"\"grad_rounding='nearest', hadamard_seed=None\"; got {cfg.recipe_changes!r}")
        try:
            recipe = replace(recipe, **call[1])
        except TypeError as err:  # an unknown field
            raise ValueError(f"recipe_changes: {err}") from None
    if cfg.accumulate != "none":
        gemms = [g.strip() for g in cfg.accumulate_gemms.split(",")]
        if not gemms or not set(gemms) <= set(ACCUMULATE_GEMMS):
            raise ValueError(f"accumulate_gemms must be a comma-separated subset of {ACCUMULATE_GEMMS}, "
                             f"got {cfg.accumulate_gemms!r}")
        acc = Accumulate.parse(cfg.accumulate)
        # (torch's float32 GEMM on its own is the plain run: no recipe, so that no GEMM is
        # rewritten, whose float32 sums could then differ from autograd's in their last bits)
        if recipe is not None or not acc.is_torch:
            recipe = replace(GemmRecipe() if recipe is None else recipe, accumulate={g: acc for g in gemms})
    if not isinstance(cfg.high_precision, (int, float)) or not 0 <= cfg.high_precision <= 1:
        raise ValueError(f"high_precision must be a fraction between 0 and 1, got {cfg.high_precision!r}")
    if cfg.high_precision and recipe is None:
        raise ValueError("high_precision keeps layers out of a recipe: it needs --recipe")
    if cfg.high_precision and model is not None:
        return {**high_precision_ends(model, fraction=cfg.high_precision), "*": recipe}
    return recipe


def _progress(label: str, done: int, total: int, extra: str, stream) -> None:
    width = 24
    filled = int(width * done / total)
    stream.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {extra}")
    if done == total:
        stream.write("\n")
    stream.flush()


def evaluate(model, x, y, batch_size: int) -> Tuple[float, float]:
    """(accuracy, mean cross-entropy in nats) over the test set: per image, or per character
    for windows of tokens (logits (N, T, V) against targets (N, T))."""
    model.eval()
    correct, loss, count = 0, 0.0, 0
    with torch.no_grad():
        for i in range(0, len(y), batch_size):
            out = model(x[i:i + batch_size]).float()
            target = y[i:i + batch_size]
            out, target = out.reshape(-1, out.shape[-1]), target.reshape(-1)
            correct += int((out.argmax(1) == target).sum())
            loss += float(F.cross_entropy(out, target, reduction="sum"))
            count += target.numel()
    model.train()
    return correct / max(1, count), loss / max(1, count)


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """cfg's optimizer for the float32 model. An ExtraBits optimizer converts the parameters to
    bfloat16, keeping their cut-off bits as the initial extra bits; the model's buffers
    (BatchNorm's statistics) follow with model.to, which leaves those parameters as they are."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    from ..optim import ExtraBitsAdamW, ExtraBitsSGD
    dtype = getattr(torch, cfg.param_dtype)
    if cfg.optimizer == "extrabits-sgd":
        opt = ExtraBitsSGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                           weight_decay=cfg.weight_decay, extra_bits=cfg.extra_bits,
                           rounding=cfg.rounding, weight_format=cfg.weight_format,
                           param_dtype=dtype)
    else:
        opt = ExtraBitsAdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                             extra_bits=cfg.extra_bits, rounding=cfg.rounding,
                             weight_format=cfg.weight_format, param_dtype=dtype)
    model.to(dtype)
    return opt


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per image, or per character of (N, T, V) logits."""
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))


class GradientExponents:
    """A histogram of activation-gradient magnitudes by binary exponent, as in *Mixed Precision
    Training*'s Figure 3: the gradient of the loss (divided by the loss scale) with respect to
    every leaf module's output, on the steps run inside ``watch``. ``counts[i]`` holds the
    values with 2^(LOW + i) ≤ |g| < 2^(LOW + i + 1), the first bin everything below, the last
    everything above; ``zeros`` the exact zeros."""

    LOW, HIGH = -48, 8

    def __init__(self):
        self.counts = [0] * (self.HIGH - self.LOW + 1)
        self.zeros = 0

    def as_dict(self) -> dict:
        return {"low": self.LOW, "counts": list(self.counts), "zeros": self.zeros}

    def _add(self, grad: torch.Tensor, scale: float) -> None:
        g = grad.detach().double().abs().div_(scale)  # exact: float64 holds float32 / 2^k
        nonzero = g[(g != 0) & torch.isfinite(g)]  # a skipped step's non-finite ones: neither
        self.zeros += int((g == 0).sum())
        exponent = torch.frexp(nonzero).exponent.sub_(1 + self.LOW).clamp_(0, self.HIGH - self.LOW)
        for i, c in enumerate(torch.bincount(exponent.flatten(), minlength=len(self.counts)).tolist()):
            self.counts[i] += c

    def watch(self, model: torch.nn.Module, scale: float):
        """Count the gradients of the next backward; returns the function that stops it."""
        def on_output(module, args, out):
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
                    t.register_hook(lambda g: self._add(g, scale))
        hooks = [m.register_forward_hook(on_output) for m in model.modules()
                 if next(m.children(), None) is None]
        return lambda: [h.remove() for h in hooks]


def _setup(cfg: TrainConfig):
    """(dataset, model, optimizer, (train x, y, test x, y) on the device, assignment)."""
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    ds = datasets.load(cfg.data, cfg.data_dir, seed=cfg.seed)
    model = models.build(cfg.model, ds.in_channels, ds.num_classes, cfg.width, ds.image_size).to(device)
    opt = make_optimizer(cfg, model)
    x_dtype = torch.int64 if ds.tokens else next(model.parameters()).dtype
    tensors = (ds.train_x.to(device, x_dtype), ds.train_y.to(device),
               ds.test_x.to(device, x_dtype), ds.test_y.to(device))
    bs = min(cfg.batch_size, len(tensors[1]))
    tr = assign.trace(model, tensors[0][:bs], loss_fn, tensors[1][:bs])
    cand = assign.Candidates(cfg.hi, cfg.lo_forward, cfg.lo_backward)
    kwargs = {"r": cfg.r, "order": cfg.order, "seed": cfg.seed} if cfg.assignment == "ours" else {}
    return ds, model, opt, tensors, assign.make(tr, cfg.assignment, candidates=cand, **kwargs)


def initial_assignment(cfg: TrainConfig) -> assign.Assignment:
    """The assignment cfg's run starts with (its model traced on one batch; nothing trained)."""
    check_config(cfg)
    return _setup(cfg)[-1]


def run(cfg: TrainConfig, log=None, progress=None) -> dict:
    """Train as ``cfg`` says; returns a result dict (per-epoch records, the assignment summary,
    history of the last emulation, final and best test accuracy). ``progress``: a stream for
    progress bars (None: none); ``log``: called with each message line (default: print, flushed
    at once so that piped output keeps up)."""
    check_config(cfg)
    log = log or functools.partial(print, flush=True)
    ds, model, opt, (tx, ty, vx, vy), assignment = _setup(cfg)
    device = torch.device(cfg.device)
    n = len(ty)
    bs = min(cfg.batch_size, n)

    steps_per_epoch = math.ceil(n / bs)
    total_steps = cfg.epochs * steps_per_epoch
    sched = None
    if cfg.schedule == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total_steps)

    log(f"lowfp train: {cfg.model} (width {cfg.width}) on {ds}, {assignment.name}: "
        f"ratio_lo {assignment.ratio_lo:.3f}, aggregate {assignment.aggregate_bits / 8 / 2**20:.2f} MiB, "
        + ("" if cfg.recipe == "none" else f"GEMM operands {cfg.recipe}"
           + (f" ({cfg.recipe_changes})" if cfg.recipe_changes else "")
           + (f", the last {cfg.high_precision:.0%} of linear layers unrounded" if cfg.high_precision else "")
           + ", ")
        + ("" if cfg.accumulate == "none" else f"{cfg.accumulate_gemms} GEMMs summed as {cfg.accumulate}, ")
        + f"optimizer {cfg.optimizer}, {cfg.epochs} epochs of {steps_per_epoch} steps")
    epochs: List[dict] = []
    gen = torch.Generator().manual_seed(cfg.seed)
    diverged = False
    with emulate(model, assignment, promote=cfg.promote, threshold=cfg.threshold,
                 rounding="nearest", gemm_recipe=gemm_recipe(cfg, model)) as em:
        scaler = None
        if cfg.loss_scale != "none":
            init = 2.0 ** 16 if cfg.loss_scale == "dynamic" else float(cfg.loss_scale)
            growth = 2000 if cfg.loss_scale == "dynamic" else 10 ** 9
            scaler = DynamicLossScaler(device, init_scale=init, growth_interval=growth, emulator=em)
        handle = None
        if cfg.step_in_backward:
            from ..optim import step_in_backward
            handle = step_in_backward(opt, scaler=scaler)
        for epoch in range(1, cfg.epochs + 1):
            t0 = time.perf_counter()
            grads = GradientExponents()
            perm = torch.randperm(n, generator=gen).to(device)
            total_loss, seen = 0.0, 0
            for i in range(steps_per_epoch):
                idx = perm[i * bs:(i + 1) * bs]
                # the last step of each epoch also counts its activation gradients
                stop = (grads.watch(model, 1.0 if scaler is None else scaler.get_scale())
                         if i == steps_per_epoch - 1 else None)
                loss = loss_fn(model(tx[idx]), ty[idx])
                if handle is None:
                    opt.zero_grad(set_to_none=True)
                scaled = scaler.scale(loss) if scaler is not None else loss
                scaled.backward()
                if stop is not None:
                    stop()
                if handle is None:
                    if scaler is not None:
                        scaler.step(opt)
                    else:
                        opt.step()
                if scaler is not None:
                    scaler.update()
                if cfg.round_weights is not None:  # no float32 master: the rounded weights stay
                    with torch.no_grad():
                        for p in model.parameters():
                            quantize_(p, cfg.round_weights)
                if sched is not None:
                    with warnings.catch_warnings():  # skipped steps / step-in-backward never call opt.step
                        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                        sched.step()
                value = loss.item()
                em.record(loss=value)
                em.end_step()  # loss.item() waited for the device: read the counts now, no lag
                total_loss += value * len(idx)
                seen += len(idx)
                if progress is not None:
                    _progress(f"epoch {epoch}/{cfg.epochs}", i + 1, steps_per_epoch,
                              f"loss {total_loss / seen:.4f}", progress)
            train_loss = total_loss / seen
            acc, test_loss = evaluate(model, vx, vy, 512)
            last_step = epochs[-1]["step"] if epochs else 0
            promotions = [p for p in em.history.promotions if p["step"] > last_step]
            underflow = [h["backward_underflow"] for h in em.history.steps if h["step"] > last_step]
            rec = {"epoch": epoch, "train_loss": train_loss, "test_acc": acc, "test_loss": test_loss,
                   "ratio_lo": em.assignment.ratio_lo, "aggregate_bits": em.assignment.aggregate_bits,
                   "promotions": len(promotions), "loss_scale": None if scaler is None else scaler.get_scale(),
                   "backward_underflow": sum(underflow) / max(1, len(underflow)),
                   "gradient_exponents": grads.as_dict(),
                   "seconds": time.perf_counter() - t0, "step": em.step}
            epochs.append(rec)
            log(f"epoch {epoch}: train loss {train_loss:.4f}, test loss {test_loss:.4f}, test acc {acc:.4f}, ratio_lo "
                f"{rec['ratio_lo']:.3f}, aggregate {rec['aggregate_bits'] / 8 / 2**20:.2f} MiB, "
                f"promotions {len(promotions)}" + ("" if scaler is None else f", loss scale {rec['loss_scale']:g}")
                + f" ({rec['seconds']:.1f} s)")
            if not math.isfinite(train_loss):
                diverged = True
                log("training diverged (non-finite loss); stopping")
                break
        if handle is not None:
            handle.remove()
    accs = [e["test_acc"] for e in epochs]
    return {"config": asdict(cfg), "assignment": assignment.name,
            "initial_ratio_lo": assignment.ratio_lo, "initial_aggregate_bits": assignment.aggregate_bits,
            "ratio_lo": em.assignment.ratio_lo, "aggregate_bits": em.assignment.aggregate_bits,
            "final_acc": accs[-1], "best_acc": max(accs), "diverged": diverged,
            "final_loss": epochs[-1]["test_loss"],
            "promotions": em.history.promotions, "epochs": epochs,
            "history": em.history.to_dict()}


def add_arguments(p: argparse.ArgumentParser, skip: Tuple[str, ...] = ()) -> None:
    """The options of ``TrainConfig`` on ``p``, less the fields named in ``skip`` (``lowfp sweep``
    sets those itself)."""
    d = TrainConfig()

    def add(*args, **kwargs):
        dest = kwargs.get("dest") or args[0].lstrip("-").replace("-", "_")
        if dest not in skip:
            p.add_argument(*args, **kwargs)

    add("--model", default=d.model, choices=tuple(models.MODELS))
    add("--width", type=float, default=d.width, help="width multiplier")
    add("--data", default=d.data, choices=datasets.DATASETS)
    add("--data-dir", default=None, help="folder with the CIFAR python-version files")
    add("--assignment", default=d.assignment, choices=ASSIGNMENTS)
    add("--r", type=float, default=d.r, help="low-precision ratio for --assignment ours")
    add("--order", default=d.order, choices=assign.ORDERS)
    add("--no-promotion", dest="promote", action="store_false")
    add("--threshold", type=float, default=d.threshold, help="promotion threshold Θ")
    add("--hi", default=d.hi,
        help="the hi candidate (default: fp(6,9,0), or a bfloat16/float16 model's own format)")
    add("--lo-forward", default=d.lo_forward)
    add("--lo-backward", default=d.lo_backward)
    add("--recipe", default=d.recipe, choices=GEMM_RECIPES,
        help="scaled formats for the operands of linear layers and matrix products "
             "(lowfp.scaled.emulate_gemms)")
    add("--recipe-changes", default=d.recipe_changes,
        help="changes to the recipe's fields, keyword arguments of literals: "
             "\"grad_rounding='nearest', hadamard_seed=None, weight='nvfp4'\"")
    add("--high-precision", type=float, default=d.high_precision,
        help="keep the last fraction of the linear layers out of the recipe (the NVFP4 report: 0.15)")
    add("--accumulate", default=d.accumulate,
        help="how the GEMMs of --accumulate-gemms sum their products (lowfp.Accumulate): a preset "
             "(hopper-fp8, deepseek-v3) or \"Accumulate('bfloat16', order='blocked', block=64)\"; "
             "none: torch's float32")
    add("--accumulate-gemms", default=d.accumulate_gemms,
        help="which GEMMs --accumulate applies to: fprop, dgrad, wgrad, comma-separated")
    add("--optimizer", default=d.optimizer, choices=OPTIMIZERS)
    add("--lr", type=float, default=d.lr)
    add("--momentum", type=float, default=d.momentum)
    add("--weight-decay", type=float, default=d.weight_decay)
    add("--extra-bits", type=int, default=d.extra_bits)
    add("--rounding", default=d.rounding, choices=("toward_zero", "nearest", "stochastic"),
        help="extra-bits rounding of the ExtraBits optimizers")
    add("--weight-format", default=None,
        help="keep the ExtraBits optimizers' weights on this format's grid (e.g. float8_e5m2)")
    add("--param-dtype", default=d.param_dtype, choices=("bfloat16", "float16"),
        help="the ExtraBits optimizers' 16-bit weights")
    add("--round-weights", default=None,
        help="round the weights to this format after every step of torch's optimizer: weights "
             "without a float32 master (e.g. float16)")
    add("--step-in-backward", action="store_true")
    add("--loss-scale", default=d.loss_scale, help="'dynamic', 'none' or a fixed scale")
    add("--epochs", type=int, default=d.epochs)
    add("--batch-size", type=int, default=d.batch_size)
    add("--schedule", default=d.schedule, choices=("cosine", "constant"))
    add("--seed", type=int, default=d.seed)
    add("--device", default=d.device)


def config_from_args(args, **fixed) -> TrainConfig:
    """A TrainConfig from parsed options; ``fixed`` gives the fields the parser skipped."""
    names = [k for k in TrainConfig.__dataclass_fields__ if k not in fixed]
    return TrainConfig(**{k: getattr(args, k) for k in names}, **fixed)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="lowfp train", description=description(__doc__))
    add_arguments(p)
    p.add_argument("--json", help="write the result here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    try:
        cfg = config_from_args(args)
        result = run(cfg, progress=None if args.quiet else sys.stderr)
    except ValueError as err:
        print(f"lowfp train: {err}", file=sys.stderr)
        return 2
    print(f"best test accuracy {result['best_acc']:.4f}, final {result['final_acc']:.4f}, "
          f"ratio_lo {result['ratio_lo']:.3f}, promotions {len(result['promotions'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0

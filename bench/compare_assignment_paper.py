"""lowfp's `op` and `ours(r)` against the precision-assignment paper's released code, on the
authors' own unmodified CIFAR model files (docs/design.md §6).

    python bench/compare_assignment_paper.py --repo PATH [--batch 256 128] [--models res18 ...]

PATH is a checkout of the paper's code (wonyeol/mixed-prec-train); nothing of it is copied here.
For each model this runs their setup functions (train_ext3/pytorch_cifar/main.py: set_args,
set_model, set_more, set_pasn) on the CPU with their options for pi_op (`--pa-upd-schm std
--pa-upd-no-end`) and pi_ours (`--pa-upd-schm topr_dec --pa-upd-args r 1.0`), and reads their
low-precision element count and total from their bit counts: with hi fp(6,9,0) (16 bits) and
lo 8 bits, total = all_bits / 16 and low = (all_bits - assigned_bits) / 8. lowfp traces a fresh
instance of the same model class (their ext3.nn modules are torch modules) at the same batch
size and counts its lo tensors. Their code loads torchvision only for data, which this script
does not use: a stand-in module takes its place; and it rounds in a CUDA extension, which counts
do not need: their tensors pass unrounded. Prints one table row per (model, batch,
strategy).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import contextlib
import io
import multiprocessing
import os
import sys
import types

import torch
import torch.nn.functional as F

from lowfp import assign

MODELS = {"res18": "ResNet18", "mblv2": "MobileNetV2", "shfv2": "ShuffleNetV2", "sqz": "SqueezeNet"}
HI_LO = ["--pa-def-dt", "FP_6_9_0", "FP_6_9_0", "--pa-upd-dts", "FP_4_3_4", "FP_4_3_4", "FP_5_2_0",
         "FP_6_9_0"]


def _their_main(repo: str):
    """Their main module (its functions; the file ends by calling main(), which trains: that
    one statement is left out), with a stand-in torchvision (its datasets go unused)."""
    name = "train_ext3.pytorch_cifar.main"
    if name in sys.modules:
        return sys.modules[name]
    if repo not in sys.path:
        sys.path.insert(0, repo)
    stub = types.ModuleType("torchvision")
    stub.transforms = types.ModuleType("torchvision.transforms")
    stub.datasets = types.ModuleType("torchvision.datasets")
    sys.modules.setdefault("torchvision", stub)
    sys.modules.setdefault("torchvision.transforms", stub.transforms)
    import train_ext3.pytorch_cifar  # noqa: F401  (the package of its relative imports)
    path = os.path.join(repo, "train_ext3", "pytorch_cifar", "main.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    tree.body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
                                              and getattr(n.value.func, "id", None) == "main")]
    # Their rounding runs in their CUDA extension only; element counts do not depend on values,
    # so on the CPU their tensors pass unrounded.
    import ext3
    ext3.core.include.dtype.Dtype.round_dtype = staticmethod(lambda t, *args, **kwargs: t)
    module = types.ModuleType(name)
    module.__file__, module.__package__ = path, "train_ext3.pytorch_cifar"
    sys.modules[name] = module
    exec(compile(tree, path, "exec"), module.__dict__)
    return module


def their_counts(repo: str, model: str, batch: int, scheme: list) -> tuple:
    """(low elements, all elements) of their assignment for ``model`` at ``batch``, in a process
    of its own (their registry of modules keeps every model a process built)."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(_their_counts, repo, model, batch, scheme).result()


def _their_counts(repo: str, model: str, batch: int, scheme: list) -> tuple:
    main = _their_main(repo)
    import ext3
    cwd = os.getcwd()
    os.chdir(os.path.join(os.environ.get("TMPDIR", "/tmp")))  # their logs go to ./res
    try:
        sys.argv = ["main", "--model", model, "--data", "cifar10", "--cuda", "-2", "--bs-tr",
                    str(batch), "--quiet", "--logg-uid", f"lowfp-{model}-{batch}", *HI_LO, *scheme]
        with contextlib.redirect_stdout(io.StringIO()):
            main.set_args()
            main.args.data_num_classes = 10
            torch.manual_seed(0)
            main.data_sngl = [[torch.randn(1, 3, 32, 32), torch.tensor([3])]]
            main.set_model()
            main.set_more()
            main.set_pasn()
        all_bits = main.args.pa_upd_stat["all_bit_num"]
        assigned = ext3.core.EModlObjMgr.get_numbit(None)
        return (all_bits - assigned) // 8, all_bits // 16
    finally:
        os.chdir(cwd)


def lowfp_counts(repo: str, model: str, batch: int, strategy: str, r: float) -> tuple:
    main = _their_main(repo)
    torch.manual_seed(0)
    net = getattr(main, MODELS[model])(1.0, num_classes=10)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    tr = assign.trace(net, x, F.cross_entropy, y)
    a = assign.op(tr) if strategy == "op" else assign.ours(tr, r)
    return sum(tr.tensors[n].numel for n in a.lo), tr.total_numel


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", required=True, help="a checkout of wonyeol/mixed-prec-train")
    p.add_argument("--batch", type=int, nargs="+", default=[256, 128])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--r", type=float, nargs="+", default=[0.4, 0.5, 0.7])
    args = p.parse_args(argv)
    print("| model | batch | strategy | their low | their all | their ratio | lowfp low | lowfp all "
          "| lowfp ratio | all: theirs − lowfp − input gradient |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for batch in args.batch:
            cases = [("op", None, ["--pa-upd-schm", "std", "--pa-upd-no-end"])]
            cases += [(f"ours({r})", r, ["--pa-upd-schm", "topr_dec", "--pa-upd-args", str(r), "1.0"])
                      for r in args.r]
            for name, r, scheme in cases:
                tl, ta = their_counts(args.repo, model, batch, scheme)
                ll, la = lowfp_counts(args.repo, model, batch, "op" if r is None else "ours", r)
                print(f"| {model} | {batch} | {name} | {tl:,} | {ta:,} | {tl / ta:.4f} | {ll:,} | {la:,} "
                      f"| {ll / la:.4f} | {ta - la - batch * 3 * 32 * 32:,} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``lowfp`` command line: ``lowfp formats [FMT ...]``, ``lowfp bench [...]``,
``lowfp train [...]``, ``lowfp sweep [...]``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from .formats import ASSIGNMENT_PAPER_FORMATS, Format, named
from .scaled import RECIPES, Scaled
from .scaled import named as named_scaled


def _fmt_num(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.6g}"


def formats_table(items) -> str:
    head = ("format", "e", "m", "b", "bias", "specials", "subnormals", "overflow", "max",
            "min normal", "min subnormal", "eps", "range")
    rows = [head]
    for label, f in items:
        rows.append((label, str(f.e), str(f.m), str(f.b), str(f.bias), f.specials,
                     "yes" if f.subnormals else "no", f.overflow, _fmt_num(f.max),
                     _fmt_num(f.min_normal), _fmt_num(f.min_subnormal), _fmt_num(f.eps),
                     f"{f.range_binades:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out = []
    for n, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) if i in (0, 5, 6, 7) else c.rjust(w)
                             for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out) + "\n(range: log2(max / smallest positive value), in binades)"


def _left_table(head, rows, note: str) -> str:
    """A table of left-justified columns under ``head``, a rule, and ``note`` below."""
    rows = [head] + rows
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out = []
    for n, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out) + "\n" + note


def scaled_table(items) -> str:
    head = ("scaled format", "element", "block", "axis", "scale", "rule", "tensor scale", "bits")
    rows = [(label, str(f.element), "-" if f.block is None else str(f.block),
             "tensor" if f.axis is None else str(f.axis), str(f.scale),
             f.scale_rule if f.four_over_six is None else f"4over6 ({f.four_over_six})",
             "yes" if f.tensor_scale else "no", f"{f.bits:.4g}") for label, f in items]
    return _left_table(head, rows, "(bits: per element, a block's scale shared out; docs/design.md §9)")


def recipes_table(items) -> str:
    head = ("GEMM recipe", "input", "weight", "grad", "grad rounding", "Hadamard", "GEMMs")
    rows = [(label, str(r.input), str(r.weight), str(r.grad), r.grad_rounding,
             "-" if r.hadamard_seed is None else f"seed {r.hadamard_seed}, {','.join(r.hadamard_gemms)}",
             ",".join(r.ops))
            for label, r in items]
    return _left_table(head, rows, "(the operand formats of each GEMM: lowfp.scaled.emulate_gemms("
                                   "model, recipe), lowfp train --recipe; docs/design.md §9)")


def cmd_formats(args) -> int:
    if args.format:
        items, scaled, recipes = [], [], []
        for text in args.format:
            try:
                name = text.strip()
                if name in RECIPES:  # (nvfp4 names a scaled format and a recipe)
                    recipes.append((name, RECIPES[name]))
                if name in named_scaled() or name.startswith("Scaled("):
                    scaled.append((text, Scaled.parse(text)))
                elif name not in RECIPES:
                    items.append((text, Format.parse(text)))
            except (ValueError, TypeError) as err:
                print(f"lowfp formats: {err}", file=sys.stderr)
                return 2
    else:
        items = list(named().items()) + list(ASSIGNMENT_PAPER_FORMATS.items())
        scaled = list(named_scaled().items())
        recipes = list(RECIPES.items())
    tables = ([formats_table(items)] if items else []) + ([scaled_table(scaled)] if scaled else []) + \
        ([recipes_table(recipes)] if recipes else [])
    print("\n\n".join(tables))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # the reader went away (lowfp formats | head): no traceback
        # Python flushes stdout again at exit; point it at /dev/null so that flush is silent.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="lowfp", description="Emulated low-precision floating point.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_formats = sub.add_parser("formats", help="print the named formats and GEMM recipes, or the ones given")
    p_formats.add_argument("format", nargs="*",
                           help="e.g. 'fp(4,3,4)', float8_e4m3fn, mxfp8_e4m3 or a GEMM recipe (mxfp8)")
    sub.add_parser("bench", help="benchmark quantize (lowfp bench --help)", add_help=False)
    sub.add_parser("train", help="train a model under a precision assignment (lowfp train --help)",
                   add_help=False)
    sub.add_parser("sweep", help="the memory-accuracy trade-off of the assignments (lowfp sweep --help)",
                   add_help=False)
    sub.add_parser("reproduce", help="the papers' comparisons in miniature, with a report "
                   "(lowfp reproduce --help)", add_help=False)
    if argv and argv[0] == "bench":  # the benchmark parses its own options
        from .experiments import bench
        return bench.main(argv[1:], default_size=1 << 22)
    if argv and argv[0] == "train":
        from .experiments import train
        return train.main(argv[1:])
    if argv and argv[0] == "sweep":
        from .experiments import sweep
        return sweep.main(argv[1:])
    if argv and argv[0] == "reproduce":
        from .experiments import reproduce
        return reproduce.main(argv[1:])
    args = parser.parse_args(argv)
    return cmd_formats(args)


if __name__ == "__main__":
    sys.exit(main())

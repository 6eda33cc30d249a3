"""The package's shape: the library never loads the experiments or their dependencies, its
modules import each other without cycles (lazy imports inside functions included; imports for
type checkers alone are not imports), and the named contract with the extension modules holds."""

import ast
import os
import subprocess
import sys

import pytest
import torch

import lowfp

PACKAGE_DIR = os.path.dirname(lowfp.__file__)


def test_import_lowfp_loads_no_experiment_and_no_plotting_or_sklearn():
    code = ("import sys, lowfp, lowfp.optim, lowfp.assign, lowfp.emulate, lowfp.scaler; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'sklearn') "
            "or m.startswith('lowfp.experiments')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_library_works_without_matplotlib_and_scikit_learn():
    """With both made unimportable, the library imports and rounds; what needs them says how to
    install them."""
    code = ("import sys; sys.modules['matplotlib'] = None; sys.modules['sklearn'] = None\n"
            "import torch, lowfp\n"
            "print(lowfp.quantize(torch.tensor([3.3]), 'fp(4,3,4)').item())\n"
            "from lowfp.experiments import data\n"
            "try:\n    data.load('digits')\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    first, second = out.stdout.strip().splitlines()
    assert first == "3.25"
    assert "scikit-learn" in second or "sklearn" in second
    assert "pip install 'lowfp[experiments]'" in second


def module_imports():
    """{module: set of lowfp modules it imports anywhere in its source}."""
    graph = {}
    for root, _, files in os.walk(PACKAGE_DIR):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(root, f)
            rel = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[:-3].replace(os.sep, ".")
            name = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
            package = name if f == "__init__.py" else name.rsplit(".", 1)[0]
            deps = set()
            tree = ast.parse(open(path).read())
            typing_only = {id(n) for block in ast.walk(tree)  # `if TYPE_CHECKING:` never runs
                           if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
                           for n in ast.walk(block)}
            for node in ast.walk(tree):
                if id(node) in typing_only:
                    continue
                if isinstance(node, ast.ImportFrom):
                    base = package
                    for _ in range(node.level - 1):
                        base = base.rsplit(".", 1)[0]
                    mod = (base + "." + node.module if node.module else base) if node.level else node.module
                    targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                else:
                    continue
                deps.update(t for t in targets if t and t.startswith("lowfp"))
            graph[name] = deps
    known = set(graph)
    return {m: {d for d in deps if d in known and d != m} for m, deps in graph.items()}


def imports_from_outside(package: str):
    """(file, module, name) for each name a module of ``package`` imports from a lowfp module
    outside ``package`` (``module`` as written, dots and all)."""
    found = []
    top = os.path.join(os.path.dirname(PACKAGE_DIR), *package.split("."))
    for root, _, files in os.walk(top):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, ast.ImportFrom) and (
                            node.level > 1 or (node.level == 0 and node.module.startswith("lowfp"))):
                        module = "." * node.level + (node.module or "")
                        found += [(f, module, alias.name) for alias in node.names]
    return found


def test_the_experiments_import_only_public_names():
    private = [(f, m, name) for f, m, name in imports_from_outside("lowfp.experiments")
               if (name.startswith("_") and not name.startswith("__"))  # (__version__ is public)
               or any(part.startswith("_") for part in m.split("."))]
    assert private == []


def test_the_optimizers_import_no_private_name():
    # (they may use the library's internal toolkits, lowfp._native and its kin, by their
    # public names)
    private = [(f, m, name) for f, m, name in imports_from_outside("lowfp.optim") if name.startswith("_")]
    assert private == []


def test_the_optimizer_base_and_stepping_in_backward_do_not_import_each_other():
    graph = module_imports()
    assert "lowfp.optim.step_in_backward" not in graph["lowfp.optim.base"]
    assert "lowfp.optim.base" not in graph["lowfp.optim.step_in_backward"]


def test_library_modules_do_not_import_the_experiments():
    graph = module_imports()
    for m, deps in graph.items():
        if not m.startswith("lowfp.experiments") and m != "lowfp.cli":
            assert not any(d.startswith("lowfp.experiments") for d in deps), (m, deps)


def test_no_import_cycles():
    """Package __init__ files re-export their modules and are left out of the walk."""
    graph = module_imports()
    inits = {m for m in graph if os.path.exists(os.path.join(
        os.path.dirname(PACKAGE_DIR), *m.split("."), "__init__.py"))}
    graph = {m: deps - inits for m, deps in graph.items() if m not in inits}
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in graph.get(m, ()):
            if state.get(d) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_python_codes_equal_the_extensions():
    """The codes Python passes (position in its tuples, its dicts) are the extension modules'
    enum values of the same names."""
    from lowfp import _C, _native, backends
    from lowfp.formats import SPECIALS
    from lowfp.scaled.config import E8M0_RULES
    assert E8M0_RULES == ("floor", "ceil", "rceil", "even")  # (as lowfp.Scaled documents them)
    modules = [_C] + ([backends._C_cuda] if lowfp.cuda_built() else [])
    for mod in modules:
        def codes(enum):
            return {name: int(value) for name, value in enum.__members__.items()}
        assert codes(mod.Rounding) == {n: i for i, n in enumerate(_native.ROUNDING_MODES)}
        assert codes(mod.Specials) == {n: i for i, n in enumerate(SPECIALS)}
        assert codes(mod.Overflow) == _native.OVERFLOW_CODES
        assert codes(mod.DType) == {str(d).removeprefix("torch."): c for d, c in _native.DTYPE_CODES.items()}
        # the scale rules by name only: Python passes the member (lowfp.scaled.quantize.prepared)
        # and takes the e8m0 rules' names from the contract
        assert set(mod.ScaleRule.__members__) == set(E8M0_RULES) | {"nearest"}
        assert mod.SCALED_MAX_ELEMENT_MANTISSA == 19  # (docs/design.md §9)
        # every member documents its semantics
        for enum in (mod.Rounding, mod.Specials, mod.Overflow, mod.DType, mod.ScaleRule):
            for name in enum.__members__:
                assert f"{name} : " in enum.__doc__, (enum, name)


def test_the_scaled_request_is_built_by_keyword():
    """The native scaled request takes named members of the contract's enums by keyword only,
    refuses an inconsistent scale rule and format, and rounds as lowfp.quantize does."""
    from lowfp import _C
    e4m3 = _C.FormatSpec(e=4, m=3, b=0, specials=_C.Specials.fn, subnormals=True)
    with pytest.raises(TypeError):
        _C.FormatSpec(4, 3, 0, _C.Specials.fn, True)
    kw = dict(element=e4m3, overflow=_C.Overflow.saturate, rounding=_C.Rounding.nearest,
              sr_bits=32, scale_rule=_C.ScaleRule.floor, scale_format=None, tensor_scale=False,
              choice=_C.BlockChoice.fixed, dtype=_C.DType.float32)
    request = _C.PreparedScaled(**kw)
    with pytest.raises(TypeError):
        _C.PreparedScaled(*kw.values())
    with pytest.raises(ValueError, match="scale_format"):
        _C.PreparedScaled(**{**kw, "scale_format": e4m3})
    with pytest.raises(ValueError, match="scale_format"):
        _C.PreparedScaled(**{**kw, "scale_rule": _C.ScaleRule.nearest})
    with pytest.raises(ValueError, match="sr_bits"):
        _C.PreparedScaled(**{**kw, "sr_bits": 0})
    with pytest.raises(ValueError, match="tensor scale"):
        _C.PreparedScaled(**{**kw, "tensor_scale": True})
    with pytest.raises(ValueError, match="4over6 takes FP4 E2M1 elements"):  # (E4M3 elements here)
        _C.PreparedScaled(**{**kw, "scale_rule": _C.ScaleRule.nearest, "scale_format": e4m3,
                             "tensor_scale": True, "choice": _C.BlockChoice.four_over_six_mse})
    x = torch.randn(2, 64) * 100
    y = torch.empty_like(x)
    scales = torch.empty(5, dtype=torch.float64)  # 2 x 2 blocks, then the tensor scale
    counts = torch.zeros(6, dtype=torch.int64)
    for rows, block_rows, bad_run in ((2, 1, -4), (2, 1, 6), (2, 1, 4), (16, 8, 4)):
        # (4: not a divisor of the 2 rows; of 16 rows, but runs of 4 cut blocks of 8)
        with pytest.raises(ValueError, match="word_run"):
            request(x.data_ptr(), y.data_ptr(), rows, 8, block_rows, 32, bad_run, 0, 0,
                    scales.data_ptr(), 0, scales.data_ptr() + 32, counts.data_ptr(), 6, -1, 0)
    request(x.data_ptr(), y.data_ptr(), 2, 64, 1, 32, 0, 0, 0, scales.data_ptr(), 0,
            scales.data_ptr() + 32, counts.data_ptr(), 6, -1, 0)
    stats = lowfp.scaled.ScaledStats()
    parts = lowfp.scaled.encode(x, "mxfp8_e4m3", stats=stats)
    assert torch.equal(y, parts.value) and torch.equal(scales[:4], parts.scales.flatten())
    assert torch.equal(counts, stats.counts) and stats.blocks == 4
    four = torch.zeros(5, dtype=torch.int64)  # a Stats' four counts: nothing written past them
    request(x.data_ptr(), y.data_ptr(), 2, 64, 1, 32, 0, 0, 0, scales.data_ptr(), 0,
            scales.data_ptr() + 32, four.data_ptr(), 4, -1, 0)
    assert four.tolist() == stats.counts[:4].tolist() + [0]
    with pytest.raises(ValueError, match="4 or 6 counts"):
        request(x.data_ptr(), y.data_ptr(), 2, 64, 1, 32, 0, 0, 0, scales.data_ptr(), 0,
                scales.data_ptr() + 32, four.data_ptr(), 5, -1, 0)
    with pytest.raises(ValueError, match="scales buffer"):
        request(x.data_ptr(), y.data_ptr(), 2, 64, 1, 32, 0, 0, 0, 0, 0, scales.data_ptr(), 0, 0,
                -1, 0)
    with pytest.raises(ValueError, match="block"):
        request(x.data_ptr(), y.data_ptr(), 2, 64, 1, 0, 0, 0, 0, scales.data_ptr(), 0,
                scales.data_ptr() + 32, 0, 0, -1, 0)


def test_the_cpu_kernel_level_is_public():
    """Experiments and benchmarks report the kernels' instruction set through the public API."""
    from lowfp import _C
    assert lowfp.cpu_kernel() in ("avx512", "avx2", "baseline")
    assert lowfp.cpu_kernel() == _C.cpu_kernel() and "cpu_kernel" in lowfp.__all__

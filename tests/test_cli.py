"""The lowfp command line: ``lowfp.cli.main`` in this process (an interpreter start per command
would add seconds each), and once as `python -m lowfp`, the entry point itself."""

import contextlib
import io
import json
import subprocess
import sys
from types import SimpleNamespace

import lowfp
from lowfp import cli


def run(*args):
    """``lowfp *args``: its exit status and what it wrote (argparse's --help and errors exit)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_formats_table_lists_named_and_seed_formats():
    r = run("formats")
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    for name in list(lowfp.formats.named()) + ["fp(4,3,4)", "fp(5,2,0)", "fp(6,9,0)"]:
        assert any(line.startswith(name + " ") for line in lines), name
    row = next(line for line in lines if line.startswith("fp(4,3,4) "))
    assert row.split()[8] == "30"  # max
    row = next(line for line in lines if line.startswith("fp(5,2,0) "))
    assert row.split()[8] == "114688"


def test_formats_table_lists_the_scaled_formats():
    r = run("formats")
    lines = r.stdout.splitlines()
    for name in lowfp.scaled.named():
        assert any(line.startswith(name + " ") for line in lines), name
    row = next(line for line in lines if line.startswith("nvfp4 "))
    assert row.split()[1:] == ["float4_e2m1fn", "16", "-1", "float8_e4m3fn", "nearest", "yes", "4.5"]
    r = run("formats", "Scaled('fp(4,3,4)', block=8)", "float8_e5m2")
    assert r.returncode == 0 and "fp(4,3,4)" in r.stdout and "float8_e5m2 " in r.stdout


def test_formats_one_and_bad():
    r = run("formats", "fp(4,3,4)", "float8_e5m2")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 5
    r = run("formats", "fp(4,x)")
    assert r.returncode == 2 and "cannot parse" in r.stderr


def test_bench_writes_json(tmp_path):
    out = tmp_path / "b.json"
    r = run("bench", "--size", "4096", "--repeats", "1", "--device", "cpu", "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())["cpu"]
    labels = {row["label"] for row in data["rows"]}
    assert "y.copy_(x)" in labels and "float8_e4m3fn stochastic out=" in labels
    assert "float64 y.copy_(x)" in labels and "float64 bfloat16 nearest out=" in labels
    assert all(row["elements_per_s"] > 0 for row in data["rows"])
    assert len(data["summary"]) == 5
    assert run("bench", "--size", "0").returncode == 2


def test_formats_lists_the_gemm_recipes_and_names_one():
    r = run("formats")
    lines = r.stdout.splitlines()
    for name in lowfp.scaled.RECIPES:
        assert any(line.startswith(name + " ") for line in lines), name
    r = run("formats", "mxfp8", "nvfp4")  # nvfp4: a scaled format and a recipe, both shown
    assert r.returncode == 0
    rows = [line.split() for line in r.stdout.splitlines()]
    assert ["mxfp8", "mxfp8_e4m3", "mxfp8_e4m3", "mxfp8_e4m3", "nearest", "-"] in [row[:6] for row in rows]
    assert sum(row[:1] == ["nvfp4"] for row in rows) == 2


def test_an_unknown_name_points_at_the_scaled_formats_and_recipes():
    import pytest
    import torch
    with pytest.raises(ValueError, match=r"'mxfp8_e4m3'.*'mxfp8' is a GEMM recipe.*emulate_gemms"):
        lowfp.quantize(torch.ones(4), "mxfp8")
    r = run("formats", "mxfp9")
    assert r.returncode == 2 and "mxfp8_e4m3" in r.stderr and "GEMM recipe" not in r.stderr


def test_a_closed_pipe_ends_quietly():
    # `lowfp formats | head`: the reader leaves before the table is written
    p = subprocess.Popen([sys.executable, "-m", "lowfp", "formats"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    p.wait()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_help_describes_each_command_in_full():
    for command, tail in (("train", "promotions per epoch."), ("reproduce", "computed from the runs."),
                          ("sweep", "memory–accuracy trade-off.")):
        r = run(command, "--help")
        assert r.returncode == 0 and tail in " ".join(r.stdout.split()), (command, r.stdout[:600])

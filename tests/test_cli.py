"""The lowfp command line (run as `python -m lowfp` so the test needs no PATH entry)."""

import json
import subprocess
import sys

import lowfp


def run(*args):
    return subprocess.run([sys.executable, "-m", "lowfp", *args], capture_output=True, text=True)


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

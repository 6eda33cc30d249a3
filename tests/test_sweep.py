"""``lowfp sweep`` end to end with tiny settings: the grid, the files it writes, resuming."""

import csv
import json

import pytest

from lowfp import assign as A
from lowfp import cli
from lowfp.experiments import sweep
from lowfp.experiments import train as T

TINY = ["--data", "synthetic", "--width", "0.25", "--batch-size", "256", "--epochs", "1"]
PNG = b"\x89PNG\r\n\x1a\n"


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_sweep_cli_writes_every_run_and_the_plots(tmp_path, capsys):
    out = tmp_path / "sw"
    code = cli.main(["sweep", "--out", str(out), *TINY, "--r", "0,1", "--seeds", "0", "--jobs", "1"])
    assert code == 0
    rows = read_csv(out / "results.csv")
    # fp32 once, uniform/op/op_io with and without promotion, ours for 2 r with and without
    assert [(r["strategy"], r["r"], r["promote"]) for r in rows] == [
        ("fp32", "", ""), ("uniform", "", "1"), ("uniform", "", "0"), ("op", "", "1"), ("op", "", "0"),
        ("op_io", "", "1"), ("op_io", "", "0"), ("ours", "0", "1"), ("ours", "0", "0"),
        ("ours", "1", "1"), ("ours", "1", "0")]
    by = {(r["strategy"], r["r"], r["promote"]): r for r in rows}
    assert float(by["fp32", "", ""]["ratio_lo"]) == 0.0
    assert float(by["ours", "0", "1"]["initial_ratio_lo"]) == 0.0      # ours(0) is all_hi
    # ours(1) demotes every group: the same tensors as uniform
    assert by["ours", "1", "1"]["initial_ratio_lo"] == by["uniform", "", "1"]["initial_ratio_lo"]
    assert float(by["uniform", "", "1"]["aggregate_mib"]) < float(by["ours", "0", "1"]["aggregate_mib"])
    assert float(by["ours", "0", "1"]["aggregate_mib"]) < float(by["fp32", "", ""]["aggregate_mib"])

    # each run equals lowfp train with the same options (nothing else leaks between runs)
    doc = json.loads((out / "results.json").read_text())
    op_run = next(r for r in doc["runs"] if r["config"]["assignment"] == "op" and r["config"]["promote"])
    direct = T.run(T.TrainConfig(**op_run["config"]), log=lambda *a: None)
    assert direct["best_acc"] == op_run["best_acc"]
    assert direct["initial_ratio_lo"] == op_run["initial_ratio_lo"]
    assert [e["train_loss"] for e in direct["epochs"]] == [e["train_loss"] for e in op_run["epochs"]]

    summary = read_csv(out / "summary.csv")
    assert len(summary) == 11 and all(s["seeds"] == "1" for s in summary)
    for name in ("tradeoff.png", "curves.png"):
        assert (out / name).read_bytes()[:8] == PNG
    text = capsys.readouterr().out
    assert "ours(r=1), no promotion" in text and "tradeoff.png" in text


def test_sweep_ratio_matches_the_assignment(tmp_path):
    """The sweep's ratio_lo for op is the one lowfp.assign computes for the same model."""
    res = sweep.run_sweep(T.TrainConfig(data="synthetic", width=0.25, batch_size=256, epochs=1),
                          str(tmp_path), strategies=["op"], promotions=[False], seeds=[3], jobs=1,
                          log=lambda *a: None)
    (run,) = res["runs"]
    import torch
    import torch.nn.functional as F
    from lowfp.experiments import data as D
    from lowfp.experiments import models as M
    torch.manual_seed(3)
    ds = D.load("synthetic", seed=3)
    model = M.build("resnet", ds.in_channels, ds.num_classes, 0.25, ds.image_size)
    tr = A.trace(model, ds.train_x[:256], F.cross_entropy, ds.train_y[:256])
    assert run["initial_ratio_lo"] == A.op(tr).ratio_lo


def test_sweep_resumes_after_an_interruption(tmp_path):
    base = T.TrainConfig(data="synthetic", width=0.25, batch_size=256, epochs=1)
    grid = dict(strategies=["fp32", "ours"], rs=[0.0, 0.5, 1.0], promotions=[True], seeds=[0])
    lines = []

    def stop_after_two(msg):
        lines.append(msg)
        if sum(m.startswith("[") for m in lines) == 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(base, str(tmp_path), jobs=1, log=stop_after_two, **grid)
    saved = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert len(saved) == 2 and not (tmp_path / "results.csv").exists()

    logged = []
    res = sweep.run_sweep(base, str(tmp_path), jobs=1, log=logged.append, **grid)
    assert res["ran"] == 2 and "(2 already in" in logged[0]
    assert len(res["runs"]) == 4
    assert res["runs"][:2] == saved               # the finished runs are reused, not retrained
    assert len(read_csv(tmp_path / "results.csv")) == 4

    # a larger grid trains only what is new; the same grid again trains nothing
    res = sweep.run_sweep(base, str(tmp_path), jobs=1, log=lambda *a: None,
                          **{**grid, "seeds": [0, 1]})
    assert res["ran"] == 4 and len(res["runs"]) == 8
    res = sweep.run_sweep(base, str(tmp_path), jobs=1, log=lambda *a: None, **grid)
    assert res["ran"] == 0 and len(read_csv(tmp_path / "results.csv")) == 4
    res = sweep.run_sweep(base, str(tmp_path), jobs=1, log=lambda *a: None, fresh=True, **grid)
    assert res["ran"] == 4


def test_sweep_worker_processes(tmp_path):
    """--jobs 2: runs in spawned workers give the same grid and assignments."""
    base = T.TrainConfig(data="synthetic", width=0.25, batch_size=256, epochs=1)
    res = sweep.run_sweep(base, str(tmp_path), strategies=["uniform", "op"], promotions=[True],
                          seeds=[0], jobs=2, log=lambda *a: None)
    assert res["ran"] == 2
    assert [r["config"]["assignment"] for r in res["runs"]] == ["uniform", "op"]
    assert res["runs"][0]["ratio_lo"] > res["runs"][1]["ratio_lo"] > 0


def test_sweep_rejects_bad_input(tmp_path, capsys):
    for bad in (["--r", "0.5,1.5"], ["--r", "a"], ["--strategies", "ours,best"], ["--seeds", ""],
                ["--promotion", "maybe"]):
        with pytest.raises(SystemExit):
            cli.main(["sweep", "--out", str(tmp_path), *bad])
    assert "--r values must lie in [0, 1]" in capsys.readouterr().err
    (tmp_path / "results.json").write_text("{not json")
    assert cli.main(["sweep", "--out", str(tmp_path), *TINY, "--strategies", "fp32", "--seeds", "0"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume from" in err and "--fresh" in err
    assert (tmp_path / "results.json").read_text() == "{not json"   # never overwritten
    assert cli.main(["sweep", "--out", str(tmp_path), *TINY, "--strategies", "fp32", "--seeds", "0",
                     "--model", "resnet", "--optimizer", "sgd", "--step-in-backward"]) == 2
    assert "step_in_backward needs an extrabits optimizer" in capsys.readouterr().err

"""``lowfp train`` end to end with tiny settings."""

import json

import pytest

from lowfp import cli


def run_cli(tmp_path, *args):
    out = tmp_path / "result.json"
    code = cli.main(["train", "--data", "synthetic", "--width", "0.25", "--batch-size", "256",
                     "--quiet", "--json", str(out), *args])
    return code, (json.loads(out.read_text()) if out.exists() else None)


def test_train_ours_on_synthetic_data(tmp_path, capsys):
    code, res = run_cli(tmp_path, "--epochs", "2", "--assignment", "ours", "--r", "0.6")
    assert code == 0
    assert [e["epoch"] for e in res["epochs"]] == [1, 2]
    assert res["initial_ratio_lo"] >= 0.6 and res["assignment"] == "ours(r=0.6)"
    assert res["best_acc"] == max(e["test_acc"] for e in res["epochs"])
    assert res["epochs"][-1]["step"] == 2 * 4  # 1024 samples / 256 per step, 2 epochs
    assert len(res["history"]["steps"]) == 8 and res["history"]["steps"][0]["loss"] > 0
    text = capsys.readouterr().out
    assert "epoch 2: train loss" in text and "best test accuracy" in text


def test_train_extra_bits_in_backward(tmp_path):
    code, res = run_cli(tmp_path, "--epochs", "1", "--model", "mobilenet", "--optimizer",
                        "extrabits-sgd", "--step-in-backward", "--assignment", "uniform",
                        "--hi", "bfloat16", "--lr", "0.05")
    assert code == 0 and not res["diverged"] and res["ratio_lo"] <= res["initial_ratio_lo"]


def test_train_rejects_bad_options(tmp_path, capsys):
    code, res = run_cli(tmp_path, "--step-in-backward")
    assert code == 2 and res is None
    assert "step_in_backward needs an extrabits optimizer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["train", "--model", "vgg"])

"""Dataset loaders of lowfp.data, the CIFAR readers on small files written in the CIFAR
python-version format by the test."""

import os
import pickle

import numpy as np
import pytest
import torch

from lowfp.experiments import data


def write_cifar(root, classes, n_per_file=6, seed=0):
    rng = np.random.default_rng(seed)
    if classes == 10:
        folder = os.path.join(root, "cifar-10-batches-py")
        files, key = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"], b"labels"
    else:
        folder = os.path.join(root, "cifar-100-python")
        files, key = ["train", "test"], b"fine_labels"
    os.makedirs(folder)
    written = {}
    for name in files:
        pixels = rng.integers(0, 256, (n_per_file, 3072), dtype=np.uint8)
        labels = rng.integers(0, classes, n_per_file).tolist()
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump({b"data": pixels, key: labels, b"batch_label": name.encode()}, f)
        written[name] = (pixels, labels)
    return written


@pytest.mark.parametrize("classes", [10, 100])
def test_cifar_reader_on_generated_files(tmp_path, classes):
    written = write_cifar(str(tmp_path), classes)
    ds = data.load(f"cifar{classes}", str(tmp_path))
    train_names = [f"data_batch_{i}" for i in range(1, 6)] if classes == 10 else ["train"]
    test_name = "test_batch" if classes == 10 else "test"
    raw = np.concatenate([written[n][0] for n in train_names]).reshape(-1, 3, 32, 32) / 255.0
    assert ds.train_x.shape == (6 * len(train_names), 3, 32, 32) and ds.test_x.shape == (6, 3, 32, 32)
    assert ds.train_y.tolist() == sum((written[n][1] for n in train_names), [])
    assert ds.test_y.tolist() == written[test_name][1]
    assert ds.num_classes == classes and ds.in_channels == 3 and ds.image_size == 32
    # channel-major rows of 32 pixels, standardised per channel with the training statistics
    mean, std = raw.mean(axis=(0, 2, 3)), raw.std(axis=(0, 2, 3)) + 1e-6
    expect = (raw - mean[None, :, None, None]) / std[None, :, None, None]
    assert np.allclose(ds.train_x.numpy(), expect, atol=1e-5)
    test_raw = written[test_name][0].reshape(-1, 3, 32, 32) / 255.0
    assert np.allclose(ds.test_x.numpy(), (test_raw - mean[None, :, None, None]) / std[None, :, None, None],
                       atol=1e-5)
    # the folder itself works as data_dir too
    sub = "cifar-10-batches-py" if classes == 10 else "cifar-100-python"
    assert torch.equal(data.load(f"cifar{classes}", str(tmp_path / sub)).train_x, ds.train_x)


def test_cifar_reader_errors(tmp_path):
    with pytest.raises(ValueError, match="needs --data-dir"):
        data.load("cifar10")
    with pytest.raises(ValueError, match="lacks the CIFAR-10 files"):
        data.load("cifar10", str(tmp_path))
    write_cifar(str(tmp_path), 10)
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    with open(path, "wb") as f:
        pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, f)
    with pytest.raises(ValueError, match="outside 0..9"):
        data.load("cifar10", str(tmp_path))
    with pytest.raises(ValueError, match="data must be one of"):
        data.load("mnist")


def test_digits_and_synthetic():
    ds = data.load("digits")
    assert len(ds.train_y) + len(ds.test_y) == 1797 and len(ds.test_y) == 359
    assert ds.train_x.shape[1:] == (1, 8, 8) and ds.train_x.dtype == torch.float32
    assert set(ds.train_y.tolist()) == set(range(10))
    assert abs(float(ds.train_x.mean())) < 1e-5 and abs(float(ds.train_x.std()) - 1) < 1e-3
    assert torch.equal(data.load("digits", seed=0).test_y, ds.test_y)
    assert not torch.equal(data.load("digits", seed=1).test_y, ds.test_y)
    syn = data.load("synthetic")
    assert syn.train_x.shape == (1024, 1, 8, 8) and syn.num_classes == 10


def test_pysource_windows_are_the_next_characters(tmp_path):
    for i, text in enumerate(["def f(x):\n\treturn x + 1\n", "é = 'naïve'\n" * 3]):
        (tmp_path / f"m{i}.py").write_text(text, encoding="utf-8")
    (tmp_path / "skip.txt").write_text("not a module")
    text = data.pysource_text(40, str(tmp_path))
    assert text == ("def f(x):\n\treturn x + 1\n\n" + "é = 'naïve'\n" * 3)[:40]
    with pytest.raises(ValueError, match="fewer than"):
        data.pysource_text(10 ** 6, str(tmp_path))
    ds = data.load("pysource")
    assert ds.tokens and ds.image_size == 64 and ds.num_classes == 98
    assert "stdlib" in ds.name and "sha256" in ds.name
    assert ds.train_x.dtype == torch.int64 and ds.train_x.shape[1] == 64
    assert torch.equal(ds.train_x[:, 1:], ds.train_y[:, :-1])  # y is x shifted by one
    assert torch.equal(ds.train_x[1:, 0], ds.train_y[:-1, -1])  # windows follow each other
    assert int(ds.train_x.max()) < 98 and len(ds.test_y) > 0
    # the text begins with the first module's source
    first = data.pysource_text(64)
    assert "".join(data._SYMBOLS[i] if i < 97 else "?" for i in ds.train_x[0].tolist()) == \
        "".join(c if c in data._SYMBOLS else "?" for c in first)

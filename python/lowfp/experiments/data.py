"""Datasets for ``lowfp train`` / ``lowfp sweep``: scikit-learn's handwritten digits (default; it
ships inside the package, so it works offline), CIFAR-10/100 from the standard python-version
files on disk, a synthetic set for quick runs, and ``pysource``: next-character prediction on
the source of Python's own standard library, text every Python installation carries.

The image loaders return a :class:`Dataset` of float32 image tensors (N, C, H, W), standardised
with the training split's per-channel mean and standard deviation, and int64 labels; ``pysource``
returns int64 windows of characters (N, T) and the next character at each position (N, T).
"""

from __future__ import annotations

import glob
import hashlib
import os
import pickle
import sysconfig
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from .optional import import_optional

__all__ = ["Dataset", "load", "DATASETS", "read_cifar"]

DATASETS = ("digits", "cifar10", "cifar100", "synthetic", "pysource")


@dataclass
class Dataset:
    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    tokens: bool = False  # character windows (N, T) with next-character targets (N, T)

    @property
    def in_channels(self) -> int:
        return 1 if self.tokens else self.train_x.shape[1]

    @property
    def image_size(self) -> int:
        """The images' side, or the windows' length for tokens."""
        return self.train_x.shape[-1]

    def __repr__(self) -> str:
        if self.tokens:
            return (f"Dataset({self.name!r}: {len(self.train_y)} train / {len(self.test_y)} test "
                    f"windows of {self.image_size} characters, {self.num_classes} symbols)")
        return (f"Dataset({self.name!r}: {len(self.train_y)} train / {len(self.test_y)} test, "
                f"{self.in_channels}x{self.image_size}x{self.image_size}, {self.num_classes} classes)")


def _standardise(train: np.ndarray, test: np.ndarray) -> Tuple[torch.Tensor, torch.Tensor]:
    mean = train.mean(axis=(0, 2, 3), keepdims=True)
    std = train.std(axis=(0, 2, 3), keepdims=True) + 1e-6
    to = lambda a: torch.from_numpy(((a - mean) / std).astype(np.float32))  # noqa: E731
    return to(train), to(test)


def _digits(seed: int) -> Dataset:
    d = import_optional("sklearn.datasets", "the digits data").load_digits()
    x = d.data.reshape(-1, 1, 8, 8).astype(np.float64)
    y = d.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = len(y) // 5
    test, train = order[:n_test], order[n_test:]
    tx, vx = _standardise(x[train], x[test])
    return Dataset("digits", tx, torch.from_numpy(y[train]), vx, torch.from_numpy(y[test]), 10)


def _synthetic(seed: int, n_train: int = 1024, n_test: int = 256, classes: int = 10) -> Dataset:
    """Noisy copies of one random 8×8 prototype per class."""
    rng = np.random.default_rng(seed)
    protos = rng.normal(size=(classes, 1, 8, 8))

    def sample(n):
        y = rng.integers(0, classes, n)
        return protos[y] + 0.8 * rng.normal(size=(n, 1, 8, 8)), y.astype(np.int64)
    x, y = sample(n_train)
    vx, vy = sample(n_test)
    tx, vx = _standardise(x, vx)
    return Dataset("synthetic", tx, torch.from_numpy(y), vx, torch.from_numpy(vy), classes)


# pysource: printable ASCII, newline and tab, and one symbol for every other character.
_SYMBOLS = "\n\t" + "".join(chr(c) for c in range(32, 127))
PYSOURCE_CHARS = 1 << 19  # 512 Ki characters: 460 Ki to train on, the rest to test


def pysource_text(chars: int = PYSOURCE_CHARS, stdlib: Optional[str] = None) -> str:
    """The first ``chars`` characters of the standard library's top-level modules (``*.py`` in
    sysconfig's stdlib folder, by sorted name, each file whole and followed by a newline)."""
    folder = stdlib or sysconfig.get_paths()["stdlib"]
    parts, total = [], 0
    for path in sorted(glob.glob(os.path.join(folder, "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read() + "\n"
        parts.append(text)
        total += len(text)
        if total >= chars:
            break
    if total < chars:
        raise ValueError(f"pysource: the standard library at {folder} holds {total} characters "
                         f"of top-level modules, fewer than {chars}")
    return "".join(parts)[:chars]


def _pysource(block: int = 64, chars: int = PYSOURCE_CHARS) -> Dataset:
    """Next-character prediction on Python's standard library source, in windows of ``block``
    characters (train: the first 90 %, test: the rest). The text depends on the Python version;
    the name records it and the text's hash."""
    text = pysource_text(chars)
    index = {c: i for i, c in enumerate(_SYMBOLS)}
    other = len(_SYMBOLS)
    ids = np.fromiter((index.get(c, other) for c in text), dtype=np.int64, count=len(text))
    n_train = int(len(ids) * 0.9)

    def windows(a):
        n = (len(a) - 1) // block
        x = a[:n * block].reshape(n, block)
        y = a[1:n * block + 1].reshape(n, block)
        return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())
    tx, ty = windows(ids[:n_train])
    vx, vy = windows(ids[n_train:])
    digest = hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:8]
    version = sysconfig.get_python_version()
    return Dataset(f"pysource (Python {version} stdlib, {len(text)} chars, sha256 {digest})",
                   tx, ty, vx, vy, other + 1, tokens=True)


def _unpickle(path: str) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")


def read_cifar(data_dir: str, classes: int) -> Dataset:
    """CIFAR-10 (``data_batch_1`` … ``data_batch_5``, ``test_batch``) or CIFAR-100 (``train``,
    ``test``) python-version files, in ``data_dir`` or its ``cifar-10-batches-py`` /
    ``cifar-100-python`` folder."""
    if classes not in (10, 100):
        raise ValueError(f"classes must be 10 or 100, got {classes!r}")
    if data_dir is None:
        raise ValueError(f"--data cifar{classes} needs --data-dir: the folder holding the CIFAR "
                         f"python-version files")
    sub = "cifar-10-batches-py" if classes == 10 else "cifar-100-python"
    root = os.path.join(data_dir, sub) if os.path.isdir(os.path.join(data_dir, sub)) else data_dir
    if classes == 10:
        train_files = [f"data_batch_{i}" for i in range(1, 6)]
        test_files, key = ["test_batch"], b"labels"
    else:
        train_files, test_files, key = ["train"], ["test"], b"fine_labels"
    missing = [f for f in train_files + test_files if not os.path.isfile(os.path.join(root, f))]
    if missing:
        raise ValueError(f"data_dir {data_dir!r} lacks the CIFAR-{classes} files {missing}")

    def read(files: List[str]):
        xs, ys = [], []
        for name in files:
            d = _unpickle(os.path.join(root, name))
            data = np.asarray(d[b"data"], dtype=np.uint8)
            if data.ndim != 2 or data.shape[1] != 3072:
                raise ValueError(f"{name}: expected data of shape (N, 3072), got {data.shape}")
            labels = np.asarray(d[key], dtype=np.int64)
            if len(labels) != len(data) or labels.min(initial=0) < 0 or labels.max(initial=0) >= classes:
                raise ValueError(f"{name}: labels do not match the data or lie outside 0..{classes - 1}")
            xs.append(data.reshape(-1, 3, 32, 32).astype(np.float64) / 255.0)
            ys.append(labels)
        return np.concatenate(xs), np.concatenate(ys)
    x, y = read(train_files)
    vx, vy = read(test_files)
    tx, vx = _standardise(x, vx)
    return Dataset(f"cifar{classes}", tx, torch.from_numpy(y), vx, torch.from_numpy(vy), classes)


def load(name: str = "digits", data_dir: Optional[str] = None, seed: int = 0) -> Dataset:
    """A dataset of ``DATASETS`` by name (``seed`` picks the digits test split and the
    synthetic samples)."""
    if name == "digits":
        return _digits(seed)
    if name == "synthetic":
        return _synthetic(seed)
    if name in ("cifar10", "cifar100"):
        return read_cifar(data_dir, 10 if name == "cifar10" else 100)
    if name == "pysource":
        return _pysource()
    raise ValueError(f"data must be one of {DATASETS}, got {name!r}")

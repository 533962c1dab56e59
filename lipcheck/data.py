"""Image data for training: CIFAR-100 from a local directory, scikit-learn's bundled digits, and a
writer of tiny synthetic data sets in the CIFAR-100 file format (for tests).

Every loader returns an `ImageData`: raw images of shape (N, C, H, W) at their native resolution
(float in [0, 1], or uint8 0..255 for CIFAR-100 so that 50000 images take 150 MB), integer labels, and the per-channel mean/std of the *training* split. Resizing to a
model's resolution happens per batch on the training device (lipcheck/train.py), so CIFAR-100 is
never held in memory at 224x224.

CIFAR-100 python layout (https://www.cs.toronto.edu/~kriz/cifar.html):

    <data-dir>/cifar-100-python/{train, test, meta}

`train` and `test` are pickles of dicts with b"data" (N, 3072) uint8 rows (1024 red, 1024 green,
1024 blue values, each a row-major 32x32 plane), b"fine_labels" and b"coarse_labels"; `meta`
holds b"fine_label_names" and b"coarse_label_names".
"""
from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path

import numpy as np
import torch

CIFAR_DIR = "cifar-100-python"
CIFAR_FILES = ("train", "test", "meta")
CIFAR_SIZE = 32
DATASETS = ("digits", "cifar100")


@dataclasses.dataclass
class ImageData:
    """images (N, C, H, W), float in [0, 1] or uint8 in 0..255; labels (N,) int64; mean/std (C,) of the
    training split on the [0, 1] scale."""
    name: str
    split: str
    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    mean: torch.Tensor
    std: torch.Tensor
    class_names: list[str] | None = None

    def __post_init__(self):
        if self.images.dim() != 4:
            raise ValueError(f"images must have shape (N, C, H, W), got {tuple(self.images.shape)}")
        if self.labels.shape != (self.images.shape[0],):
            raise ValueError(f"labels must have shape ({self.images.shape[0]},), got {tuple(self.labels.shape)}")

    def __len__(self) -> int:
        return self.images.shape[0]

    @property
    def channels(self) -> int:
        return self.images.shape[1]

    @property
    def size(self) -> tuple[int, int]:
        return tuple(self.images.shape[-2:])

    def batch(self, idx: torch.Tensor, *, device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Images idx as float in [0, 1] on `device`, and their labels."""
        x = self.images[idx].to(device)
        x = x.to(dtype) / 255.0 if x.dtype == torch.uint8 else x.to(dtype)
        return x, self.labels[idx].to(device)

    def subset(self, n: int | None) -> "ImageData":
        """The first n examples (all when n is None): for smoke tests."""
        if n is None or n >= len(self):
            return self
        if n <= 0:
            raise ValueError(f"subset size must be positive, got {n}")
        return dataclasses.replace(self, images=self.images[:n], labels=self.labels[:n])


def channel_stats(images: torch.Tensor, *, scale: float = 1.0, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and (unbiased) standard deviation over (N, H, W) of images / scale, in float64,
    accumulated in chunks so uint8 CIFAR-100 is never copied to float64 whole."""
    C = images.shape[1]
    s1 = torch.zeros(C, dtype=torch.float64)
    s2 = torch.zeros(C, dtype=torch.float64)
    for part in images.split(chunk):
        x = part.to(torch.float64) / scale
        s1 += x.sum(dim=(0, 2, 3))
        s2 += x.pow(2).sum(dim=(0, 2, 3))
    n = images.shape[0] * images.shape[2] * images.shape[3]
    mean = s1 / n
    var = (s2 - n * mean ** 2) / (n - 1)
    return mean, var.clamp_min(0).sqrt()


# --------------------------------------------------------------------------------------------- digits
DIGITS_TEST_FRACTION = 0.25
DIGITS_SPLIT_SEED = 0  # the split is fixed: every run, every seed, sees the same train/test examples


def load_digits(*, dtype=torch.float32) -> tuple[ImageData, ImageData]:
    """scikit-learn's bundled 8x8 grey digits (1797 images, 10 classes), fixed stratified split
    (25% test, random_state 0): 1347 train / 450 test. Pixel values 0..16 are scaled to [0, 1]."""
    from sklearn.datasets import load_digits as _sk_digits
    from sklearn.model_selection import train_test_split

    d = _sk_digits()
    x = torch.as_tensor(d.images / 16.0, dtype=dtype)[:, None]  # (N, 1, 8, 8)
    y = torch.as_tensor(d.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(np.arange(len(y)), test_size=DIGITS_TEST_FRACTION,
                                           random_state=DIGITS_SPLIT_SEED, stratify=d.target)
    idx_train, idx_test = torch.as_tensor(np.sort(idx_train)), torch.as_tensor(np.sort(idx_test))
    mean, std = channel_stats(x[idx_train])
    names = [str(n) for n in d.target_names]
    make = lambda split, idx: ImageData("digits", split, x[idx], y[idx], 10, mean, std, names)
    return make("train", idx_train), make("test", idx_test)


# ------------------------------------------------------------------------------------------- CIFAR-100
def cifar_root(data_dir) -> Path:
    """The `cifar-100-python` directory: `data_dir` itself or its child of that name."""
    if data_dir is None:
        raise FileNotFoundError(f"--data-dir is required for CIFAR-100: pass the directory that contains "
                                f"{CIFAR_DIR}/ with the files {', '.join(CIFAR_FILES)} (the python version "
                                f"of CIFAR-100, https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz)")
    data_dir = Path(data_dir).expanduser()
    expected = ", ".join(f"{CIFAR_DIR}/{f}" for f in CIFAR_FILES)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data directory {str(data_dir)!r} does not exist; pass --data-dir pointing at "
                                f"the directory that contains {expected} (unpack cifar-100-python.tar.gz there)")
    # accept the parent of cifar-100-python/ or that directory itself
    root = data_dir / CIFAR_DIR if (data_dir / CIFAR_DIR).is_dir() or data_dir.name != CIFAR_DIR else data_dir
    missing = [f for f in CIFAR_FILES if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(f"CIFAR-100 data not found under {str(data_dir)!r}: missing "
                                f"{', '.join(str(root / f) for f in missing)}; expected {expected} "
                                f"(the python-pickle version of CIFAR-100)")
    return root


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            obj = pickle.load(f, encoding="bytes")
    except Exception as e:  # truncated, not a pickle, wrong protocol
        raise ValueError(f"{str(path)!r} is not a readable CIFAR-100 pickle ({type(e).__name__}: {e}); "
                         f"re-extract cifar-100-python.tar.gz") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{str(path)!r} must hold a dict, found {type(obj).__name__}; is this CIFAR-100 (python)?")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in obj.items()}


def load_cifar100(data_dir, split: str = "train", *, labels: str = "fine") -> ImageData:
    """CIFAR-100 `split` ("train" or "test") from the python-pickle layout under `data_dir`.

    Images come back at their native 32x32 as uint8 (ImageData.batch scales them to [0, 1]); mean/std
    are those of the training split on the [0, 1] scale.
    A missing directory or file, or a malformed pickle, raises an error naming the expected files.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if labels not in ("fine", "coarse"):
        raise ValueError(f"labels must be 'fine' (100 classes) or 'coarse' (20), got {labels!r}")
    root = cifar_root(data_dir)
    meta = _unpickle(root / "meta")
    key = f"{labels}_label_names"
    if key not in meta:
        raise ValueError(f"{str(root / 'meta')!r} lacks {key!r}; keys are {sorted(meta)}")
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in meta[key]]

    def read(s):
        d = _unpickle(root / s)
        for k in ("data", f"{labels}_labels"):
            if k not in d:
                raise ValueError(f"{str(root / s)!r} lacks {k!r}; keys are {sorted(d)}")
        data = np.asarray(d["data"])
        y = np.asarray(d[f"{labels}_labels"], dtype=np.int64)
        if data.ndim != 2 or data.shape[1] != 3 * CIFAR_SIZE ** 2 or data.dtype != np.uint8:
            raise ValueError(f"{str(root / s)!r}: 'data' must be uint8 of shape (N, 3072), got "
                             f"{data.dtype} {data.shape}")
        if y.shape != (data.shape[0],) or (len(y) and (y.min() < 0 or y.max() >= len(names))):
            raise ValueError(f"{str(root / s)!r}: labels must be {data.shape[0]} integers in [0, {len(names)})")
        # each row is 3 row-major 32x32 planes (R, G, B): a plain reshape gives (N, C, H, W)
        x = torch.from_numpy(data.reshape(-1, 3, CIFAR_SIZE, CIFAR_SIZE).copy())
        return x, torch.from_numpy(y)

    x, y = read(split)
    x_train = x if split == "train" else read("train")[0]
    mean, std = channel_stats(x_train, scale=255.0)
    return ImageData("cifar100", split, x, y, len(names), mean, std, names)


def load_dataset(name: str, data_dir=None, *, dtype=torch.float32) -> tuple[ImageData, ImageData]:
    """(train, test) for `name` in DATASETS."""
    if name == "digits":
        return load_digits(dtype=dtype)
    if name == "cifar100":
        return load_cifar100(data_dir, "train"), load_cifar100(data_dir, "test")
    raise ValueError(f"unknown data set {name!r}; choose one of {DATASETS}")


def write_synthetic_cifar(data_dir, *, n_train: int = 64, n_test: int = 32, num_classes: int = 100,
                          seed: int = 0) -> dict:
    """Write a tiny random data set in the CIFAR-100 python layout under data_dir/cifar-100-python/.

    Returns the arrays written: {"train": (data uint8 (N, 3072), fine labels), "test": (...)}.
    Pixels and labels are uniform random; coarse labels are fine // 5 (CIFAR-100 has 5 per superclass).
    """
    rng = np.random.default_rng(seed)
    root = Path(data_dir) / CIFAR_DIR
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        data = rng.integers(0, 256, size=(n, 3 * CIFAR_SIZE ** 2), dtype=np.uint8)
        y = rng.integers(0, num_classes, size=n)
        d = {b"batch_label": f"{split} batch (synthetic)".encode(), b"data": data,
             b"fine_labels": [int(v) for v in y], b"coarse_labels": [int(v) // 5 for v in y],
             b"filenames": [f"synthetic_{split}_{i}.png".encode() for i in range(n)]}
        with open(root / split, "wb") as f:
            pickle.dump(d, f, protocol=2)
        out[split] = (data, y)
    meta = {b"fine_label_names": [f"class{i}".encode() for i in range(num_classes)],
            b"coarse_label_names": [f"super{i}".encode() for i in range((num_classes + 4) // 5)]}
    with open(root / "meta", "wb") as f:
        pickle.dump(meta, f, protocol=2)
    return out

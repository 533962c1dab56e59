"""Data loaders: CIFAR-100 python layout (via a synthetic data set in that format), digits split, bad inputs."""
import pickle

import numpy as np
import pytest
import torch

from lipcheck import data as D


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cifar")
    written = D.write_synthetic_cifar(root, n_train=24, n_test=12, seed=3)
    return root, written


def test_cifar_round_trip_pixels_labels_and_names(cifar_dir):
    root, written = cifar_dir
    for split in ("train", "test"):
        d = D.load_cifar100(root, split)
        raw, y = written[split]
        n = raw.shape[0]
        assert d.images.shape == (n, 3, 32, 32) and d.images.dtype == torch.uint8
        # independent decoding of the CIFAR row layout: value (c, i, j) sits at column c*1024 + i*32 + j
        c, i, j = np.meshgrid(np.arange(3), np.arange(32), np.arange(32), indexing="ij")
        expect = raw[:, c * 1024 + i * 32 + j]
        assert np.array_equal(d.images.numpy(), expect)
        assert np.array_equal(d.labels.numpy(), y)
        assert d.num_classes == 100 and d.class_names[7] == "class7"
        x, yb = d.batch(torch.arange(n))
        assert torch.equal(x, d.images.to(torch.float32) / 255) and torch.equal(yb, d.labels)
    # statistics are those of the training split, on the [0, 1] scale, whichever split is loaded
    train_raw = written["train"][0].reshape(-1, 3, 1024).astype(np.float64) / 255
    mean = train_raw.transpose(1, 0, 2).reshape(3, -1).mean(1)
    std = train_raw.transpose(1, 0, 2).reshape(3, -1).std(1, ddof=1)
    test = D.load_cifar100(root, "test")
    np.testing.assert_allclose(test.mean.numpy(), mean, rtol=1e-12)
    np.testing.assert_allclose(test.std.numpy(), std, rtol=1e-10)
    # pointing at cifar-100-python/ itself works too
    again = D.load_cifar100(root / D.CIFAR_DIR, "test")
    assert torch.equal(again.images, test.images)


def test_cifar_coarse_labels(cifar_dir):
    root, written = cifar_dir
    d = D.load_cifar100(root, "train", labels="coarse")
    assert np.array_equal(d.labels.numpy(), written["train"][1] // 5) and d.num_classes == 20


def test_missing_directory_names_expected_files(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        D.load_cifar100(tmp_path / "nowhere")
    msg = str(e.value)
    assert "nowhere" in msg and all(f"cifar-100-python/{f}" in msg for f in ("train", "test", "meta"))
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        D.load_dataset("cifar100", None)


def test_missing_file_named(tmp_path):
    D.write_synthetic_cifar(tmp_path, n_train=4, n_test=4)
    (tmp_path / D.CIFAR_DIR / "meta").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing .*meta"):
        D.load_cifar100(tmp_path)


def test_malformed_files(tmp_path):
    D.write_synthetic_cifar(tmp_path, n_train=4, n_test=4)
    root = tmp_path / D.CIFAR_DIR
    (root / "train").write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match="train.*not a readable CIFAR-100 pickle"):
        D.load_cifar100(tmp_path, "train")
    with open(root / "train", "wb") as f:
        pickle.dump({b"data": np.zeros((4, 100), np.uint8), b"fine_labels": [0] * 4}, f)
    with pytest.raises(ValueError, match=r"\(N, 3072\)"):
        D.load_cifar100(tmp_path, "train")
    with open(root / "train", "wb") as f:
        pickle.dump({b"data": np.zeros((4, 3072), np.uint8), b"fine_labels": [0, 1, 2, 100]}, f)
    with pytest.raises(ValueError, match="labels must be"):
        D.load_cifar100(tmp_path, "train")
    with pytest.raises(ValueError, match="split"):
        D.load_cifar100(tmp_path, "val")


def test_digits_fixed_stratified_split():
    from sklearn.datasets import load_digits

    tr, te = D.load_digits()
    tr2, te2 = D.load_digits()
    assert torch.equal(tr.images, tr2.images) and torch.equal(te.labels, te2.labels)  # fixed
    assert (len(tr), len(te)) == (1347, 450) and tr.images.shape[1:] == (1, 8, 8)
    sk = load_digits()
    # the two splits together are exactly the bundled data set (as a multiset of (image, label) rows)
    rows = lambda x, y: sorted(map(tuple, np.concatenate([x.reshape(len(y), -1), y[:, None]], 1).tolist()))
    both = rows(torch.cat([tr.images, te.images]).numpy() * 16, torch.cat([tr.labels, te.labels]).numpy())
    assert both == rows(sk.images, sk.target)
    # stratified: every class has within one example of 25% of its members in the test split
    full = np.bincount(sk.target)
    assert np.all(np.abs(np.bincount(te.labels.numpy()) - 0.25 * full) <= 1)
    assert tr.mean.item() == pytest.approx(tr.images.double().mean().item(), rel=1e-12)
    assert tr.std.item() == pytest.approx(tr.images.double().std().item(), rel=1e-12)
    assert float(tr.images.min()) == 0.0 and float(tr.images.max()) == 1.0


def test_unknown_dataset_and_bad_subset():
    with pytest.raises(ValueError, match="digits"):
        D.load_dataset("mnist")
    tr, _ = D.load_digits()
    assert len(tr.subset(10)) == 10 and tr.subset(None) is tr
    with pytest.raises(ValueError, match="positive"):
        tr.subset(0)

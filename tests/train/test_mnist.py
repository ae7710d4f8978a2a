"""The MNIST IDX reader: the real files, gzip detection, and one clear DataError per kind of damage."""

from __future__ import annotations

import gzip
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from prague.errors import DataError
from prague.workload.mnist import MNIST_FILES, load_mnist, read_idx

# The shared offline copy lives beside the project root (../shared/datasets/mnist); override with
# PRAGUE_MNIST_DIR to test another copy.
MNIST_DIR = Path(os.environ.get("PRAGUE_MNIST_DIR",
                                Path(__file__).resolve().parents[2].parent / "shared" / "datasets" / "mnist"))
needs_mnist = pytest.mark.skipif(not (MNIST_DIR / "train-images-idx3-ubyte.gz").is_file(),
                                 reason=f"no MNIST copy at {MNIST_DIR} (set PRAGUE_MNIST_DIR)")

TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS = MNIST_FILES


def idx_bytes(array: np.ndarray, type_byte: int = 0x08) -> bytes:
    """Encode ``array`` as an IDX file (header plus row-major bytes)."""
    header = bytes([0, 0, type_byte, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def write_fake_mnist(directory: Path, n_train: int = 6, n_test: int = 4, compress: bool = False) -> None:
    """Write a tiny valid MNIST directory: random 28x28 images and labels 0..9."""
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    contents = {
        TRAIN_IMAGES: rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        TRAIN_LABELS: np.arange(n_train, dtype=np.uint8) % 10,
        TEST_IMAGES: rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        TEST_LABELS: np.arange(n_test, dtype=np.uint8) % 10,
    }
    for name, array in contents.items():
        data = idx_bytes(array)
        if compress:
            (directory / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (directory / name).write_bytes(data)


@pytest.fixture(scope="module")
def real_mnist() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return load_mnist(MNIST_DIR)


@needs_mnist
def test_real_mnist_shapes_and_labels(real_mnist: tuple[torch.Tensor, ...]) -> None:
    train_x, train_y, test_x, test_y = real_mnist
    assert train_x.shape == (60000, 28, 28) and test_x.shape == (10000, 28, 28)
    assert train_y.shape == (60000,) and test_y.shape == (10000,)
    assert train_x.dtype == torch.uint8 and train_y.dtype == torch.uint8
    for labels in (train_y, test_y):
        assert set(labels.unique().tolist()) == set(range(10))
    # The images are real digits: dark background, some ink.
    assert 20 < train_x[:1000].float().mean() < 50 and int(train_x[:1000].max()) == 255


@needs_mnist
def test_plain_and_gzip_copies_read_equal(tmp_path: Path) -> None:
    original = MNIST_DIR / f"{TEST_IMAGES}.gz"
    plain = gzip.decompress(original.read_bytes())
    (tmp_path / TEST_IMAGES).write_bytes(plain)
    packed = gzip.compress(plain, compresslevel=1)  # fast; any level reads the same
    (tmp_path / f"{TEST_IMAGES}.gz").write_bytes(packed)
    # Compression is detected from the content, not the name.
    (tmp_path / "gzip-without-suffix").write_bytes(packed)
    (tmp_path / "plain-with-suffix.gz").write_bytes(plain)
    expected = read_idx(original)
    assert expected.shape == (10000, 28, 28)
    for name in (TEST_IMAGES, f"{TEST_IMAGES}.gz", "gzip-without-suffix", "plain-with-suffix.gz"):
        assert torch.equal(read_idx(tmp_path / name), expected), name


@pytest.mark.parametrize("compress", [False, True])
def test_load_mnist_reads_plain_or_gzip_directory(tmp_path: Path, compress: bool) -> None:
    write_fake_mnist(tmp_path, n_train=6, n_test=4, compress=compress)
    train_x, train_y, test_x, test_y = load_mnist(tmp_path)
    assert train_x.shape == (6, 28, 28) and train_y.tolist() == list(range(6))
    assert test_x.shape == (4, 28, 28) and test_y.tolist() == list(range(4))


def test_load_mnist_accepts_torchvision_layout(tmp_path: Path) -> None:
    write_fake_mnist(tmp_path / "MNIST" / "raw")
    assert load_mnist(tmp_path)[0].shape == (6, 28, 28)


def test_load_mnist_accepts_other_image_sizes(tmp_path: Path) -> None:
    write_fake_mnist(tmp_path)
    images = np.zeros((6, 5, 7), dtype=np.uint8)
    (tmp_path / TRAIN_IMAGES).write_bytes(idx_bytes(images))
    assert load_mnist(tmp_path)[0].shape == (6, 5, 7)


def _rewrite(name: str, change: Callable[[bytes], bytes]) -> Callable[[Path], str]:
    """A corruption: apply ``change`` to the bytes of file ``name``; returns the damaged file's name."""

    def corrupt(directory: Path) -> str:
        path = directory / name
        path.write_bytes(change(path.read_bytes()))
        return name

    return corrupt


def _replace(name: str, array: np.ndarray) -> Callable[[Path], str]:
    return _rewrite(name, lambda _: idx_bytes(array))


def _gzip_truncated(directory: Path) -> str:
    path = directory / TRAIN_IMAGES
    data = gzip.compress(path.read_bytes())
    path.unlink()
    (directory / f"{TRAIN_IMAGES}.gz").write_bytes(data[: len(data) // 2])
    return f"{TRAIN_IMAGES}.gz"


def _remove(name: str) -> Callable[[Path], str]:
    def corrupt(directory: Path) -> str:
        (directory / name).unlink()
        return name

    return corrupt


# (corruption, words the message must contain besides the file name)
CORRUPTIONS = {
    "bad magic": (_rewrite(TRAIN_IMAGES, lambda b: b"\x12\x34" + b[2:]), ["magic", "re-download"]),
    "html page instead of data": (_rewrite(TRAIN_LABELS, lambda b: b"<html>not found</html>"), ["magic"]),
    "wrong dtype byte": (_rewrite(TRAIN_IMAGES, lambda b: b[:2] + b"\x0d" + b[3:]),
                         ["type byte 0x0d", "float", "0x08"]),
    "two dimensions": (_rewrite(TEST_IMAGES, lambda b: b[:3] + b"\x02" + b[4:]), ["2 dimensions"]),
    "empty file": (_rewrite(TEST_LABELS, lambda b: b""), ["0 bytes", "truncated"]),
    "truncated header": (_rewrite(TRAIN_IMAGES, lambda b: b[:9]), ["header", "truncated"]),
    "truncated payload": (_rewrite(TRAIN_IMAGES, lambda b: b[:-100]), ["payload", "truncated",
                                                                       "re-download"]),
    "extra bytes": (_rewrite(TEST_LABELS, lambda b: b + b"\x00\x01"), ["payload", "longer"]),
    "truncated gzip stream": (_gzip_truncated, ["gzip", "truncated"]),
    "label count != image count": (_replace(TRAIN_LABELS, np.zeros(5, dtype=np.uint8)),
                                   ["5 labels", "6 images", TRAIN_IMAGES]),
    "label out of range": (_replace(TEST_LABELS, np.array([0, 1, 12, 3], dtype=np.uint8)),
                           ["label 12", "0..9"]),
    "labels in image slot": (_replace(TRAIN_IMAGES, np.zeros(6, dtype=np.uint8)), ["3 dimensions"]),
    "images in label slot": (_replace(TEST_LABELS, np.zeros((4, 28, 28), dtype=np.uint8)),
                             ["1 dimension"]),
    "missing file": (_remove(TEST_LABELS), ["missing", "--data-dir"]),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_each_corruption_raises_one_line_data_error(tmp_path: Path, case: str) -> None:
    corrupt, words = CORRUPTIONS[case]
    write_fake_mnist(tmp_path)
    bad_name = corrupt(tmp_path)
    with pytest.raises(DataError) as info:
        load_mnist(tmp_path)
    message = str(info.value)
    assert "\n" not in message
    for word in [bad_name, *words]:
        assert word in message, f"{word!r} not in {message!r}"


def test_missing_directory_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    with pytest.raises(DataError, match="no-such-dir.*--data-dir"):
        load_mnist(missing)


def test_file_instead_of_directory(tmp_path: Path) -> None:
    path = tmp_path / "a-file"
    path.write_bytes(b"")
    with pytest.raises(DataError, match="a-file.*not a directory.*found a file"):
        load_mnist(path)


def test_read_idx_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nothing-here.*does not exist"):
        read_idx(tmp_path / "nothing-here")


def test_read_idx_on_a_directory_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="cannot read"):
        read_idx(tmp_path)


def test_plain_file_preferred_over_gz_when_both_exist(tmp_path: Path) -> None:
    write_fake_mnist(tmp_path)
    # A broken .gz beside a good plain file is never opened.
    (tmp_path / f"{TRAIN_IMAGES}.gz").write_bytes(b"\x1f\x8bbroken")
    assert load_mnist(tmp_path)[0].shape == (6, 28, 28)

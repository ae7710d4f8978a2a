"""Reader for MNIST in its original IDX file format, gzip-compressed or plain.

The IDX format (http://yann.lecun.com/exdb/mnist/) is a 4-byte magic number -- two zero bytes, a type
byte (0x08 = unsigned byte) and the number of dimensions -- then one big-endian uint32 per dimension,
then the values in row-major order. Every file is checked against that header before use, so a
truncated download or a wrong file fails here with a one-line :class:`~prague.errors.DataError` that
names the file, instead of deep inside training.

This module only reads files (I/O at the edge); normalisation and the model's view of the data live in
:mod:`prague.workload.data`.
"""

from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path

import numpy as np
import torch

from prague.errors import DataError

__all__ = ["IMAGE_FILES", "LABEL_FILES", "MNIST_FILES", "NUM_CLASSES", "load_mnist", "read_idx"]

GZIP_MAGIC = b"\x1f\x8b"
IDX_UBYTE = 0x08
IDX_NDIMS = (1, 3)
NUM_CLASSES = 10

#: Base names of the four files, as published and as the usual PyTorch loaders expect them.
IMAGE_FILES = {"train": "train-images-idx3-ubyte", "test": "t10k-images-idx3-ubyte"}
LABEL_FILES = {"train": "train-labels-idx1-ubyte", "test": "t10k-labels-idx1-ubyte"}
MNIST_FILES = (IMAGE_FILES["train"], LABEL_FILES["train"], IMAGE_FILES["test"], LABEL_FILES["test"])

REDOWNLOAD = "re-download it (e.g. from https://ossci-datasets.s3.amazonaws.com/mnist/)"
_IDX_TYPE_NAMES = {0x08: "unsigned byte", 0x09: "signed byte", 0x0B: "short", 0x0C: "int",
                   0x0D: "float", 0x0E: "double"}


def read_idx(path: Path) -> torch.Tensor:
    """Read one IDX file of unsigned bytes with 1 or 3 dimensions into a ``uint8`` tensor.

    The file may be gzip-compressed or plain; compression is detected from the content (the gzip magic
    bytes ``1f 8b``), never from the file name, so a decompressed copy that kept its ``.gz`` name reads
    as well.

    Raises:
        DataError: the file is missing or unreadable, is a broken gzip stream, its header is not an IDX
            header of unsigned bytes with 1 or 3 dimensions, or its payload is shorter or longer than
            the header's dimensions say. The message names the file and says how to fix it.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"MNIST file {str(path)!r} does not exist; {REDOWNLOAD}") from None
    except OSError as exc:
        raise DataError(f"cannot read MNIST file {str(path)!r} ({exc.strerror or exc}); "
                        f"check that it is a readable file or {REDOWNLOAD}") from None
    if raw[:2] == GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise DataError(f"MNIST file {str(path)!r} starts like gzip but does not decompress "
                            f"({_one_line(exc)}); the download is probably truncated, {REDOWNLOAD}") from None
    return _parse_idx(raw, path)


def _parse_idx(raw: bytes, path: Path) -> torch.Tensor:
    """Validate the IDX header of ``raw`` (the uncompressed content of ``path``) and decode it."""
    where = f"MNIST file {str(path)!r}"
    if len(raw) < 4:
        raise DataError(f"{where} is {len(raw)} bytes long, expected at least the 4-byte IDX magic "
                        f"number; the file is empty or truncated, {REDOWNLOAD}")
    if raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{where} has magic bytes {raw[:4].hex(' ')}, expected an IDX header "
                        f"'00 00 08 01' or '00 00 08 03'; it is not an MNIST IDX file, {REDOWNLOAD}")
    type_byte, ndim = raw[2], raw[3]
    if type_byte != IDX_UBYTE:
        kind = _IDX_TYPE_NAMES.get(type_byte, "unknown")
        raise DataError(f"{where} has IDX type byte 0x{type_byte:02x} ({kind}), expected 0x08 "
                        f"(unsigned byte) as in MNIST; {REDOWNLOAD}")
    if ndim not in IDX_NDIMS:
        raise DataError(f"{where} has {ndim} dimensions in its IDX header, expected 1 (labels) or 3 "
                        f"(images); {REDOWNLOAD}")
    header_bytes = 4 + 4 * ndim
    if len(raw) < header_bytes:
        raise DataError(f"{where} is {len(raw)} bytes long, shorter than its {header_bytes}-byte IDX "
                        f"header; the file is truncated, {REDOWNLOAD}")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = math.prod(dims)
    found = len(raw) - header_bytes
    if found != expected:
        shape = "x".join(str(d) for d in dims)
        problem = "truncated" if found < expected else "longer than its header says"
        raise DataError(f"{where} has {found} payload bytes, expected {expected} for its header shape "
                        f"{shape}; the file is {problem}, {REDOWNLOAD}")
    array = np.frombuffer(raw, dtype=np.uint8, offset=header_bytes).reshape(dims)
    # Copy so that the tensor owns writable memory instead of viewing the immutable bytes object.
    return torch.from_numpy(array.copy())


def load_mnist(data_dir: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Read the four MNIST files from ``data_dir`` as ``(train_x, train_y, test_x, test_y)``.

    Each file is looked up under its standard name (see :data:`MNIST_FILES`), with or without ``.gz``;
    where both exist the plain one is read. If ``data_dir`` holds none of them but the torchvision
    layout ``data_dir/MNIST/raw`` does, that is used. Images come back as ``uint8`` tensors of shape
    ``(N, H, W)`` and labels as ``uint8`` tensors of shape ``(N,)``; nothing is normalised here.

    Raises:
        DataError: ``data_dir`` is not a directory, a file is missing, malformed (see :func:`read_idx`),
            has the wrong number of dimensions, an image file and its label file disagree on the number
            of samples, or a label is not in ``0..9``. The message names the file or directory and says
            how to fix it.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        problem = "is not a directory (found a file)" if data_dir.exists() else "does not exist"
        raise DataError(f"MNIST data directory {str(data_dir)!r} {problem}; "
                        f"pass --data-dir pointing at a directory holding {_listing()}")
    root = _find_root(data_dir)
    splits = []
    for split in ("train", "test"):
        images_path = _find_file(root, IMAGE_FILES[split])
        labels_path = _find_file(root, LABEL_FILES[split])
        images = read_idx(images_path)
        labels = read_idx(labels_path)
        if images.dim() != 3:
            raise DataError(f"MNIST image file {str(images_path)!r} has shape {tuple(images.shape)}, "
                            f"expected 3 dimensions (count, height, width); it may be a label file "
                            f"under the wrong name, {REDOWNLOAD}")
        if labels.dim() != 1:
            raise DataError(f"MNIST label file {str(labels_path)!r} has shape {tuple(labels.shape)}, "
                            f"expected 1 dimension (count); it may be an image file under the wrong "
                            f"name, {REDOWNLOAD}")
        if images.shape[0] == 0 or images.shape[1] == 0 or images.shape[2] == 0:
            raise DataError(f"MNIST image file {str(images_path)!r} has shape {tuple(images.shape)}, "
                            f"expected at least one non-empty image; {REDOWNLOAD}")
        if images.shape[0] != labels.shape[0]:
            raise DataError(f"MNIST label file {str(labels_path)!r} holds {labels.shape[0]} labels but "
                            f"image file {images_path.name!r} holds {images.shape[0]} images, expected "
                            f"equal counts; the two files come from different downloads, re-download "
                            f"both")
        top = int(labels.max())
        if top >= NUM_CLASSES:
            raise DataError(f"MNIST label file {str(labels_path)!r} holds label {top}, expected labels "
                            f"0..{NUM_CLASSES - 1}; {REDOWNLOAD}")
        splits.append((images, labels))
    (train_x, train_y), (test_x, test_y) = splits
    return train_x, train_y, test_x, test_y


def _find_root(data_dir: Path) -> Path:
    """``data_dir``, or its torchvision-style ``MNIST/raw`` folder if only that holds the files."""
    nested = data_dir / "MNIST" / "raw"
    if not _holds_any(data_dir) and nested.is_dir() and _holds_any(nested):
        return nested
    return data_dir


def _holds_any(directory: Path) -> bool:
    return any((directory / name).is_file() or (directory / f"{name}.gz").is_file()
               for name in MNIST_FILES)


def _find_file(directory: Path, name: str) -> Path:
    for candidate in (directory / name, directory / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise DataError(f"MNIST file {name!r} (or {name + '.gz'!r}) is missing from {str(directory)!r}; "
                    f"pass --data-dir pointing at a directory holding {_listing()}")


def _listing() -> str:
    return ", ".join(f"{name}[.gz]" for name in MNIST_FILES)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__

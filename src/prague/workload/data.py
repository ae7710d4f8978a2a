"""Data sets as in-memory tensors, and the deterministic sharding every training method shares.

Four data sets, chosen with :func:`load_dataset`:

* ``digits``: scikit-learn's bundled 8x8 handwritten digits (1,797 images, offline), a seeded,
  class-stratified 80/20 train/test split, standardised with the training split's mean and std. Each seed's
  split is kept in prague's cache folder after its first load (``~/.cache/prague``).
* ``mnist``: MNIST from a local directory in the standard IDX layout (see :mod:`prague.workload.mnist`),
  normalised with the usual constants ``((x / 255) - 0.1307) / 0.3081``.
* ``synthetic``: seeded Gaussian class prototypes plus noise at CIFAR's shape 3x32x32
  (:func:`make_synthetic`), for model-size and throughput experiments without any file.
* ``pytext``: text, for the ``gpt`` model: the first 2 MB of this Python's standard library sources (every
  Python ships them; the same bytes on machines with the same Python) cut into windows of 64 bytes; a
  sample is a window, its labels the 64 bytes that follow each of its bytes (:func:`load_text`).

Sharding is a pure function of ``(n_samples, rank, world_size, seed)`` (:func:`shard_indices`) and a
batch is a pure function of ``(rank, step)`` for a given loader configuration (:meth:`ShardLoader.batch`),
so every rank can compute its own data without communication, every algorithm sees the same samples
at the same step, and a test can rebuild the union of all ranks' batches in one process.
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from prague.errors import ConfigError, DataError, unknown_choice
from prague.workload.catalog import DATASETS as CATALOG
from prague.io import atomic_write_bytes
from prague.workload.catalog import (TEXT_BYTES, TEXT_CONTEXT, TEXT_TEST_WINDOWS, check_seed, dataset_info,
                                     digits_split_file, steps_per_epoch)
from prague.workload.mnist import load_mnist

__all__ = [
    "DATASETS",
    "Dataset",
    "ShardLoader",
    "load_dataset",
    "make_synthetic",
    "shard_indices",
]

DATASETS = tuple(CATALOG)

MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
DIGITS_TEST_FRACTION = 0.2
DIGITS_MAX_PIXEL = 16.0


@dataclass(frozen=True, eq=False)
class Dataset:
    """A classification data set held in memory, ready for a model: images, or text.

    Attributes:
        name: the name it was loaded under (one of :data:`DATASETS` for built-in ones).
        train_x, test_x: images, ``float32`` tensors of shape ``(N, C, H, W)``; or text, ``int64`` tokens
            of shape ``(N, T)``.
        train_y, test_y: ``int64`` tensors of shape ``(N,)`` (images: one class each) or ``(N, T)`` (text:
            each token's next one), with values in ``0..num_classes-1``. Accuracy and loss are means over
            their elements (:attr:`test_targets` of them in the test split).
        input_shape: ``(C, H, W)`` of one image, or ``(T,)`` of one window of text.
        num_classes: number of classes (text: the vocabulary).

    Construction checks that all of the above agree and raises :class:`~prague.errors.ConfigError`
    otherwise. Equality is identity (tensors have no single truth value).
    """

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    input_shape: tuple[int, ...]
    num_classes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_shape", tuple(int(d) for d in self.input_shape))
        if len(self.input_shape) not in (1, 3) or any(d < 1 for d in self.input_shape):
            raise ConfigError(f"data set {self.name!r}: input_shape {self.input_shape!r} must be three "
                              f"positive sizes (C, H, W) for images or one (T,) for text")
        if self.num_classes < 2:
            raise ConfigError(f"data set {self.name!r}: num_classes {self.num_classes!r} must be at "
                              f"least 2")
        dtype = torch.int64 if self.text else torch.float32
        for split, x, y in (("train", self.train_x, self.train_y), ("test", self.test_x, self.test_y)):
            if x.dtype != dtype or tuple(x.shape[1:]) != tuple(self.input_shape):
                raise ConfigError(f"data set {self.name!r}: {split}_x has dtype {x.dtype} and shape "
                                  f"{tuple(x.shape)}, expected {str(dtype).removeprefix('torch.')} of shape (N, "
                                  f"{', '.join(map(str, self.input_shape))})")
            want = tuple(x.shape) if self.text else (x.shape[0],)
            if y.dtype != torch.int64 or tuple(y.shape) != want:
                raise ConfigError(f"data set {self.name!r}: {split}_y has dtype {y.dtype} and shape "
                                  f"{tuple(y.shape)}, expected int64 of shape {want} to match "
                                  f"{split}_x")
            if x.shape[0] == 0:
                raise ConfigError(f"data set {self.name!r}: the {split} split is empty; it needs at "
                                  f"least one sample")
            low, high = int(y.min()), int(y.max())
            if low < 0 or high >= self.num_classes:
                raise ConfigError(f"data set {self.name!r}: {split}_y holds labels {low}..{high}, "
                                  f"expected 0..{self.num_classes - 1}")

    @property
    def text(self) -> bool:
        """Whether the samples are windows of text (``(T,)`` tokens) rather than images."""
        return len(self.input_shape) == 1

    @property
    def test_targets(self) -> int:
        """How many predictions the test split scores: its samples (images) or its tokens (text)."""
        return self.test_y.numel()


def load_dataset(name: str, data_dir: Path | None = None, seed: int = 0) -> Dataset:
    """Load the built-in data set ``name`` (one of :data:`DATASETS`) into memory.

    ``seed`` fixes the digits train/test split and the synthetic data; MNIST has a fixed split and
    ignores it. Every rank may call this independently and gets identical tensors for equal arguments.

    Raises:
        ConfigError: ``name`` is unknown (the message lists the valid ones), ``seed`` is outside
            ``[0, 2**32)``, or
            ``name`` is ``"mnist"`` and ``data_dir`` is ``None``.
        DataError: the MNIST files are missing or malformed (see :func:`prague.workload.mnist.load_mnist`).
    """
    if name not in DATASETS:
        raise unknown_choice("data set", name, DATASETS)
    check_seed(seed)
    if name == "digits":
        return _load_digits(seed)
    if name == "mnist":
        if data_dir is None:
            raise ConfigError("data set 'mnist' needs its files: --data-dir is required for mnist; pass "
                              "--data-dir pointing at a directory holding train-images-idx3-ubyte[.gz] "
                              "and the other three MNIST files")
        return _load_mnist(Path(data_dir))
    if name == "pytext":
        return load_text(standard_library_text())
    return make_synthetic(seed)


def standard_library_text() -> bytes:
    """The first :data:`~prague.workload.catalog.TEXT_BYTES` bytes of this Python's standard library
    sources (its ``*.py`` files in name order); DataError if it holds fewer than ``pytext`` needs."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        chunks.append(path.read_bytes())
        size += len(chunks[-1])
        if size >= TEXT_BYTES:
            return b"".join(chunks)[:TEXT_BYTES]
    raise DataError(f"data set 'pytext': the standard library in {str(stdlib)!r} holds {size} bytes of *.py "
                    f"sources, fewer than the {TEXT_BYTES} it needs; use a full Python installation")


def load_text(text: bytes, context: int = TEXT_CONTEXT, test_windows: int = TEXT_TEST_WINDOWS,
              name: str = "pytext") -> Dataset:
    """Text as a data set of byte tokens (vocabulary 256): ``text`` cut into windows of ``context`` bytes,
    each with the ``context`` bytes one further as its labels (the next byte of each); the last tenth of
    the windows is held out, at most ``test_windows`` of them (the first of that tenth), and the rest
    trained on. Pure."""
    if context < 1 or test_windows < 1:
        raise ConfigError(f"text windows of {context} bytes, {test_windows} held out: both must be >= 1")
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
    windows = (len(tokens) - 1) // context
    held = windows // 10
    if held < 1:
        raise ConfigError(f"data set {name!r}: {len(tokens)} bytes make {windows} windows of {context}; "
                          "it needs at least 10 to hold one out")
    rows = tokens[:windows * context + 1].unfold(0, context + 1, context)  # (windows, context + 1), overlapping by one
    x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    train, test = slice(0, windows - held), slice(windows - held, windows - held + min(held, test_windows))
    return Dataset(name=name, train_x=x[train], train_y=y[train], test_x=x[test], test_y=y[test],
                   input_shape=(context,), num_classes=256)


def make_synthetic(
    seed: int = 0,
    *,
    n_train: int = 8192,
    n_test: int = 2048,
    input_shape: tuple[int, int, int] = (3, 32, 32),
    num_classes: int = 10,
    noise_std: float = 12.0,
) -> Dataset:
    """Generate a learnable classification data set from ``seed`` alone.

    Each class has a smooth random prototype image (Gaussian noise at 1/4 resolution, upsampled
    bilinearly and scaled to unit variance); a sample is its class's prototype plus i.i.d. Gaussian
    noise of std ``noise_std``, and the whole is scaled to about unit variance. Classes are balanced
    and shuffled. With the defaults a nearest-centroid classifier reaches about 99% test accuracy and a
    small MLP about 85% after one epoch, so accuracy keeps improving over several epochs.

    Raises:
        ConfigError: a size is not positive or ``noise_std`` is negative.
    """
    check_seed(seed)
    for label, value in (("n_train", n_train), ("n_test", n_test)):
        if value < 1:
            raise ConfigError(f"synthetic data: {label}={value!r} must be at least 1")
    if len(input_shape) != 3 or any(d < 1 for d in input_shape):
        raise ConfigError(f"synthetic data: input_shape {input_shape!r} must be three positive sizes "
                          f"(C, H, W)")
    if num_classes < 2:
        raise ConfigError(f"synthetic data: num_classes={num_classes!r} must be at least 2")
    if not (noise_std >= 0 and math.isfinite(noise_std)):
        raise ConfigError(f"synthetic data: noise_std={noise_std!r} must be a finite number >= 0")
    channels, height, width = input_shape
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, channels, max(1, height // 4), max(1, width // 4), generator=gen)
    prototypes = F.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)
    prototypes = prototypes / prototypes.std().clamp_min(1e-12)
    total = n_train + n_test
    labels = (torch.arange(total) % num_classes)[torch.randperm(total, generator=gen)]
    noise = torch.randn(total, channels, height, width, generator=gen)
    x = (prototypes[labels] + noise_std * noise) / math.sqrt(1.0 + noise_std**2)
    return Dataset(
        name="synthetic",
        train_x=x[:n_train].contiguous(),
        train_y=labels[:n_train].contiguous(),
        test_x=x[n_train:].contiguous(),
        test_y=labels[n_train:].contiguous(),
        input_shape=(channels, height, width),
        num_classes=num_classes,
    )


_DIGITS_SPLIT = ("train_x", "test_x", "train_y", "test_y")


def _digits_split(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's digits in ``seed``'s class-stratified split (images scaled to [0, 1]): kept in the cache
    (:func:`prague.workload.catalog.digits_split_file`) after the first load, since importing scikit-learn
    takes longer than a short run's training. A kept file that cannot be read is made again; a cache that
    cannot be written is skipped."""
    kept = digits_split_file(seed)
    if kept is not None:
        try:
            with np.load(kept) as npz:
                arrays = tuple(npz[k] for k in _DIGITS_SPLIT)
            if arrays[0].shape[1:] == (8, 8) and len(arrays[0]) == len(arrays[2]) == dataset_info("digits").train_samples:
                return arrays  # type: ignore[return-value]
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            pass
    # Imported here: scikit-learn is slow to import and only this data set needs it.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = np.asarray(bunch.images, dtype=np.float32) / DIGITS_MAX_PIXEL
    labels = np.asarray(bunch.target, dtype=np.int64)
    split = train_test_split(images, labels, test_size=DIGITS_TEST_FRACTION, random_state=seed, stratify=labels)
    if kept is not None:
        buffer = io.BytesIO()
        np.savez(buffer, **dict(zip(_DIGITS_SPLIT, split)))
        try:
            atomic_write_bytes(kept, buffer.getvalue())
        except OSError:  # a read-only home: load from scikit-learn each time
            pass
    return tuple(split)  # type: ignore[return-value]


def _load_digits(seed: int) -> Dataset:
    train_x, test_x, train_y, test_y = _digits_split(seed)
    # One mean and std for all pixels (per-pixel std is zero at the always-blank borders).
    mean, std = float(train_x.mean()), float(train_x.std())
    height, width = train_x.shape[1:]

    def prepare(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy((x - mean) / std).to(torch.float32).unsqueeze(1).contiguous()

    return Dataset(
        name="digits",
        train_x=prepare(train_x),
        train_y=torch.from_numpy(train_y).contiguous(),
        test_x=prepare(test_x),
        test_y=torch.from_numpy(test_y).contiguous(),
        input_shape=(1, int(height), int(width)),
        num_classes=10,
    )


def _load_mnist(data_dir: Path) -> Dataset:
    train_x, train_y, test_x, test_y = load_mnist(data_dir)

    def prepare(x: torch.Tensor) -> torch.Tensor:
        return ((x.to(torch.float32) / 255.0 - MNIST_MEAN) / MNIST_STD).unsqueeze(1).contiguous()

    height, width = int(train_x.shape[1]), int(train_x.shape[2])
    if tuple(test_x.shape[1:]) != (height, width):
        raise DataError(f"MNIST in {str(data_dir)!r}: train images are {height}x{width} but test "
                          f"images are {test_x.shape[1]}x{test_x.shape[2]}, expected equal sizes; "
                          f"re-download the files")
    return Dataset(
        name="mnist",
        train_x=prepare(train_x),
        train_y=train_y.to(torch.int64),
        test_x=prepare(test_x),
        test_y=test_y.to(torch.int64),
        input_shape=(1, height, width),
        num_classes=10,
    )


def example_batch(input_shape: tuple[int, ...], num_classes: int, batch_size: int,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and labels of the shapes a model for ``input_shape`` trains on: images ``(B, C, H, W)``
    with a class each, or text ``(B, T)`` tokens with the next token of each (for timing a step)."""
    if len(input_shape) == 1:
        x = torch.randint(0, num_classes, (batch_size, *input_shape), generator=generator)
        return x, torch.randint(0, num_classes, x.shape, generator=generator)
    return (torch.randn(batch_size, *input_shape, generator=generator),
            torch.randint(0, num_classes, (batch_size,), generator=generator))


def shard_indices(n_samples: int, rank: int, world_size: int, seed: int) -> torch.Tensor:
    """Indices of the training samples that worker ``rank`` of ``world_size`` owns.

    A permutation of ``range(n_samples)`` drawn from ``seed`` is dealt round-robin: rank ``r`` gets
    ``perm[r::world_size]``. The shards of all ranks are disjoint and cover every index; their sizes
    differ by at most one. Pure: equal arguments give equal results on every process.

    Raises:
        ConfigError: ``n_samples`` < 1, ``world_size`` < 1, ``rank`` outside ``[0, world_size)``, or
            ``seed`` outside ``[0, 2**32)``.
    """
    _check_world(rank, world_size)
    if n_samples < 1:
        raise ConfigError(f"n_samples={n_samples!r} must be at least 1 to shard a data set")
    check_seed(seed)
    perm = torch.randperm(n_samples, generator=torch.Generator().manual_seed(seed))
    return perm[rank::world_size].clone()


class ShardLoader:
    """Mini-batches of one rank's shard, addressed by global step number.

    Construct one per rank with the full training tensors; the rank keeps only its shard
    (:func:`shard_indices`). :meth:`batch` returns the batch for any step in any order, as a pure
    function of the constructor arguments and ``step``: epoch ``step // steps_per_epoch`` reshuffles the
    shard with a generator seeded from ``(seed, rank, epoch)`` and cuts it into batches of
    ``batch_size``, dropping the incomplete tail.

    ``steps_per_epoch`` is computed from the smallest shard, ``(n_samples // world_size) //
    batch_size``, so that every rank agrees on it even when shard sizes differ by one; the rank with a
    larger shard leaves one different sample out each epoch.

    Raises (at construction):
        ConfigError: ``x`` and ``y`` disagree on the number of samples, ``batch_size`` < 1, an invalid
            ``rank``/``world_size``/``seed``, or a shard smaller than one batch (lower ``--batch-size``
            or ``--nproc``).
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        rank: int,
        world_size: int,
        batch_size: int,
        seed: int = 0,
    ) -> None:
        if x.dim() < 1 or y.dim() < 1 or x.shape[0] != y.shape[0]:
            raise ConfigError(f"ShardLoader: inputs of shape {tuple(x.shape)} and labels of shape "
                              f"{tuple(y.shape)} must have the same number of samples (first dimension)")
        if batch_size < 1:
            raise ConfigError(f"batch size {batch_size!r} must be at least 1; pass a positive --batch-size")
        self.shard = shard_indices(int(x.shape[0]), rank, world_size, seed)
        steps = steps_per_epoch(int(x.shape[0]), world_size, batch_size)
        self.x = x
        self.y = y
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size
        self.seed = seed
        self._steps_per_epoch = steps
        self._cached_epoch = -1
        self._cached_order = self.shard

    @property
    def steps_per_epoch(self) -> int:
        """Number of full batches per epoch; the same on every rank."""
        return self._steps_per_epoch

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """Sample indices of this rank's shard in the order used during ``epoch`` (all of the shard)."""
        if epoch < 0:
            raise ConfigError(f"epoch {epoch!r} must be >= 0")
        if epoch != self._cached_epoch:
            gen = torch.Generator().manual_seed(_mix_seed(self.seed, self.rank, epoch))
            self._cached_order = self.shard[torch.randperm(len(self.shard), generator=gen)]
            self._cached_epoch = epoch
        return self._cached_order

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and labels of this rank's batch at global step ``step`` (0-based), ``batch_size`` long.

        Raises:
            ConfigError: ``step`` is negative.
        """
        if step < 0:
            raise ConfigError(f"step {step!r} must be >= 0")
        epoch, index = divmod(step, self._steps_per_epoch)
        start = index * self.batch_size
        rows = self.epoch_order(epoch)[start:start + self.batch_size]
        return self.x[rows], self.y[rows]

    def samples(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and labels of ``count`` samples of this rank's shard from sample position ``start`` on
        (positions run through the epochs' orders, ``steps_per_epoch * batch_size`` an epoch, as the batches
        do): a batch of another size (``allreduce:balanced``)."""
        rows = _positions(start, count, self._steps_per_epoch * self.batch_size, self.epoch_order)
        return self.x[rows], self.y[rows]


class GlobalBatches:
    """Mini-batches of the whole training set, addressed by a job-wide batch index (the job-wide budget,
    :mod:`prague.workload.budget`).

    Epoch e is a permutation of every training sample drawn from ``(seed, e)``, cut into
    ``batches_per_epoch = n_samples // batch_size`` full batches (the incomplete tail is left out, a
    different one each epoch); batch ``g`` is batch ``g mod batches_per_epoch`` of epoch ``g div
    batches_per_epoch``. Whichever worker takes batch g gets the same samples, so the workers of a job
    together use every sample once per epoch however unequally they share the batches.

    Raises (at construction): ConfigError when ``x`` and ``y`` disagree, ``batch_size`` < 1 or larger
    than the training set, or ``seed`` is invalid.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int = 0) -> None:
        if x.dim() < 1 or y.dim() < 1 or x.shape[0] != y.shape[0]:
            raise ConfigError(f"GlobalBatches: inputs of shape {tuple(x.shape)} and labels of shape "
                              f"{tuple(y.shape)} must have the same number of samples (first dimension)")
        check_seed(seed)
        if not 1 <= batch_size <= x.shape[0]:
            raise ConfigError(f"batch size {batch_size!r} must be in 1..{x.shape[0]} (the training samples); "
                              "pass another --batch-size")
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed
        self.batches_per_epoch = int(x.shape[0]) // batch_size
        self._cached_epoch = -1
        self._order = torch.arange(0)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """Every training sample's index, in the order of ``epoch``."""
        if epoch < 0:
            raise ConfigError(f"epoch {epoch!r} must be >= 0")
        if epoch != self._cached_epoch:
            gen = torch.Generator().manual_seed(_mix_seed(self.seed, 1 << 30, epoch))
            self._order = torch.randperm(int(self.x.shape[0]), generator=gen)
            self._cached_epoch = epoch
        return self._order

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and labels of job-wide batch ``index`` (0-based), ``batch_size`` long."""
        if index < 0:
            raise ConfigError(f"batch index {index!r} must be >= 0")
        epoch, i = divmod(index, self.batches_per_epoch)
        rows = self.epoch_order(epoch)[i * self.batch_size:(i + 1) * self.batch_size]
        return self.x[rows], self.y[rows]

    def samples(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and labels of ``count`` samples from job-wide sample position ``start`` on: batch ``g``
        is positions ``g * batch_size`` to ``(g + 1) * batch_size - 1``, so a step's batches can be cut
        into shares of other sizes (``allreduce:balanced``) and every sample is still used once an epoch."""
        rows = _positions(start, count, self.batches_per_epoch * self.batch_size, self.epoch_order)
        return self.x[rows], self.y[rows]


def _positions(start: int, count: int, per_epoch: int, order: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The sample indices at positions ``start .. start + count - 1`` of the epochs' orders (``per_epoch``
    positions each; ``order(e)`` the samples of epoch e in order), across epoch ends."""
    if start < 0 or count < 1:
        raise ConfigError(f"samples from position {start!r}, {count!r} of them: need start >= 0 and count >= 1")
    parts, at, left = [], start, count
    while left:
        epoch, offset = divmod(at, per_epoch)
        take = min(left, per_epoch - offset)
        parts.append(order(epoch)[offset:offset + take])
        at, left = at + take, left - take
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _mix_seed(seed: int, rank: int, epoch: int) -> int:
    """A 63-bit seed that differs for every ``(seed, rank, epoch)``, well mixed (NumPy's SeedSequence)."""
    state = np.random.SeedSequence([seed, rank, epoch]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def _check_world(rank: int, world_size: int) -> None:
    if world_size < 1:
        raise ConfigError(f"world size {world_size!r} must be at least 1; pass a positive --nproc")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank!r} must be in [0, {world_size}) for world size {world_size}")

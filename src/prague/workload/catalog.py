"""Facts about the built-in data sets and models, without loading either (no torch, no scikit-learn).

The launcher, the CLI and the simulator need a data set's shape and size (for ``--epochs``, and for the
size of the model a simulated worker moves) without loading it; :mod:`.data` and :mod:`.models` build
the real things and a test checks that they agree with these facts.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
from dataclasses import dataclass
from pathlib import Path

from prague.errors import ConfigError, unknown_choice

MODELS = ("mlp", "cnn", "resnet18", "gpt")
#: The models that read text (token sequences); the others read images.
TEXT_MODELS = ("gpt",)
COMPUTE_MODES = ("real", "paced", "emulated")
#: The workers' optimizers (``--optimizer``): ``torch.optim.SGD`` with ``--momentum``, or ``torch.optim.AdamW``
#: with its own defaults (betas 0.9 and 0.999, weight decay 0.01), what transformers are trained with.
OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class DatasetInfo:
    """One built-in data set: the shape of a sample ((C, H, W) for images, (T,) for text: T tokens), its
    classes (text: the vocabulary, each token's next one is a class), its training-set size (samples:
    images, or windows of T tokens)."""

    input_shape: tuple[int, ...]
    num_classes: int
    train_samples: int

    @property
    def text(self) -> bool:
        return len(self.input_shape) == 1


#: ``pytext``: the first TEXT_BYTES bytes of this Python's standard library sources (its ``*.py`` files in
#: name order), cut into windows of TEXT_CONTEXT characters; the last tenth, at most TEXT_TEST_WINDOWS
#: windows, is held out.
TEXT_BYTES = 2_000_000
TEXT_CONTEXT = 64
TEXT_WINDOWS = (TEXT_BYTES - 1) // TEXT_CONTEXT
TEXT_TEST_WINDOWS = min(TEXT_WINDOWS // 10, 512)

DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo((1, 8, 8), 10, 1437),  # 1,797 images, 80/20 split
    "mnist": DatasetInfo((1, 28, 28), 10, 60000),
    "synthetic": DatasetInfo((3, 32, 32), 10, 8192),
    "pytext": DatasetInfo((TEXT_CONTEXT,), 256, TEXT_WINDOWS - TEXT_WINDOWS // 10),  # bytes: 256 tokens
}


def dataset_info(name: str) -> DatasetInfo:
    try:
        return DATASETS[name]
    except (KeyError, TypeError):
        raise unknown_choice("data set", name, DATASETS) from None


def check_pairing(model: str, data: str) -> None:
    """Raise ConfigError unless ``model`` reads what ``data`` holds (text or images), naming the fix."""
    info = dataset_info(data)
    if model in TEXT_MODELS and not info.text:
        raise ConfigError(f"model {model!r} reads text, but data set {data!r} holds images; pass --data pytext, or "
                          f"an image model ({', '.join(m for m in MODELS if m not in TEXT_MODELS)})")
    if model not in TEXT_MODELS and info.text:
        raise ConfigError(f"model {model!r} reads images, but data set {data!r} holds text; pass --model "
                          f"{TEXT_MODELS[0]}, or an image data set ({', '.join(d for d, i in DATASETS.items() if not i.text)})")


#: What loading a data set imports beyond torch and NumPy: digits comes from scikit-learn (0.8 s to import).
LOADER_IMPORTS = {"digits": ("sklearn.datasets", "sklearn.model_selection")}


def cache_dir() -> Path:
    """Where prague keeps what it can rebuild: ``~/.cache/prague``."""
    return Path(os.path.expanduser("~")) / ".cache" / "prague"


def digits_split_file(seed: int) -> Path | None:
    """The file that keeps the digits train/test split of ``seed`` (:func:`prague.workload.data.load_dataset`
    writes it on first use), named by scikit-learn's version, which makes the split; None without
    scikit-learn."""
    try:
        version = importlib.metadata.version("scikit-learn")
    except importlib.metadata.PackageNotFoundError:
        return None
    return cache_dir() / f"digits-split-sklearn{version}-seed{seed}.npz"


def loader_imports(name: str, seed: int) -> tuple[str, ...]:
    """The modules loading data set ``name`` with ``seed`` imports (none once the digits split of ``seed``
    is kept), for the worker fork server to preload (:mod:`prague.runtime.forkserver`)."""
    if name == "digits":
        kept = digits_split_file(seed)
        if kept is not None and kept.is_file():
            return ()
    return LOADER_IMPORTS.get(name, ())


#: Seeds are below 2**32, the bound of scikit-learn's and NumPy's seeds (the digits split uses them).
SEED_LIMIT = 2**32


def check_seed(seed: int) -> None:
    """Raise ConfigError unless ``seed`` is in ``[0, 2**32)``."""
    if not 0 <= seed < SEED_LIMIT:
        raise ConfigError(f"seed {seed!r} must be in [0, 2**32); pass such a --seed")


def steps_per_epoch(train_samples: int, world_size: int, batch_size: int) -> int:
    """Full batches per epoch of each worker: from the smallest shard, so every rank agrees
    (:class:`prague.workload.data.ShardLoader` cuts its batches this way)."""
    per_rank = train_samples // world_size
    steps = per_rank // batch_size
    if steps == 0:
        raise ConfigError(f"batch size {batch_size} is larger than the {per_rank} samples each of the "
                          f"{world_size} workers holds ({train_samples} in all), so an epoch would have "
                          f"0 steps; lower --batch-size to at most {per_rank} or lower --nproc")
    return steps


def epoch_steps(epochs: float, per_epoch: int) -> int:
    """Steps of ``epochs`` passes of ``per_epoch`` steps each: a partial step counts as one, float error
    does not (1.1 x 50 is 55.00000000000001 in floating point, and 55 steps); at least 1."""
    return max(1, math.ceil(round(epochs * per_epoch, 6)))

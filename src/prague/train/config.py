"""The settings of one training run, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prague.errors import ConfigError, unknown_choice

COMPUTE_MODES = ("real", "emulated")
DATASET_NAMES = ("digits", "mnist", "synthetic")
MODEL_NAMES = ("mlp", "cnn", "resnet18")


@dataclass(frozen=True)
class RunConfig:
    """One run of one method: what ``prague run`` and ``prague worker`` read from their flags.

    ``algorithm`` may carry a variant (``prague:smart``). ``steps`` is per worker; when it is None the
    run lasts ``epochs`` passes over each worker's shard. ``options`` holds the method-specific flags.
    """

    algorithm: str = "allreduce"
    nproc: int = 1
    epochs: float | None = None
    steps: int | None = None
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    model: str = "mlp"
    data: str = "digits"
    data_dir: Path | None = None
    compute: str = "real"
    compute_ms: float = 100.0
    scenario: str = "homogeneous"
    seed: int = 0
    out: Path = Path("runs/latest")
    target_accuracy: float | None = None
    eval_every: int | None = None
    warmup_steps: int | None = None
    timeout_s: float = 300.0
    backend: str = "auto"
    save_model: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {self.nproc}")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.epochs is not None and not self.epochs > 0:
            raise ConfigError(f"--epochs must be > 0, got {self.epochs}")
        if self.steps is not None and self.epochs is not None:
            raise ConfigError("give either --steps or --epochs, not both")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.model not in MODEL_NAMES:
            raise unknown_choice("model", self.model, MODEL_NAMES)
        if self.data not in DATASET_NAMES:
            raise unknown_choice("data set", self.data, DATASET_NAMES)
        if self.compute not in COMPUTE_MODES:
            raise unknown_choice("compute mode", self.compute, COMPUTE_MODES)
        if not self.compute_ms >= 0:
            raise ConfigError(f"--compute-ms must be >= 0, got {self.compute_ms}")
        if self.data == "mnist" and self.data_dir is None:
            raise ConfigError("--data mnist needs --data-dir pointing at a directory of MNIST IDX files")
        if self.data_dir is not None and not Path(self.data_dir).is_dir():
            raise ConfigError(f"--data-dir {str(self.data_dir)!r} is not a directory; pass the folder holding the data files")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ConfigError(f"--target-accuracy must be in (0, 1], got {self.target_accuracy}")
        if self.eval_every is not None and self.eval_every < 1:
            raise ConfigError(f"--eval-every must be >= 1, got {self.eval_every}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if not self.timeout_s > 0:
            raise ConfigError(f"--timeout-s must be > 0, got {self.timeout_s}")

    @property
    def emulated(self) -> bool:
        return self.compute == "emulated"

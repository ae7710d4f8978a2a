"""Data sets and sharding: shapes, seeding, and that ranks' shards and batches partition the data."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prague.errors import ConfigError, DataError
from prague.workload.catalog import DATASETS as CATALOG
from prague.workload.catalog import LOADER_IMPORTS, check_pairing, digits_split_file, loader_imports
from prague.workload.data import (
    DATASETS,
    Dataset,
    ShardLoader,
    example_batch,
    load_dataset,
    load_text,
    make_synthetic,
    shard_indices,
)
from prague.workload.mnist import MNIST_FILES


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset("digits", seed=0)


def test_digits_shapes_and_normalisation(digits: Dataset) -> None:
    assert digits.name == "digits"
    assert digits.input_shape == (1, 8, 8) and digits.num_classes == 10
    assert digits.train_x.shape == (1437, 1, 8, 8) and digits.test_x.shape == (360, 1, 8, 8)
    assert digits.train_y.shape == (1437,) and digits.test_y.shape == (360,)
    assert digits.train_x.dtype == torch.float32 and digits.train_y.dtype == torch.int64
    assert abs(float(digits.train_x.mean())) < 1e-4
    assert abs(float(digits.train_x.std()) - 1.0) < 1e-2
    # Stratified: every class in both splits.
    assert set(digits.train_y.tolist()) == set(digits.test_y.tolist()) == set(range(10))


def test_digits_split_is_seeded(digits: Dataset) -> None:
    again = load_dataset("digits", seed=0)
    other = load_dataset("digits", seed=1)
    assert torch.equal(again.train_x, digits.train_x) and torch.equal(again.test_y, digits.test_y)
    assert not torch.equal(other.train_x, digits.train_x)


def test_a_kept_digits_split_is_the_one_scikit_learn_makes_and_a_broken_one_is_made_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first load keeps seed 3's split in the cache folder and says so to the fork server (nothing to
    import); the next load reads it and gets the same tensors; a damaged file is replaced; a cache folder
    that cannot be written only costs the import."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    kept = digits_split_file(3)
    assert kept is not None and kept.parent == tmp_path / "home" / ".cache" / "prague" and not kept.exists()
    assert loader_imports("digits", 3) == LOADER_IMPORTS["digits"]
    first = load_dataset("digits", seed=3)
    assert kept.is_file() and loader_imports("digits", 3) == () and loader_imports("digits", 4) != ()
    assert loader_imports("mnist", 3) == ()
    kept.write_bytes(kept.read_bytes()[:100])  # a truncated file
    again = load_dataset("digits", seed=3)
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(again, name), getattr(first, name)), name
    with np.load(kept) as npz:
        assert npz["train_x"].shape == (1437, 8, 8)  # made again
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / ".cache").write_text("a file where the cache folder would be")
    monkeypatch.setenv("HOME", str(tmp_path / "ro"))
    assert torch.equal(load_dataset("digits", seed=3).test_x, first.test_x)


def test_synthetic_is_seeded_and_shaped() -> None:
    first = make_synthetic(3, n_train=200, n_test=50)
    again = make_synthetic(3, n_train=200, n_test=50)
    other = make_synthetic(4, n_train=200, n_test=50)
    assert first.input_shape == (3, 32, 32) and first.num_classes == 10
    assert first.train_x.shape == (200, 3, 32, 32) and first.test_x.shape == (50, 3, 32, 32)
    assert torch.equal(first.train_x, again.train_x) and torch.equal(first.test_y, again.test_y)
    assert not torch.equal(first.train_x, other.train_x)
    assert torch.bincount(first.train_y, minlength=10).min() >= 18  # balanced classes


def test_synthetic_defaults_and_learnability() -> None:
    data = load_dataset("synthetic", seed=0)
    assert data.train_x.shape == (8192, 3, 32, 32) and data.test_x.shape == (2048, 3, 32, 32)
    assert data.train_y.dtype == torch.int64 and abs(float(data.train_x.std()) - 1.0) < 0.05
    # Learnable: nearest class mean of the training split classifies the test split well.
    centroids = torch.stack([data.train_x[data.train_y == k].mean(0) for k in range(10)]).flatten(1)
    predicted = torch.cdist(data.test_x.flatten(1), centroids).argmin(1)
    assert float((predicted == data.test_y).float().mean()) > 0.9


def test_unknown_data_set_lists_choices() -> None:
    with pytest.raises(ConfigError, match="unknown data set 'cifar'; valid choices: digits, mnist, pytext, synthetic"):
        load_dataset("cifar")
    assert DATASETS == ("digits", "mnist", "synthetic", "pytext")


def test_mnist_needs_data_dir() -> None:
    with pytest.raises(ConfigError, match="--data-dir is required for mnist"):
        load_dataset("mnist")


def test_mnist_missing_dir_is_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nowhere"):
        load_dataset("mnist", data_dir=tmp_path / "nowhere")


def test_mnist_normalised(tmp_path: Path) -> None:
    counts = {MNIST_FILES[0]: (4, 28, 28), MNIST_FILES[1]: (4,), MNIST_FILES[2]: (2, 28, 28),
              MNIST_FILES[3]: (2,)}
    for name, shape in counts.items():
        array = np.full(shape, 255 if len(shape) == 3 else 7, dtype=np.uint8)
        header = bytes([0, 0, 8, len(shape)]) + struct.pack(f">{len(shape)}I", *shape)
        (tmp_path / f"{name}.gz").write_bytes(gzip.compress(header + array.tobytes()))
    data = load_dataset("mnist", data_dir=tmp_path)
    assert data.input_shape == (1, 28, 28) and data.train_x.shape == (4, 1, 28, 28)
    assert data.train_y.dtype == torch.int64 and data.train_y.tolist() == [7, 7, 7, 7]
    assert torch.allclose(data.test_x, torch.full((2, 1, 28, 28), (1.0 - 0.1307) / 0.3081))


def test_negative_seed_rejected() -> None:
    with pytest.raises(ConfigError, match="seed -1"):
        load_dataset("digits", seed=-1)


def test_dataset_validates_shapes() -> None:
    x = torch.zeros(4, 1, 8, 8)
    y = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ConfigError, match="train_x"):
        Dataset("bad", torch.zeros(4, 1, 8, 9), y, x, y, (1, 8, 8), 10)
    with pytest.raises(ConfigError, match="test_y"):
        Dataset("bad", x, y, x, y[:3], (1, 8, 8), 10)
    with pytest.raises(ConfigError, match="labels 0..10"):
        Dataset("bad", x, y, x, torch.tensor([0, 1, 2, 10]), (1, 8, 8), 10)


@settings(max_examples=60, deadline=None)
@given(n_samples=st.integers(1, 300), world_size=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
def test_shards_are_disjoint_and_cover_all_indices(n_samples: int, world_size: int, seed: int) -> None:
    shards = [shard_indices(n_samples, rank, world_size, seed) for rank in range(world_size)]
    joined = torch.cat(shards)
    assert sorted(joined.tolist()) == list(range(n_samples))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_shards_depend_on_seed_only_through_arguments() -> None:
    assert torch.equal(shard_indices(100, 1, 4, 7), shard_indices(100, 1, 4, 7))
    assert not torch.equal(shard_indices(100, 1, 4, 7), shard_indices(100, 1, 4, 8))


@pytest.mark.parametrize("rank, world_size", [(-1, 4), (4, 4), (0, 0)])
def test_shard_rejects_bad_rank(rank: int, world_size: int) -> None:
    with pytest.raises(ConfigError, match="rank|world size"):
        shard_indices(10, rank, world_size, 0)


def _loaders(n: int, world_size: int, batch_size: int, seed: int = 5) -> list[ShardLoader]:
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1)  # sample i holds the value i
    y = torch.arange(n)
    return [ShardLoader(x, y, rank, world_size, batch_size, seed) for rank in range(world_size)]


def test_batch_is_a_pure_function_of_rank_and_step() -> None:
    first, fresh = _loaders(103, 3, 8)[1], _loaders(103, 3, 8)[1]
    steps = [0, 5, 2, 17, 5, 0, 40]  # any order, repeats, several epochs
    for step in steps:
        x_a, y_a = first.batch(step)
        x_b, y_b = fresh.batch(step)
        assert torch.equal(x_a, x_b) and torch.equal(y_a, y_b)
        assert x_a.shape == (8, 1) and torch.equal(x_a[:, 0].long(), y_a)


def test_epochs_partition_each_shard_and_reshuffle() -> None:
    loader = _loaders(103, 3, 8)[2]
    assert loader.steps_per_epoch == (103 // 3) // 8 == 4
    shard = set(loader.shard.tolist())
    epochs = []
    for epoch in range(3):
        labels = [loader.batch(epoch * loader.steps_per_epoch + i)[1] for i in range(loader.steps_per_epoch)]
        seen = torch.cat(labels).tolist()
        assert len(seen) == len(set(seen)) == 32 and set(seen) <= shard  # no sample twice in an epoch
        epochs.append(seen)
    assert epochs[0] != epochs[1] != epochs[2]


def test_all_ranks_together_see_disjoint_samples_each_step() -> None:
    loaders = _loaders(1000, 4, 16, seed=11)
    assert len({loader.steps_per_epoch for loader in loaders}) == 1
    per_epoch: list[int] = []
    for step in range(loaders[0].steps_per_epoch):
        global_batch = torch.cat([loader.batch(step)[1] for loader in loaders])
        assert len(global_batch) == 64
        per_epoch += global_batch.tolist()
    assert len(per_epoch) == len(set(per_epoch)) == 15 * 64


def test_steps_per_epoch_agree_when_shard_sizes_differ() -> None:
    loaders = _loaders(10, 3, 2)  # shards of 4, 3, 3
    assert [len(loader.shard) for loader in loaders] == [4, 3, 3]
    assert [loader.steps_per_epoch for loader in loaders] == [1, 1, 1]


def test_ranks_and_seeds_shuffle_differently() -> None:
    a = _loaders(400, 2, 10, seed=1)
    b = _loaders(400, 2, 10, seed=2)
    assert not torch.equal(a[0].batch(0)[1], b[0].batch(0)[1])
    assert set(a[0].batch(0)[1].tolist()).isdisjoint(a[1].batch(0)[1].tolist())


def test_batch_size_too_large_says_how_to_fix() -> None:
    x, y = torch.zeros(100, 1), torch.zeros(100, dtype=torch.int64)
    with pytest.raises(ConfigError, match=r"25 samples each of the 4 workers.*--batch-size.*--nproc"):
        ShardLoader(x, y, rank=0, world_size=4, batch_size=32, seed=0)


def test_loader_rejects_bad_arguments() -> None:
    x, y = torch.zeros(100, 1), torch.zeros(100, dtype=torch.int64)
    with pytest.raises(ConfigError, match="same number of samples"):
        ShardLoader(x, y[:99], 0, 1, 4, 0)
    with pytest.raises(ConfigError, match="batch size 0"):
        ShardLoader(x, y, 0, 1, 0, 0)
    with pytest.raises(ConfigError, match="rank 2"):
        ShardLoader(x, y, 2, 2, 4, 0)
    with pytest.raises(ConfigError, match="step -1"):
        ShardLoader(x, y, 0, 1, 4, 0).batch(-1)


def test_text_is_cut_into_windows_whose_labels_are_the_next_bytes() -> None:
    text = bytes(range(256)) * 4 + b"tail"  # 1028 bytes: 64 windows of 16, the last byte only a label
    data = load_text(text, context=16, test_windows=3, name="t")
    assert data.text and data.input_shape == (16,) and data.num_classes == 256
    assert data.train_x.shape == (58, 16) and data.test_x.shape == (3, 16)  # a tenth (6) held out, 3 of it kept
    flat = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    for i in (0, 7, 57):
        assert torch.equal(data.train_x[i], flat[16 * i:16 * i + 16])
        assert torch.equal(data.train_y[i], flat[16 * i + 1:16 * i + 17])
    assert torch.equal(data.test_x[0], flat[16 * 58:16 * 59])  # held out after every training window
    assert data.test_targets == 3 * 16
    with pytest.raises(ConfigError, match="needs at least 10"):
        load_text(b"x" * 100, context=16)


def test_pytext_is_the_standard_library_and_agrees_with_the_catalog() -> None:
    data = load_dataset("pytext")
    info = CATALOG["pytext"]
    assert (len(data.train_y), data.input_shape, data.num_classes) == (info.train_samples, info.input_shape, info.num_classes)
    assert data.test_targets == len(data.test_y) * info.input_shape[0]
    assert b"import " in bytes(data.train_x[:200].flatten().tolist())
    again = load_dataset("pytext", seed=5)  # a fixed split, like MNIST's
    assert torch.equal(again.test_x, data.test_x)


def test_a_text_data_set_checks_its_tokens_and_next_tokens() -> None:
    x = torch.zeros(4, 8, dtype=torch.int64)
    with pytest.raises(ConfigError, match=r"train_y has dtype torch.int64 and shape \(4,\), expected int64 of shape \(4, 8\)"):
        Dataset("t", x, torch.zeros(4, dtype=torch.int64), x, x, (8,), 256)
    with pytest.raises(ConfigError, match="expected int64 of shape"):
        Dataset("t", x.float(), x, x, x, (8,), 256)


@pytest.mark.parametrize(("model", "data", "words"), [("gpt", "mnist", "reads text, but data set 'mnist' holds images"),
                                                      ("cnn", "pytext", "pass --model gpt")])
def test_a_model_and_a_data_set_of_different_kinds_are_refused_naming_the_fix(model: str, data: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        check_pairing(model, data)
    check_pairing("gpt", "pytext")
    check_pairing("cnn", "mnist")


def test_an_example_batch_has_the_shapes_a_step_trains_on() -> None:
    x, y = example_batch((12,), 256, 3)
    assert x.shape == y.shape == (3, 12) and x.dtype == torch.int64
    x, y = example_batch((1, 8, 8), 10, 3)
    assert x.shape == (3, 1, 8, 8) and y.shape == (3,) and int(y.max()) < 10

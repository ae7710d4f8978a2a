"""Models: sizes, output shapes on every data set's input shape, and errors for bad names/shapes."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from torch import nn

from prague.errors import ConfigError
from prague.workload.models import MODELS, build_model, parameter_count

# Input shapes of the built-in data sets: digits, mnist, synthetic.
SHAPES = {"digits": (1, 8, 8), "mnist": (1, 28, 28), "synthetic": (3, 32, 32)}


@lru_cache(maxsize=None)
def cached_model(name: str, shape: tuple[int, int, int], classes: int = 10) -> nn.Module:
    """Build each (model, shape) once per session: a ResNet-18 takes about a second to initialise."""
    torch.manual_seed(0)
    return build_model(name, shape, classes)


def test_resnet18_has_the_cifar_parameter_count() -> None:
    assert parameter_count(cached_model("resnet18", (3, 32, 32))) == 11_173_962


def test_small_model_parameter_counts() -> None:
    # flatten(64) -> 128 -> 128 -> 10
    assert parameter_count(build_model("mlp", (1, 8, 8), 10)) == 64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    # conv-pool twice on 28x28: fc input 64 * 7 * 7.
    expected_cnn = (9 * 32 + 32) + (32 * 9 * 64 + 64) + (64 * 7 * 7 * 128 + 128) + (128 * 10 + 10)
    assert parameter_count(build_model("cnn", (1, 28, 28), 10)) == expected_cnn


@pytest.mark.parametrize("data", sorted(SHAPES))
@pytest.mark.parametrize("name", MODELS)
def test_forward_gives_one_logit_per_class(name: str, data: str) -> None:
    model = cached_model(name, SHAPES[data])
    model.train()
    with torch.no_grad():
        out = model(torch.randn(2, *SHAPES[data]))
    assert out.shape == (2, 10) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", MODELS)
def test_odd_and_tiny_shapes_and_backward(name: str) -> None:
    for shape in [(2, 7, 9), (1, 1, 1), (1, 1, 5)]:
        model = cached_model(name, shape)
        model.eval()
        with torch.no_grad():
            assert model(torch.randn(2, *shape)).shape == (2, 10)
    model = cached_model(name, (1, 8, 8))
    model.train()
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 1, 8, 8)), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_same_seed_builds_same_weights() -> None:
    torch.manual_seed(3)
    first = build_model("cnn", (1, 8, 8), 10)
    torch.manual_seed(3)
    second = build_model("cnn", (1, 8, 8), 10)
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)


def test_unknown_model_lists_choices() -> None:
    with pytest.raises(ConfigError, match="unknown model 'vgg'; valid choices: cnn, mlp, resnet18"):
        build_model("vgg", (1, 8, 8), 10)


@pytest.mark.parametrize("shape, classes, words", [((1, 8), 10, "input_shape"), ((0, 8, 8), 10, "input_shape"),
                                                   ((1, 8, 8), 1, "num_classes=1")])
def test_bad_shapes_rejected(shape: tuple[int, ...], classes: int, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        build_model("mlp", shape, classes)  # type: ignore[arg-type]

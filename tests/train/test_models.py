"""Models: sizes, output shapes on every data set's input shape, and errors for bad names/shapes."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from torch import nn

from prague.errors import ConfigError
from prague.train.pacing import Pace
from prague.workload.catalog import TEXT_MODELS
from prague.workload.models import MODELS, build_model, parameter_count

IMAGE_MODELS = tuple(m for m in MODELS if m not in TEXT_MODELS)

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
@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_forward_gives_one_logit_per_class(name: str, data: str) -> None:
    model = cached_model(name, SHAPES[data])
    model.train()
    with torch.no_grad():
        out = model(torch.randn(2, *SHAPES[data]))
    assert out.shape == (2, 10) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", IMAGE_MODELS)
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
    with pytest.raises(ConfigError, match="unknown model 'vgg'; valid choices: cnn, gpt, mlp, resnet18"):
        build_model("vgg", (1, 8, 8), 10)


@pytest.mark.parametrize("shape, classes, words", [((1, 8), 10, "input_shape"), ((0, 8, 8), 10, "input_shape"),
                                                   ((1, 8, 8), 1, "num_classes=1")])
def test_bad_shapes_rejected(shape: tuple[int, ...], classes: int, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        build_model("mlp", shape, classes)  # type: ignore[arg-type]


def test_gpt_predicts_each_next_token_causally_with_the_classes_second() -> None:
    torch.manual_seed(0)
    model = build_model("gpt", (16,), 256)
    assert parameter_count(model) == 16 * 128 + 256 * 128 * 2 + 2 * (12 * 128 * 128 + 13 * 128) + 2 * 128
    tokens = torch.randint(0, 256, (3, 16))
    model.eval()
    with torch.no_grad():
        out = model(tokens)
        assert out.shape == (3, 256, 16) and torch.isfinite(out).all()
        changed = tokens.clone()
        changed[:, 10] = (changed[:, 10] + 1) % 256  # a later token cannot change an earlier prediction
        after = model(changed)
        assert torch.allclose(out[:, :, :10], after[:, :, :10], atol=1e-5)
        assert not torch.allclose(out[:, :, 10:], after[:, :, 10:], atol=1e-5)
        assert model(tokens[:, :5]).shape == (3, 256, 5)  # shorter than the context
    model.train()
    loss = torch.nn.functional.cross_entropy(model(tokens), torch.randint(0, 256, (3, 16)))
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5  # small logits at first
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(ConfigError, match="longer than the model's context of 16"):
        model(torch.zeros(1, 17, dtype=torch.int64))


def test_every_gpt_parameter_gets_its_own_time_on_the_paced_clock() -> None:
    """The paced clock times a gradient by its module's place in the backward pass: every parameter of the
    transformer must sit in a module whose forward runs (no fused attention holding weights it never calls),
    and the blocks' gradients must be ready in the reverse of their order."""
    torch.manual_seed(0)
    model = build_model("gpt", (16,), 256)
    pace = Pace(0.001, rank=0)
    pace.attach(model)
    pace.begin(1.0)
    model(torch.randint(0, 256, (2, 16)))
    pace.pad_rest()
    shares = [pace._shares.get(p.data_ptr()) for p in model.parameters()]
    assert all(s is not None and 0 < s <= 1 for s in shares), shares
    first, last = model.blocks[0].qkv.weight, model.blocks[-1].qkv.weight
    assert pace._shares[last.data_ptr()] < pace._shares[first.data_ptr()] < pace._shares[model.embed.weight.data_ptr()]
    pace.detach()


@pytest.mark.parametrize(("name", "shape", "words"), [("gpt", (1, 8, 8), "one positive size .T tokens.: it reads text"),
                                                      ("cnn", (64,), "three positive sizes .C, H, W.: it reads images")])
def test_a_model_given_the_other_kind_of_input_says_so(name: str, shape: tuple[int, ...], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        build_model(name, shape, 10)

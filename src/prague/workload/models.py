"""The models trained in experiments, built by name for any image shape.

* ``mlp``: flatten, two hidden layers of 128 with ReLU, linear classifier (fast; for tests and demos).
* ``cnn``: the small CNN of PyTorch's MNIST example (two 3x3 convolutions of 32 and 64 channels, 2x2
  max-pool, dropout 0.25, a hidden layer of 128), with padding 1 so that inputs as small as 8x8 work.
* ``resnet18``: ResNet-18 (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016) in its
  CIFAR form: a 3x3 stride-1 stem without max-pool, BasicBlocks [2, 2, 2, 2] at 64/128/256/512
  channels, BatchNorm, global average pooling and a linear classifier; 11,173,962 parameters for
  3x32x32 inputs and 10 classes. Adaptive pooling lets it run on inputs as small as 1x1.
* ``gpt``: a character-level transformer language model for text data (``pytext``) in GPT-2's layout
  (Radford et al., "Language Models are Unsupervised Multitask Learners", 2019): token embeddings and
  learned positions, :data:`GPT_LAYERS` pre-norm blocks of causal self-attention (:data:`GPT_HEADS`
  heads) and a 4x MLP at width :data:`GPT_WIDTH`, a final LayerNorm and a linear head over the
  vocabulary; 470,528 parameters for windows of 64 bytes. It maps tokens ``(B, T)`` to logits
  ``(B, vocabulary, T)``, the classes second as for the image models, so ``F.cross_entropy(model(x), y)``
  with next tokens ``y`` of shape ``(B, T)`` is the language-modelling loss and ``argmax(dim=1)`` the
  predicted next tokens. Every parameter sits in a module of its own (no fused attention module), so the
  paced clock times each one's gradient (:mod:`prague.train.pacing`).

Weights are drawn from torch's global RNG: seed it (``torch.manual_seed``) before :func:`build_model`
on every rank, or broadcast rank 0's weights, so that all replicas start equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prague.comm.flat import state_tensors
from prague.errors import ConfigError, unknown_choice
from prague.workload.catalog import MODELS, OPTIMIZERS, TEXT_MODELS

__all__ = ["MODELS", "build_model", "parameter_count"]


MLP_HIDDEN = 128
CNN_HIDDEN = 128
RESNET18_BLOCKS = (2, 2, 2, 2)
RESNET_WIDTHS = (64, 128, 256, 512)
GPT_WIDTH = 128
GPT_LAYERS = 2
GPT_HEADS = 4


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build model ``name`` (one of :data:`MODELS`) for inputs ``(B, *input_shape)`` and return it.

    An image model maps a float tensor of shape ``(B, C, H, W)`` to logits of shape ``(B, num_classes)``;
    ``gpt`` maps int64 tokens ``(B, T)`` (``input_shape`` is ``(T,)``, ``num_classes`` the vocabulary) to
    logits ``(B, num_classes, T)``.

    Raises:
        ConfigError: ``name`` is unknown (the message lists the valid ones), ``input_shape`` is not
            three positive sizes for an image model or one for ``gpt``, or ``num_classes`` < 2.
    """
    if name not in MODELS:
        raise unknown_choice("model", name, MODELS)
    shape = tuple(int(d) for d in input_shape)
    text = name in TEXT_MODELS
    if len(shape) != (1 if text else 3) or any(d < 1 for d in shape):
        raise ConfigError(f"model {name!r}: input_shape {tuple(input_shape)!r} must be "
                          + ("one positive size (T tokens): it reads text" if text else
                             "three positive sizes (C, H, W): it reads images"))
    if num_classes < 2:
        raise ConfigError(f"model {name!r}: num_classes={num_classes!r} must be at least 2")
    if text:
        return GPT(vocabulary=num_classes, context=shape[0])
    channels, height, width = shape
    if name == "mlp":
        return _mlp(channels * height * width, num_classes)
    if name == "cnn":
        return _cnn(channels, height, width, num_classes)
    return ResNet(RESNET18_BLOCKS, in_channels=channels, num_classes=num_classes)


def build_optimizer(name: str, model: nn.Module, lr: float, momentum: float) -> torch.optim.Optimizer:
    """The workers' optimizer over ``model``'s parameters (``--optimizer``): ``sgd`` is ``torch.optim.SGD``
    with ``momentum``; ``adamw`` is ``torch.optim.AdamW`` (Loshchilov & Hutter, "Decoupled Weight Decay
    Regularization", ICLR 2019) with its defaults, ``momentum`` unused. ConfigError naming the choices for
    another name."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr)
    raise unknown_choice("optimizer", name, OPTIMIZERS)


def parameter_count(model: nn.Module) -> int:
    """Number of scalar parameters of ``model`` (trainable or not; buffers such as BN statistics excluded)."""
    return sum(p.numel() for p in model.parameters())


def state_elements(model: nn.Module) -> int:
    """Number of elements of ``model``'s flat state (parameters and floating-point buffers): what P-Reduce
    averages and the parameter server's shards split among themselves."""
    return sum(t.numel() for t in state_tensors(model))


def _mlp(in_features: int, num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_features, MLP_HIDDEN),
        nn.ReLU(),
        nn.Linear(MLP_HIDDEN, MLP_HIDDEN),
        nn.ReLU(),
        nn.Linear(MLP_HIDDEN, num_classes),
    )


def _cnn(channels: int, height: int, width: int, num_classes: int) -> nn.Module:
    # conv-pool twice: the second convolution runs on a quarter of the pixels, which keeps an MNIST
    # step cheap on a CPU. A side too thin to pool is left as it is instead of failing.
    def pool(h: int, w: int) -> tuple[nn.Module, int, int]:
        if h >= 2 and w >= 2:
            return nn.MaxPool2d(2), h // 2, w // 2
        return nn.Identity(), h, w

    pool1, h1, w1 = pool(height, width)
    pool2, h2, w2 = pool(h1, w1)
    return nn.Sequential(
        nn.Conv2d(channels, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        pool1,
        nn.Conv2d(32, 64, kernel_size=3, padding=1),
        nn.ReLU(),
        pool2,
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(64 * h2 * w2, CNN_HIDDEN),
        nn.ReLU(),
        nn.Linear(CNN_HIDDEN, num_classes),
    )


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity shortcut, or a 1x1 conv-BN one where the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet of :class:`BasicBlock` stages; ``blocks=(2, 2, 2, 2)`` is ResNet-18."""

    def __init__(self, blocks: tuple[int, ...], in_channels: int, num_classes: int) -> None:
        super().__init__()
        if len(blocks) != len(RESNET_WIDTHS) or any(b < 1 for b in blocks):
            raise ConfigError(f"ResNet blocks {blocks!r} must be {len(RESNET_WIDTHS)} counts >= 1")
        width = RESNET_WIDTHS[0]
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        stages: list[nn.Module] = []
        for stage, (count, out_width) in enumerate(zip(blocks, RESNET_WIDTHS)):
            first_stride = 1 if stage == 0 else 2
            layers = []
            for i in range(count):
                layers.append(BasicBlock(width, out_width, first_stride if i == 0 else 1))
                width = out_width
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out = self.pool(self.stages(self.stem(x)))
        return self.fc(out.flatten(1))


class Block(nn.Module):
    """One pre-norm transformer block: ``h + attention(norm(h))``, then ``h + mlp(norm(h))``; causal
    multi-head self-attention through :func:`torch.nn.functional.scaled_dot_product_attention`."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ConfigError(f"a transformer block of width {width} cannot have {heads} heads; the width must "
                              "be a multiple of the heads")
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * width, width)

    def forward(self, h: Tensor) -> Tensor:
        batch, length, width = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return h + self.down(self.act(self.up(self.norm2(h))))


class GPT(nn.Module):
    """A character-level GPT (see the module docstring): tokens ``(B, T)``, ``T <= context``, to logits
    ``(B, vocabulary, T)``."""

    def __init__(self, vocabulary: int, context: int, width: int = GPT_WIDTH, layers: int = GPT_LAYERS,
                 heads: int = GPT_HEADS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        nn.init.normal_(self.embed.weight, std=0.02)  # small logits at first: a loss near ln(vocabulary)
        self.position = nn.Embedding(context, width)
        nn.init.normal_(self.position.weight, std=0.02)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        length = tokens.shape[1]
        if length > self.position.num_embeddings:
            raise ConfigError(f"gpt: a sequence of {length} tokens is longer than the model's context of "
                              f"{self.position.num_embeddings}")
        h = self.embed(tokens) + self.position(torch.arange(length, device=tokens.device))
        return self.head(self.norm(self.blocks(h))).transpose(1, 2)

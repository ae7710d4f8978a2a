"""``bind_flat``: a model whose parameters and BatchNorm statistics live in one buffer.

P-Reduce averages that buffer in place, so binding must keep every tensor a view into it through
training (optimizer steps, BatchNorm updates) and leave the optimizer built beforehand working.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prague.comm.flat import bind_flat, flatten, state_tensors


def small_cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5), nn.BatchNorm1d(5),
    )


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 5, (6,), generator=g)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x, y = batch(seed)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def is_view_of(t: torch.Tensor, flat: torch.Tensor) -> bool:
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    return t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() and start <= t.data_ptr() < end


def float_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def test_parameters_and_bn_buffers_become_views_of_one_buffer() -> None:
    model = small_cnn(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    flat = bind_flat(model)

    assert flat.dim() == 1 and flat.is_contiguous()
    assert flat.numel() == sum(t.numel() for t in state_tensors(model))
    for name, p in model.named_parameters():
        assert is_view_of(p, flat), name
    float_buffers = {n: b for n, b in model.named_buffers() if b.is_floating_point()}
    assert {n.rsplit(".", 1)[1] for n in float_buffers} == {"running_mean", "running_var"}
    for name, b in float_buffers.items():
        assert is_view_of(b, flat), name
    # Values are unchanged, integer buffers stay outside the flat buffer, and the layout is the one
    # state_tensors (used to average and measure models) reads.
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
        if not value.is_floating_point():
            assert not is_view_of(value, flat), key
    assert torch.equal(flatten(state_tensors(model)), flat)


def test_optimizer_built_before_binding_updates_the_flat_buffer() -> None:
    bound, reference = small_cnn(1), small_cnn(1)
    bound_opt = torch.optim.SGD(bound.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    flat = bind_flat(bound)
    start = flat.clone()

    for step in range(3):
        train_step(bound, bound_opt, step)
        train_step(reference, ref_opt, step)

    assert not torch.equal(flat, start)
    # The bound model trained exactly like an unbound one, and everything it changed (weights by the
    # optimizer, running statistics by BatchNorm's in-place update) is in the flat buffer.
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(bound.state_dict()[key], value, rtol=0, atol=0)
    assert torch.equal(flatten(state_tensors(bound)), flat)
    for p in bound.parameters():
        assert is_view_of(p, flat)


def test_averaging_the_buffer_averages_the_model() -> None:
    models = [small_cnn(seed) for seed in (2, 3, 4)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    flats = [bind_flat(m) for m in models]
    for i, (m, opt) in enumerate(zip(models, opts)):  # apart, BatchNorm statistics included
        train_step(m, opt, 10 + i)
    states = [float_state(m) for m in models]
    want = {k: sum(s[k] for s in states) / len(states) for k in states[0]}

    mean = torch.stack(flats).mean(dim=0)
    for flat in flats:  # what P-Reduce does: overwrite the buffer in place
        flat.copy_(mean)

    x, _ = batch(99)
    reference = small_cnn(2)
    reference.load_state_dict({**reference.state_dict(), **want})
    reference.eval()
    for m in models:
        for key, value in want.items():
            torch.testing.assert_close(m.state_dict()[key], value, rtol=1e-6, atol=1e-7)
        m.eval()
        torch.testing.assert_close(m(x), reference(x), rtol=1e-5, atol=1e-6)
    # and the optimizer still moves the averaged model
    models[0].train()
    train_step(models[0], opts[0], 20)
    assert not torch.equal(flats[0], mean)


def _sgd_run(bind: bool, steps: int = 4) -> tuple[nn.Module, torch.optim.SGD, torch.Tensor | None]:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    flat = bind_flat(model, opt) if bind else None
    gen = torch.Generator().manual_seed(4)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt, flat


def test_momentum_bound_into_the_flat_buffer_is_updated_in_place_and_changes_nothing_else() -> None:
    from prague.comm.flat import momentum_bound

    plain, plain_opt, _ = _sgd_run(bind=False)
    bound, bound_opt, flat = _sgd_run(bind=True)
    assert flat is not None
    # the same trajectory bit for bit (zeros before the first step act as SGD's own first buffer)
    for a, b in zip(plain.parameters(), bound.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(plain.parameters(), bound.parameters()):
        assert torch.equal(plain_opt.state[a]["momentum_buffer"], bound_opt.state[b]["momentum_buffer"])
    # the buffers are the tail of the flat buffer, after the parameters, still bound after the steps
    assert momentum_bound(bound_opt, bound, flat)
    n = sum(p.numel() for p in bound.parameters())
    assert flat.numel() == 2 * n
    assert torch.equal(flat[n:], flatten([bound_opt.state[p]["momentum_buffer"] for p in bound.parameters()]))
    flat[n:].fill_(0.5)  # averaging the buffer reaches the optimizer's momentum
    assert all(torch.all(bound_opt.state[p]["momentum_buffer"] == 0.5) for p in bound.parameters())
    # a loaded optimizer state replaces the buffers: no longer bound
    bound_opt.load_state_dict(plain_opt.state_dict())
    assert not momentum_bound(bound_opt, bound, flat)

"""Checks of ``prague.prepare`` that run inside a job (a script, started by tests/train/test_prepared.py
alone or under ``prague launch``): ``python prepared_checks.py CHECK ALGORITHM [OPTIONS as k=v]``.
Each check asserts what it needs and prints ``ok CHECK`` on rank 0."""

from __future__ import annotations

import contextlib
import sys
import warnings
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import prague
from prague.errors import ConfigError


def net() -> nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank
    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 3))


def data(rank: int, step: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 10, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 1).long()


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int) -> list[float]:
    """``steps`` plain steps of the prepared ``model`` and ``opt`` on this rank's batches; their losses."""
    losses = []
    for step in range(steps):
        x, y = data(rank, step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def options(args: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in args:
        key, value = item.split("=", 1)
        out[key] = int(value) if value.isdigit() else value
    return out


def expect(error: str, fn: object) -> None:
    try:
        fn()  # type: ignore[operator]
    except ConfigError as exc:
        assert error in str(exc), str(exc)
        return
    raise AssertionError(f"expected a ConfigError about {error!r}")


def check_order(algorithm: str, opts: dict[str, object]) -> None:
    """Wrong orders are refused with the fix; the right one trains."""
    base = net()
    model, opt = prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1), algorithm, **opts)
    ctx = prague.context()
    assert model.module is base, type(model.module)  # DDP's contract, under every method
    import setproctitle  # what ps shows: the worker's rank and method, then its command

    title = setproctitle.getproctitle()
    assert title.startswith(f"prague rank {ctx.rank}/{ctx.world_size} {algorithm.split(':')[0]}"), title
    assert title.endswith("prepared_checks.py " + " ".join(sys.argv[1:])), title
    assert [id(p) for p in model.parameters()] == [id(p) for p in base.parameters()]  # each once
    expect("no loss.backward()", opt.step)
    x, y = data(ctx.rank, 0)
    with model.no_sync():
        F.cross_entropy(model(x), y).backward()
        expect("inside model.no_sync()", opt.step)
    expect("all of forward passes inside model.no_sync()", opt.step)
    with model.no_sync():
        loss = F.cross_entropy(model(x), y)
    loss.backward()  # DDP's rule: its forward ran inside the block, so it accumulates wherever it runs
    expect("all of forward passes inside model.no_sync()", opt.step)
    opt.zero_grad()
    losses = train(model, opt, ctx.rank, 30)
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    final = model.averaged_model()  # collective: a plain copy holding the mean of the replicas
    assert isinstance(final, nn.Sequential) and not any(p.requires_grad and p.grad is not None
                                                        for p in final.parameters())
    LAST[:] = [opt]
    model.close()


#: DDP's accumulation patterns over four micro-batches, each micro-batch as (where its forward pass runs,
#: where its backward pass runs): "in" model.no_sync(), "out" of it, or "module": the forward through the
#: underlying module, past the wrapper. The patterns of DDP's documentation and of its own tests
#: (torch's distributed_test.py and test_c10d_common.py: alternating blocks without an optimizer step, the
#: underlying module for the local passes, an evaluation under no_grad inside no_sync first).
PATTERNS: dict[str, list[tuple[str, str]]] = {
    "both inside": [("in", "in")] * 3 + [("out", "out")],  # DDP's documented one
    "forward inside, backward outside": [("in", "out")] * 3 + [("out", "out")],  # the forward decides
    "forward outside, backward inside": [("out", "in")] * 3 + [("out", "out")],  # each synchronised: the same mean
    "no no_sync at all": [("out", "out")] * 4,  # every backward synchronised, gradients accumulate
    "alternating blocks, no step between": [("in", "in"), ("out", "out")] * 2,  # synchronised twice
    "the underlying module for the local passes": [("module", "out")] * 3 + [("out", "out")],
    "an evaluation under no_grad inside no_sync first": [("eval", "-")] + [("in", "in")] * 3 + [("out", "out")],
}


def check_accumulation(algorithm: str, opts: dict[str, object]) -> None:
    """Every accumulation pattern DDP accepts gives the update of one batch four times the micro-batch
    (allreduce: the mean gradient over every rank's samples, as DDP)."""
    ctx = prague.context()
    ref = net()  # the reference: one batch of all ranks' 32 samples each, on a plain copy
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    xs = [data(r, 0, 32) for r in range(ctx.world_size)]
    loss = sum(F.cross_entropy(ref(a), b) for a, b in xs) / ctx.world_size
    loss.backward()  # type: ignore[union-attr]
    ref_opt.step()
    for name, passes in PATTERNS.items():
        base = net()
        model, opt = prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1), algorithm, **opts)
        x, y = data(ctx.rank, 0, 32)
        micro = 0
        for forward, backward in passes:
            if forward == "eval":  # no gradient: decides nothing, accumulates nothing
                with torch.no_grad(), model.no_sync():
                    model(x)
                assert all(p.grad is None for p in model.parameters()), name
                continue
            part = slice(8 * micro, 8 * (micro + 1))
            micro += 1
            runner = model.module if forward == "module" else model
            with model.no_sync() if forward == "in" else contextlib.nullcontext():
                loss = F.cross_entropy(runner(x[part]), y[part]) / 4
            with model.no_sync() if backward == "in" else contextlib.nullcontext():
                loss.backward()
        opt.step()
        for mine, theirs in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(mine, theirs, atol=1e-6), (name, (mine - theirs).abs().max())
        model.close()


def check_features(algorithm: str, opts: dict[str, object]) -> None:
    """AdamW with a scheduler, clipping between backward and step, bf16 autocast, a GradScaler, and a
    checkpoint saved and loaded."""
    ctx = prague.context()
    base = net()
    model, opt = prague.prepare(base, torch.optim.AdamW(base.parameters(), lr=0.01), algorithm, **opts)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    for step in range(12):
        x, y = data(ctx.rank, step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        sched.step()
    assert abs(opt.param_groups[0]["lr"] - 0.01 * 0.5 ** 2) < 1e-12, opt.param_groups[0]["lr"]
    assert opt.optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"]  # the scheduler moved the real one
    # a scaled loss whose gradients overflow: the step is skipped: the optimizer's update is not applied
    # (its per-parameter step counts stay); for allreduce nothing else moves the parameters, while an
    # averaging method still averages them with its group, in this step or in the background
    before = [p.detach().clone() for p in model.parameters()]
    counts = [float(opt.state[p]["step"]) for p in model.parameters()]
    x, y = data(ctx.rank, 99)
    loss = F.cross_entropy(model(x), y) * float("inf")
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    assert [float(opt.state[p]["step"]) for p in model.parameters()] == counts, "a skipped step ran the optimizer"
    if algorithm == "allreduce":
        after = list(model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "a skipped step changed the model"
    # checkpoint: save, train on, load, and the state is back
    folder = Path(tempfile.mkdtemp())
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, folder / f"r{ctx.rank}.pt")
    saved = [p.detach().clone() for p in model.parameters()]
    assert set(model.state_dict()) == set(base.state_dict())  # the plain model's keys
    for step in range(3):
        x, y = data(ctx.rank, 200 + step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    state = torch.load(folder / f"r{ctx.rank}.pt", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))
    # after a load the groups are shared again: a scheduler still moves the wrapped optimizer's rate
    assert opt.param_groups is opt.optimizer.param_groups and opt.state is opt.optimizer.state
    sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    model.close()


def check_scaler_refused(algorithm: str, opts: dict[str, object]) -> None:
    """A lockstep method whose gradients travel in the step refuses a GradScaler, naming the way out."""
    ctx = prague.context()
    base = net()
    model, opt = prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1), algorithm, **opts)
    scaler = torch.amp.GradScaler("cpu")
    x, y = data(ctx.rank, 0)
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    expect("bf16 autocast without a scaler", lambda: scaler.step(opt))
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()  # without the scaler the same step runs
    opt.step()
    model.close()


def check_rounds(algorithm: str, opts: dict[str, object]) -> None:
    """Methods that average every few steps (localsgd, diloco): the replicas drift apart inside a round
    and are bit for bit equal right after its average."""
    import torch.distributed as dist

    ctx = prague.context()
    every = 3
    base = net()
    model, opt = prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1, momentum=0.9), algorithm,
                                **{**opts, "sync_every_steps": every})
    for step in range(2 * every):
        x, y = data(ctx.rank, step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        replicas = [torch.empty_like(flat) for _ in range(ctx.world_size)]
        dist.all_gather(replicas, flat)
        equal = all(torch.equal(r, replicas[0]) for r in replicas)
        assert equal == ((step + 1) % every == 0 or ctx.world_size == 1), (step, equal)
    model.close()


class Branchy(nn.Module):
    """A model with a branch no forward pass uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = nn.Linear(10, 3), nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def check_unused(algorithm: str, opts: dict[str, object]) -> None:
    """DDP's find_unused_parameters: a model with an unused branch trains (allreduce hands it to DDP; the
    other methods need nothing of it); broadcast_buffers is refused with the reason where there is no DDP;
    a DDP option of the wrong type is named."""
    if not algorithm.startswith("allreduce"):
        other = Branchy()
        expect("broadcast_buffers is DDP's option", lambda: prague.prepare(
            other, torch.optim.SGD(other.parameters(), lr=0.1), algorithm, broadcast_buffers=False, **opts))
    other = Branchy()
    expect("option find_unused_parameters of method 'allreduce' takes a bool", lambda: prague.prepare(
        other, torch.optim.SGD(other.parameters(), lr=0.1), algorithm, find_unused_parameters="yes", **opts))
    base = Branchy()
    unused = base.unused.weight.detach().clone()
    model, opt = prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1), algorithm,
                                find_unused_parameters=True, **opts)
    ctx = prague.context()
    losses = train(model, opt, ctx.rank, 12)
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    assert torch.equal(base.unused.weight.detach(), unused)  # no gradient, no step, the same on every rank
    model.close()


def check_ddp_options(algorithm: str, opts: dict[str, object]) -> None:
    """DDP's static_graph and gradient_as_bucket_view reach allreduce's DDP, as given, and train: with
    bucket views the gradients live in DDP's buckets (parameters of one bucket share its storage),
    without them each parameter has its own."""
    assert algorithm.startswith("allreduce"), "check_ddp_options is allreduce's"
    ctx = prague.context()
    for static, views in ((True, True), (False, False)):
        base = net()
        model, opt = prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1), algorithm,
                                    static_graph=static, gradient_as_bucket_view=views, **opts)
        ddp = model._session.algorithm._ddp
        assert (ddp.static_graph, ddp.gradient_as_bucket_view) == (static, views), (static, views)
        losses = train(model, opt, ctx.rank, 12)
        assert sum(losses[-3:]) < sum(losses[:3]), losses
        x, y = data(ctx.rank, 99)
        F.cross_entropy(model(x), y).backward()
        storages = {p.grad.untyped_storage().data_ptr() for p in base.parameters()}
        assert (len(storages) < len(list(base.parameters()))) == views, (views, len(storages))
        opt.zero_grad()
        model.close()


class Net(nn.Module):
    """:func:`net` as a model class of one's own (torch.compile compiles its forward as a frame)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(10, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def check_compiled(algorithm: str, opts: dict[str, object]) -> None:
    """torch.compile before prepare (every method) and after it, with fullgraph=True: a graph break anywhere
    in the method's path fails. The one exception is allreduce compiled after prepare: DDP's own forward
    breaks the graph (Dynamo cannot trace its C++ logger's `set_runtime_stats_and_log`; torch 2.13), so it
    is compiled without fullgraph there, and still has to run the method's work every step. The compiled
    model trains as the plain one does: in a job of one the same parameters."""
    ctx = prague.context()
    plain = Net()
    model, opt = prague.prepare(plain, torch.optim.SGD(plain.parameters(), lr=0.1), algorithm, **opts)
    train(model, opt, ctx.rank, 4)
    expected = [p.detach().clone() for p in plain.parameters()]  # before close (diloco's last round ends there)
    model.close()
    for when in ("before", "after"):
        base = Net()
        module = torch.compile(base, fullgraph=True, backend="eager") if when == "before" else base
        model, opt = prague.prepare(module, torch.optim.SGD(base.parameters(), lr=0.1), algorithm, **opts)
        full = not algorithm.startswith("allreduce")  # DDP's forward has a graph break of its own
        runner = torch.compile(model, fullgraph=full, backend="eager") if when == "after" else model
        method, called = model._session.algorithm, []
        hook = method.before_compute
        method.before_compute = lambda step: (called.append(step), hook(step))[1]  # type: ignore[method-assign]
        losses = train(runner, opt, ctx.rank, 4)
        assert all(loss == loss for loss in losses), (when, losses)
        assert called == [0, 1, 2, 3], (when, called)  # the method's hook ran before every step, compiled or not
        if ctx.world_size == 1:  # nothing to average with: exactly the plain run
            for a, b in zip(base.parameters(), expected):
                assert torch.allclose(a, b, atol=1e-6), when
        model.close()


LAST: list[torch.optim.Optimizer] = []  # an optimizer whose method has ended, for the check after shutdown

def check_module_everywhere(algorithm: str, opts: dict[str, object]) -> None:
    """DDP's contract under every method and variant of the registry, one after the other in one job
    (``algorithm`` is ignored): ``model.module`` is the user's model, its parameters counted once, and a
    step trains it; each method is closed before the next is prepared. Every other one is named
    (``prepare(..., name=...)``), the others keyed by the job's count; a name used twice is refused."""
    from prague.algorithms.registry import METHODS

    ctx = prague.context()
    names = [name for m in METHODS.values() for name in (m.name, *(f"{m.name}:{v}" for v in m.variants))]
    # A script's job runs one parameter server (its shards are started once, by rank 0): the first only.
    servers = [name for name in names if name.startswith("ps")]
    names = [name for name in names if name not in servers[1:]]
    for i, name in enumerate(names):
        base = net()
        before = [p.detach().clone() for p in base.parameters()]
        # every other method named (its store keys under that name), the rest numbered by the job
        label = {"name": f"m{i}-{name.replace(':', '-')}"} if i % 2 else {}
        model, opt = prague.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1), name, **label)
        assert model.module is base, (name, type(model.module))
        assert [id(p) for p in model.parameters()] == [id(p) for p in base.parameters()], name
        train(model, opt, ctx.rank, 3)
        assert any(not torch.equal(a, b) for a, b in zip(before, base.parameters())), name  # it trained
        model.close()
    again = net()
    expect("has a method named 'm1-", lambda: prague.prepare(again, torch.optim.SGD(again.parameters(), lr=0.1),
                                                              names[1], name=f"m1-{names[1].replace(':', '-')}"))


CHECKS = {"order": check_order, "accumulation": check_accumulation, "features": check_features,
          "scaler_refused": check_scaler_refused, "rounds": check_rounds, "unused": check_unused,
          "compiled": check_compiled, "module_everywhere": check_module_everywhere,
          "ddp_options": check_ddp_options}


def main() -> int:
    checks, algorithm = sys.argv[1].split(","), sys.argv[2]
    opts = options(sys.argv[3:])
    prague.init()
    try:
        for check in checks:
            CHECKS[check](algorithm, opts)
    finally:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prague.shutdown()
    left = [str(w.message) for w in caught if "gloo worker thread" in str(w.message)]
    assert not left, left  # every method closed lets go of its process groups
    if LAST:  # the order check ended its method before shutdown: using it now is refused
        expect("after prague.shutdown()", LAST[0].step)
    if prague_rank() == 0:
        print(f"ok {','.join(checks)}")
    return 0


def prague_rank() -> int:
    import os

    return int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    sys.exit(main())

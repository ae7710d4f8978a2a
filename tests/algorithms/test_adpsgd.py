"""AD-PSGD: the bipartite split (pure), and pair averaging across real processes with 2, 3 and 8 workers:
with the gradient step disabled it keeps the sum of all replicas and drives them to consensus, and
every request an active worker initiated was served by a passive one."""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch

from prague_testing import processes_mentioning, run_cli
from prague.algorithms.adpsgd import ADPSGDOptions
from prague.algorithms.adpsgd.decisions import NeighbourChooser, bipartite_split
from prague.errors import ConfigError
from prague.workload.data import load_dataset
from prague.workload.models import build_model

pytestmark = pytest.mark.timeout(240)


def test_split_is_by_parity_by_default() -> None:
    assert bipartite_split(2) == ((0,), (1,))
    assert bipartite_split(3) == ((0, 2), (1,))
    assert bipartite_split(8) == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert bipartite_split(1) == ((0,), ())


def test_split_can_be_configured_and_is_validated() -> None:
    assert bipartite_split(5, "1, 4") == ((1, 4), (0, 2, 3))
    with pytest.raises(ConfigError, match="no passive"):
        bipartite_split(2, "0,1")
    with pytest.raises(ConfigError, match=r"\[7\]"):
        bipartite_split(4, "0,7")
    with pytest.raises(ConfigError, match="'0,x'"):
        ADPSGDOptions(adpsgd_active="0,x")
    with pytest.raises(ConfigError, match="twice"):
        ADPSGDOptions(adpsgd_active="1,1")


def test_neighbour_choice_is_seeded_and_covers_every_passive() -> None:
    a = [NeighbourChooser((1, 3, 5), 0, 7).next() for _ in range(1)]
    picks = NeighbourChooser((1, 3, 5), 0, 7)
    seq = [picks.next() for _ in range(300)]
    again = NeighbourChooser((1, 3, 5), 0, 7)
    assert seq == [again.next() for _ in range(300)] and seq[:1] == a
    assert set(Counter(seq)) == {1, 3, 5} and min(Counter(seq).values()) > 60
    other = NeighbourChooser((1, 3, 5), 2, 7)
    assert [other.next() for _ in range(300)] != seq


def test_live_neighbour_choice_skips_failed_passives_and_matches_without_failures() -> None:
    plain, live = NeighbourChooser((1, 3, 5), 0, 7), NeighbourChooser((1, 3, 5), 0, 7)
    assert [plain.next() for _ in range(50)] == [live.next_live({0, 2}) for _ in range(50)]  # actives failing
    picks = [live.next_live({3}) for _ in range(200)]
    assert set(picks) == {1, 5}
    assert live.next_live({1, 3, 5}) is None  # every passive failed: no partner


SCRIPT = textwrap.dedent("""
    import json, sys, time
    import torch, torch.distributed as dist
    import prague

    steps, result = int(sys.argv[1]), sys.argv[2]
    ctx = prague.init()
    torch.manual_seed(100 + ctx.rank)  # replicas start apart on purpose
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(ctx.rank)

    def flat():
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()

    def gathered():
        mine = flat()
        every = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
        dist.all_gather(every, mine)
        return torch.stack(every)

    before = gathered()
    trainer = prague.wrap(model, None, algorithm="adpsgd")  # no optimizer: averaging only
    # Every rank steps from the same moment: one that set up late on a loaded machine found the fast active
    # already done, its last value left behind the others' consensus (half the spread, once in CI).
    ctx.store.add("test/stepping", 1)
    while ctx.store.add("test/stepping", 0) < ctx.world_size:
        time.sleep(0.005)
    x = torch.randn(8, 32)
    for step in range(steps):
        trainer.step(lambda m: m(x).square().mean())
        time.sleep(0.002 * (ctx.rank % 3))  # unequal speeds
    trainer.close()
    after = gathered()
    stats = [None] * ctx.world_size
    dist.all_gather_object(stats, trainer.stats())
    if ctx.rank == 0:
        spread = lambda t: float((t - t.mean(0)).abs().max())
        json.dump({
            "sum_error": float((after.sum(0) - before.sum(0)).abs().max()),
            "sum_scale": float(before.sum(0).abs().max()),
            "spread_before": spread(before), "spread_after": spread(after), "stats": stats,
        }, open(result, "w"))
    prague.shutdown()
""")


@pytest.mark.parametrize("nproc,steps", [(2, 10), (3, 30), (8, 80)])
def test_pair_averaging_keeps_the_sum_and_reaches_consensus(tmp_path: Path, nproc: int, steps: int) -> None:
    script, result = tmp_path / f"adpsgd_{nproc}.py", tmp_path / "result.json"
    script.write_text(SCRIPT)
    res = run_cli("launch", "--nproc", str(nproc), str(script), str(steps), str(result), timeout_s=200)
    assert res.returncode == 0, res.stderr
    out = json.loads(result.read_text())
    # Each pair average is (a + b) / 2 in float32 on both sides: the sum moves by rounding only.
    assert out["sum_error"] <= 1e-5 * max(1.0, out["sum_scale"])
    assert out["spread_before"] > 0.4
    # How close the replicas end depends on how the unequal workers' last averages interleave (a fast
    # active that finishes first leaves its last value behind): 30 pair averages have left between 1e-7
    # and 2.4e-3 of the spread on this machine, against 1.0 for no averaging at all. With 8 workers, 40
    # steps left 1.4e-1 in 1 run of 4 (once in CI too); 80 steps left 0 in 4 of 4, and 2.8e-2 once in CI on a
    # slower day. The bound is the property (the replicas came together, tenfold at least), not a run's luck.
    assert out["spread_after"] < 1e-1 * out["spread_before"]
    stats = out["stats"]
    actives = [s for s in stats if s["role"] == "active"]
    passives = [s for s in stats if s["role"] == "passive"]
    assert len(actives) == (nproc + 1) // 2 and len(passives) == nproc // 2
    assert all(s["requests_initiated"] == steps for s in actives)
    assert sum(s["requests_served"] for s in passives) == steps * len(actives)
    assert processes_mentioning(str(script)) == []


def test_cli_run_reports_adpsgd_metrics(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = run_cli("run", "--algorithm", "adpsgd", "--nproc", "3", "--steps", "40", "--model", "mlp",
                  "--data", "digits", "--save-model", "--out", str(out), "--quiet", timeout_s=180)
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    stats = summary["algorithm_stats"]
    assert [s["role"] for s in stats] == ["active", "passive", "active"]
    assert stats[1]["requests_served"] == 80 and stats[0]["requests_initiated"] == 40
    assert summary["test_accuracy"] > 0.3
    # Replicas differ (pairs average asynchronously; allreduce's are identical) yet stay close, measured
    # against how far training moved their average from the common start: three replicas trained on the
    # same shards without averaging end about 0.22x that apart; averaging with the passive every step
    # keeps them near 0.08x. Over 15 steps a loaded machine's late exchanges left 0.17x now and then;
    # 40 steps give the averaging time to pull them together.
    data = load_dataset("digits", seed=0)
    torch.manual_seed(0)  # the run's --seed: the start every rank built
    start = build_model("mlp", data.input_shape, data.num_classes).state_dict()
    average = torch.load(out / "model.pt")
    moved = float(torch.linalg.vector_norm(torch.cat([(average[k] - start[k]).reshape(-1) for k in start])))
    assert 0.0 < summary["consensus_distance"] < 0.15 * moved, (summary["consensus_distance"], moved)

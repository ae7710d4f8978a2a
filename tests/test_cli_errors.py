"""Bad input: one line naming the bad value (and the valid choices), exit code 2, no traceback."""

from __future__ import annotations

import pytest

from prague_testing import run_cli

pytestmark = pytest.mark.timeout(60)

CASES = [
    (["run", "--algorithm", "nosuch"], ["'nosuch'", "allreduce"]),
    (["run", "--algorithm", "allreduce:fast"], ["'allreduce'", "no variants"]),
    (["run", "--data", "imagenet"], ["'imagenet'", "digits", "mnist", "synthetic"]),
    (["run", "--model", "vgg"], ["'vgg'", "cnn", "mlp", "resnet18"]),
    (["run", "--compute", "quantum"], ["'quantum'", "emulated", "real"]),
    (["run", "--slowdown", "paper"], ["'paper'", "paper:X"]),
    (["run", "--slowdown", "paper:fast"], ["'fast'", "paper:X"]),
    (["run", "--slowdown", "straggler:9:2", "--nproc", "2"], ["rank 9", "--nproc"]),
    (["run", "--nproc", "0"], ["--nproc", "0"]),
    (["run", "--data", "mnist", "--data-dir", "/no/such/dir"], ["/no/such/dir", "--data-dir"]),
    (["run", "--data", "mnist"], ["--data-dir"]),
    (["run", "--steps", "0"], ["--steps", "0"]),
    (["run", "--nproc", "two"], ["--nproc", "'two'"]),
    (["bench", "--scenarios", "homogeneous,weird:1"], ["'weird:1'"]),
    (["bench", "--algorithms", "allreduce,bogus"], ["'bogus'", "allreduce"]),
    (["launch", "--nproc", "2", "/no/such/script.py"], ["/no/such/script.py"]),
    (["run", "--algorithm", "prague", "--nproc", "4", "--group-size", "9"], ["--group-size 9", "--nproc 4", "at most 4"]),
    (["run", "--algorithm", "dssync", "--nproc", "4", "--group-size", "5"], ["--group-size 5", "at most 4"]),
    (["bench", "--algorithms", "allreduce,dssync", "--nproc", "3", "--group-size", "4"], ["--group-size 4", "at most 3"]),
    (["run", "--algorithm", "prague", "--nproc", "6", "--nodes", "4"], ["--nproc 6", "--nodes 4"]),
    (["run", "--algorithm", "adpsgd", "--nproc", "4", "--adpsgd-active", "0,7"], ["[7]", "0..3"]),
    (["run", "--algorithm", "adpsgd", "--nproc", "2", "--adpsgd-active", "0,1"], ["no passive"]),
    (["simulate", "--algorithms", "prague:smart", "--nproc", "4", "--group-size", "9"], ["--group-size 9", "at most 4"]),
    (["run", "--algorithm", "eager-sgd", "--sync-every", "-1"], ["--sync-every", "-1"]),
    (["run", "--algorithm", "eager-sgd:all"], ["'all'", "solo", "majority"]),
]


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from prague.cli import main

    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("args", "expected"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_clear_line(args: list[str], expected: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _main(args, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for word in expected:
        assert word in lines[0], (word, lines[0])


@pytest.mark.parametrize("args", [CASES[0][0], CASES[5][0]])
def test_real_process_exits_2_without_traceback(args: list[str]) -> None:
    res = run_cli(*args, timeout_s=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_corrupt_mnist_file_is_a_usage_error(tmp_path, mnist_dir) -> None:
    import shutil

    for f in mnist_dir.glob("*-ubyte.gz"):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8bnot really gzip")
    res = run_cli("run", "--data", "mnist", "--data-dir", str(tmp_path), "--steps", "1", "--out", str(tmp_path / "o"))
    assert res.returncode == 2
    assert "train-labels-idx1-ubyte" in res.stderr and "Traceback" not in res.stderr

"""Bad input: one line naming the bad value (and the valid choices), exit code 2, no traceback."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from prague_testing import run_cli

pytestmark = pytest.mark.timeout(60)

CASES = [
    (["run", "--algorithm", "nosuch"], ["'nosuch'", "allreduce"]),
    (["run", "--algorithm", "dssync:fast"], ["'dssync'", "no variants"]),
    (["run", "--algorithm", "allreduce:fast"], ["variant of allreduce", "backup, balanced, ddp, drop"]),
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
    # Found by the fuzz of tests/test_fuzz_cli.py (each was a traceback, a hang or a run failing after launch):
    (["simulate", "--compute-ms=--"], ["--compute-ms", "expected one argument"]),  # argparse handed it []
    (["run", "--lr=--"], ["--lr", "expected one argument"]),
    (["simulate", "--epochs", "inf"], ["--epochs", "inf", "finite"]),  # OverflowError computing the steps
    (["run", "--algorithm", "adpsgd", "--nproc", "3000000"], ["--nproc", "3000000", "1..1048576"]),  # hung
    (["run", "--timeout-s", "inf"], ["--timeout-s", "inf"]),  # each of these failed in the workers
    (["run", "--lease-s", "1e300"], ["--lease-s", "1e+300"]),
    (["run", "--lr", "inf"], ["--lr", "inf"]),
    (["run", "--compute-ms", "nan"], ["--compute-ms", "nan"]),
    (["run", "--seed", "-1"], ["seed -1", "2**32"]),
    (["simulate", "--seed", "4294967296"], ["seed 4294967296", "2**32"]),
    (["run", "--algorithm", "allreduce", "--bucket-cap-mb", "inf"], ["--bucket-cap-mb", "inf"]),
    (["run", "--algorithm", "prague", "--gg-timeout-s", "inf"], ["--gg-timeout-s", "inf"]),
    (["run", "--algorithm", "ps", "--ps-timeout-s", "1e300"], ["--ps-timeout-s", "1e+300"]),
    (["run", "--algorithm", "prague", "--window-ms", "1e300"], ["--window-ms", "1e+300"]),
    (["run", "--algorithm", "prague", "--gg-address", "localhost"], ["--gg-address", "'localhost'", "host:port"]),
    (["run", "--algorithm", "prague", "--gg-address", "h:99999"], ["--gg-address", "'h:99999'", "1..65535"]),
    (["simulate", "--intra-gbps", "0"], ["--intra-gbps", "> 0"]),
    (["run", "--backend", "nccl", "--nproc", "64"], ["'nccl'", "--backend gloo"]),  # failed in every worker
    (["run", "--slowdown", "paper:inf"], ["factor", "inf", "1..1e+06"]),  # the workers' sleep overflowed
    (["bench", "--scenarios", "straggler:1:1e300"], ["factor", "1e+300", "1..1e+06"]),
    # named --budget once, and only after the bench had measured the nominal step
    (["bench", "--lr", "0.1,0.2", "--pilot-budget", "seconds:0"], ["--pilot-budget 'seconds:0'", "> 0",
                                                                    "give --pilot-budget epochs:E"]),
    (["bench", "--lr", "0.1,0.2", "--pilot-budget", "bogus"], ["--pilot-budget 'bogus' is not a budget"]),
    # a value holding a character at which a line breaks (a record separator, a newline) is written escaped
    (["run", "--algorithm", "ps", "--optimizer", "\x1e"], ["--optimizer \\x1e", "--optimizer sgd"]),
    (["run", "--algorithm", "ps", "--optimizer", "a\nb\u2028c"], ["--optimizer a\\nb\\u2028c", "--optimizer sgd"]),
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


@pytest.mark.parametrize("args", [CASES[0][0], CASES[5][0], ["simulate", "--epochs", "inf"]])
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


def test_out_that_is_a_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Found while fuzzing: `--out FILE` passed validation and failed on the launcher's mkdir (a traceback)."""
    (tmp_path / "file").write_text("x")
    for out, words in ((tmp_path / "file", ["is a file"]), (tmp_path / "file" / "below", ["is below the file"])):
        for command in ("run", "bench", "simulate"):
            code, err = _main([command, "--out", str(out)], capsys)
            assert code == 2 and err.count("\n") == 1 and str(out) in err and all(w in err for w in words), err


@pytest.mark.parametrize(("content", "expected"), [
    ("[base]\n", "base preset"),  # a table where a name belongs: TypeError (unhashable)
    ("[compute]\nspeeds = 3\n", "speeds must be a list"),  # TypeError from tuple(3)
    ("name = 5\n", "name must be a string"),
    ("[compute\n", "cannot read cluster file"),
    ("[links]\nintra = 1\n", "[intra] must be a table"),
])
def test_bad_cluster_file_is_one_line_naming_it(content: str, expected: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(content)
    code, err = _main(["simulate", "--cluster", str(path), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and err.count("\n") == 1 and str(path) in err and expected in err, err


@pytest.mark.parametrize(("saved", "expected"), [
    ({"data_dir": False}, "data_dir = False"),  # TypeError from Path(False)
    ({"options": "0"}, "options = '0'"),  # AttributeError: 'str' object has no attribute 'items'
    ({"nproc": 1.5}, "nproc = 1.5"),
    ({"colour": "blue"}, "not a job description"),
    ([], "not a job description"),
])
def test_bad_saved_run_is_one_line_naming_it(saved: object, expected: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run.json").write_text(json.dumps(saved))
    code, err = _main(["run", "--resume", str(tmp_path)], capsys)
    assert code == 2 and err.count("\n") == 1 and "run.json" in err and expected in err, err


# -- checks that need the data set or the model: in the launcher, before any worker starts ---------------


class _Launched(Exception):
    pass


@pytest.fixture
def until_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """`prague run` in this process stops where it would start workers (and starts no fork server)."""

    def launch(*args: object, **kwargs: object) -> None:
        raise _Launched

    monkeypatch.setattr("prague.runtime.forkserver.prestart", lambda *args, **kwargs: None)
    monkeypatch.setattr("prague.runtime.launcher.launch", launch)


def _run_until_launch(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | None, str]:
    """(exit code, stderr) of `prague run ARGS`; code None if it got as far as starting workers."""
    try:
        return _main(["run", *args], capsys)
    except _Launched:
        return None, capsys.readouterr().err


def test_more_ps_shards_than_model_elements_is_a_usage_error(tmp_path: Path, until_launch: None,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """It failed in every worker after the launcher had started 100000 shard processes."""
    common = ["--algorithm", "ps", "--nproc", "2", "--steps", "1", "--out", str(tmp_path / "o")]
    code, err = _run_until_launch([*common, "--ps-shards", "100000"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--ps-shards 100000" in err and "use at most" in err, err
    assert _run_until_launch([*common, "--ps-shards", "3"], capsys) == (None, "")
    # A model with millions of elements still gets at most MAX_SHARDS processes (a bench of such a
    # value spent minutes describing millions of shard services before this limit).
    code, err = _run_until_launch([*common, "--model", "resnet18", "--ps-shards", "5000000"], capsys)
    assert code == 2 and err.count("\n") == 1 and "use at most 1024" in err, err


def _idx(dims: tuple[int, ...], payload: bytes, type_byte: int = 0x08) -> bytes:
    """An IDX file: magic (0, 0, type, ndim), one big-endian uint32 per dimension, the values."""
    return bytes([0, 0, type_byte, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims) + payload


def _tiny_mnist(folder: Path, train: int = 64, test: int = 16) -> dict[str, bytes]:
    """A small MNIST in the IDX layout, gzip-compressed, written to ``folder``; its files by name."""
    rng = np.random.default_rng(0)
    files = {}
    for split, count in (("train", train), ("t10k", test)):
        pixels = rng.integers(0, 256, count * 28 * 28, np.uint8).tobytes()
        files[f"{split}-images-idx3-ubyte.gz"] = _idx((count, 28, 28), pixels)
        files[f"{split}-labels-idx1-ubyte.gz"] = _idx((count,), rng.integers(0, 10, count, np.uint8).tobytes())
    for name, raw in files.items():
        (folder / name).write_bytes(gzip.compress(raw))
    return files


IMAGES, LABELS = "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"
MNIST_DAMAGE = {  # file -> how its (uncompressed) content is damaged, written gzip-compressed unless noted
    "truncated gzip": (IMAGES, lambda raw: gzip.compress(raw)[: len(gzip.compress(raw)) // 2], "does not decompress"),
    "corrupt gzip": (LABELS, lambda raw: gzip.compress(raw)[:12] + b"\xff" * 40, "does not decompress"),
    "wrong magic": (IMAGES, lambda raw: gzip.compress(b"\x08\x03\x00\x00" + raw[4:]), "magic bytes"),
    "float type": (IMAGES, lambda raw: gzip.compress(raw[:2] + b"\x0d" + raw[3:]), "type byte 0x0d"),
    "wrong count": (IMAGES, lambda raw: gzip.compress(_idx((65, 28, 28), raw[16:])), "truncated"),
    "truncated payload": (LABELS, lambda raw: gzip.compress(raw[:-5]), "truncated"),
    "longer payload": (LABELS, lambda raw: gzip.compress(raw + b"\x01"), "longer than its header"),
    "shorter than header": (IMAGES, lambda raw: gzip.compress(raw[:9]), "shorter than its 16-byte IDX header"),
    "empty, not gzip": (LABELS, lambda raw: b"", "0 bytes long"),
    "labels for fewer images": (LABELS, lambda raw: gzip.compress(_idx((63,), raw[8:71])), "63 labels"),
    "label out of range": (LABELS, lambda raw: gzip.compress(raw[:-1] + b"\x0c"), "label 12"),
    "label file as images": (IMAGES, lambda raw: gzip.compress(_idx((64,), raw[16:80])), "3 dimensions"),
}


@pytest.mark.parametrize("damage", sorted(MNIST_DAMAGE))
def test_damaged_mnist_file_is_one_line_naming_it(damage: str, tmp_path: Path, until_launch: None,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    files = _tiny_mnist(tmp_path)
    name, damaged, expected = MNIST_DAMAGE[damage]
    (tmp_path / name).write_bytes(damaged(files[name]))
    code, err = _run_until_launch(["--data", "mnist", "--data-dir", str(tmp_path), "--nproc", "2", "--steps", "1",
                                   "--batch-size", "8", "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert str(tmp_path / name) in err and expected in err, err


def test_tiny_mnist_is_accepted(tmp_path: Path, until_launch: None, capsys: pytest.CaptureFixture[str]) -> None:
    """The damage above is what the checks catch: the undamaged files get as far as starting workers."""
    _tiny_mnist(tmp_path)
    assert _run_until_launch(["--data", "mnist", "--data-dir", str(tmp_path), "--nproc", "2", "--steps", "1",
                              "--batch-size", "8", "--out", str(tmp_path / "o")], capsys) == (None, "")


def test_truncated_mnist_download_is_one_line_naming_it(tmp_path: Path, mnist_dir: Path, until_launch: None,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The real files, one of them cut short as by an interrupted download."""
    for f in mnist_dir.glob("*-ubyte.gz"):
        shutil.copy(f, tmp_path / f.name)
    labels = tmp_path / "t10k-labels-idx1-ubyte.gz"
    labels.write_bytes(labels.read_bytes()[:1000])
    code, err = _run_until_launch(["--data", "mnist", "--data-dir", str(tmp_path), "--steps", "1",
                                   "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and err.count("\n") == 1 and str(labels) in err and "truncated" in err, err

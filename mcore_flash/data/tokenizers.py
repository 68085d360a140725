"""Tokenizers that ``megatron.core.datasets`` accepts (duck-typed, megatron-core 0.16 .. 0.19).

A tokenizer here is a plain object (:class:`Tokenizer`, which lists what megatron reads from
it) with ``tokenize(text) -> list[int]``, ``detokenize(ids) -> str``, ``vocab_size``,
``eod`` (== ``eos``), ``pad``, ``unique_identifiers`` (an OrderedDict of JSON-able values) and
``unique_description``. It deliberately does not subclass megatron's
``MegatronLegacyTokenizer`` (deprecated; logs a warning on construction) nor need
``megatron.core.tokenizers`` (which wants the tokenizer libraries installed).

Types (``--tokenizer-type``, Megatron-LM's names where it has one; table:
:func:`build_tokenizer`): ``ByteTokenizer`` (default, no file), ``HuggingFaceTokenizer``,
``SentencePieceTokenizer``, ``NullTokenizer``. ``vocab_size`` is the tokenizer's true
vocabulary size, as in Megatron-LM; the model's embedding is padded separately
(:func:`padded_vocab_size`).

A checkpoint's tokenizer files travel with it: :func:`tokenizer_record`,
:func:`store_tokenizer`, :func:`stored_tokenizer` (loaded through
:func:`mcore_flash.runtime.tokenizer.run_tokenizer`); which command uses which tokenizer:
docs/conversion.md, "The tokenizer travels".
"""

from __future__ import annotations

import abc
import difflib
import hashlib
import json
import os
import shutil
from collections import OrderedDict
from typing import Iterable, Optional

from mcore_flash.data.errors import DataError

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "NullTokenizer",
    "TOKENIZER_TYPES",
    "DEFAULT_TOKENIZER_TYPE",
    "build_tokenizer",
    "padded_vocab_size",
    "TOKENIZER_DIR",
    "TOKENIZER_FILES",
    "tokenizer_record",
    "store_tokenizer",
    "check_stored_tokenizer",
    "stored_tokenizer",
]

DEFAULT_TOKENIZER_TYPE = "ByteTokenizer"
TOKENIZER_TYPES = (
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "SentencePieceTokenizer",
    "NullTokenizer",
)
_ALIASES = {"GPTSentencePieceTokenizer": "SentencePieceTokenizer"}
# Megatron-LM --tokenizer-type values that have no implementation here.
_MEGATRON_LM_ONLY = (
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "MultimodalTokenizer",
    "NullMultimodalTokenizer",
    "SFTTokenizer",
)

_HF_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
_HF_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>", "<|finetune_right_pad_id|>")


class Tokenizer(abc.ABC):
    """Base class: the duck type megatron.core.datasets needs.

    Subclasses pass their ``vocab_size``, ``eod`` and ``pad`` (``-1``: none) ids and the
    identifiers that make megatron's dataset caches unique.

    What megatron.core.datasets 0.16.1 reads from ``config.tokenizer``:

    * ``GPTDatasetConfig.__post_init__``: ``vocab_size`` (picks ``token_dtype_code``).
    * ``MegatronDataset.__init__``: ``unique_identifiers`` (JSON-dumped into the hash that
      names the cached index files), ``pad`` (padding id; tokens equal to it are zeroed and
      their loss masked, so it must never occur in real data), ``special_tokens_dict`` /
      ``eos`` / ``eod`` (only to detect a pad id that collides with another special token).
    * ``GPTDataset.__getitem__``: ``eod`` (for reset_position_ids / eod_mask_loss).
    * ``MockGPTDataset``: ``vocab_size`` and ``eod``.
    """

    tokenizer_type: str = ""
    # the directory of a Hugging Face tokenizer's files (its chat template, special tokens)
    directory: Optional[str] = None

    def __init__(self, vocab_size: int, eod: int, pad: int, **identifiers) -> None:
        self._vocab_size, self._eod, self._pad = vocab_size, eod, pad
        self.unique_identifiers: "OrderedDict[str, object]" = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        for key, value in identifiers.items():
            self.unique_identifiers[key] = value
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Text -> token ids (no BOS/EOS added)."""

    @abc.abstractmethod
    def detokenize(self, ids: Iterable[int]) -> str:
        """Token ids -> text (ids outside the vocabulary are dropped)."""

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        """Padding id; never produced by ``tokenize`` (``-1`` when the tokenizer has none)."""
        return self._pad

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad})"
        )


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: ids 0..255, ``eod`` = 256, ``pad`` = 257, ``vocab_size`` = 258."""

    tokenizer_type = "ByteTokenizer"
    EOD = 256
    PAD = 257
    VOCAB_SIZE = 258

    def __init__(self) -> None:
        super().__init__(self.VOCAB_SIZE, self.EOD, self.PAD)

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class NullTokenizer(Tokenizer):
    """Megatron-LM's NullTokenizer: text is space-separated ids < ``vocab_size_arg``;
    ``eod`` = ``vocab_size_arg``, ``vocab_size`` = ``vocab_size_arg`` + 1, no pad (-1)."""

    tokenizer_type = "NullTokenizer"

    def __init__(self, vocab_size: int) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise DataError(
                f"--vocab-size {vocab_size!r}: NullTokenizer needs a positive integer vocabulary size"
            )
        self._n = vocab_size
        super().__init__(vocab_size + 1, vocab_size, -1, vocab_size_arg=vocab_size)

    def tokenize(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            try:
                value = int(word)
            except ValueError:
                raise DataError(
                    f"NullTokenizer: {word[:40]!r} is not an integer id; its text must be "
                    "space-separated integer ids (or choose another --tokenizer-type)"
                ) from None
            if not 0 <= value < self._n:
                raise DataError(
                    f"NullTokenizer: id {value} is outside [0, {self._n}); raise --vocab-size"
                )
            ids.append(value)
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def _missing_package(tokenizer_type: str, package: str) -> DataError:
    return DataError(
        f"--tokenizer-type {tokenizer_type} needs the optional package `{package}`, which is not "
        f"installed: `pip install {package}` (or use the default --tokenizer-type "
        f"{DEFAULT_TOKENIZER_TYPE}, which needs nothing)"
    )


class HFTokenizer(Tokenizer):
    """A HuggingFace ``tokenizers`` tokenizer from a ``tokenizer.json`` (or a directory with one).

    ``eod``: the first of ``<|endoftext|>``, ``<|end_of_text|>``, ``</s>``, ``<eos>``, ... found in
    the vocabulary; if none is, an extra id equal to the tokenizer's size (``vocab_size`` then
    counts it). ``pad``: ``<pad>``/``[PAD]``/... if present, else -1 (megatron's "no pad").
    Encoding adds no special tokens (no BOS), like Megatron-LM's default.
    """

    tokenizer_type = "HuggingFaceTokenizer"

    def __init__(self, path: str) -> None:
        try:
            import tokenizers  # optional dependency, imported only when asked for
        except ImportError:
            raise _missing_package("HuggingFaceTokenizer", "tokenizers") from None
        file = _existing_model_path("HuggingFaceTokenizer", path, dir_file="tokenizer.json")
        try:
            self._tok = tokenizers.Tokenizer.from_file(file)
        except Exception as err:  # the library raises a bare Exception on a bad file
            raise DataError(
                f"--tokenizer-model {path}: not a HuggingFace tokenizer.json ({err}); pass the "
                "tokenizer.json of a `tokenizers`/`transformers` fast tokenizer"
            ) from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        size = max(
            self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1
        )
        eod = next((vocab[t] for t in _HF_EOD_CANDIDATES if t in vocab), None)
        if eod is None:
            eod, size = size, size + 1
        pad = next((vocab[t] for t in _HF_PAD_CANDIDATES if t in vocab), -1)
        super().__init__(size, eod, pad, tokenizer_path=[os.path.abspath(file)])
        self.directory = os.path.dirname(os.path.abspath(file))

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode(
            [int(i) for i in ids if 0 <= int(i) < self._tok.get_vocab_size(True)]
        )


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` (optional package ``sentencepiece``): ``eod`` = the model's
    ``eos_id()`` (an extra id past the vocabulary when the model has none), ``pad`` =
    ``pad_id()`` (-1 when none). Encoding adds no BOS/EOS."""

    tokenizer_type = "SentencePieceTokenizer"

    def __init__(self, model_path: str) -> None:
        try:
            import sentencepiece  # optional dependency, imported only when asked for
        except ImportError:
            raise _missing_package("SentencePieceTokenizer", "sentencepiece") from None
        file = _existing_model_path(
            "SentencePieceTokenizer", model_path, dir_file="tokenizer.model"
        )
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=file)
        except Exception as err:
            raise DataError(
                f"--tokenizer-model {model_path}: not a SentencePiece model ({err}); pass the "
                ".model file written by spm_train"
            ) from None
        size = int(self._sp.vocab_size())
        eod = int(self._sp.eos_id())
        if eod < 0:
            eod, size = size, size + 1
        super().__init__(size, eod, int(self._sp.pad_id()), tokenizer_path=[os.path.abspath(file)])

    def tokenize(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def detokenize(self, ids: Iterable[int]) -> str:
        n = int(self._sp.vocab_size())
        return self._sp.decode([int(i) for i in ids if 0 <= int(i) < n])


def _existing_model_path(tokenizer_type: str, path: Optional[str], dir_file: str) -> str:
    if not path:
        raise DataError(
            f"--tokenizer-type {tokenizer_type} needs --tokenizer-model (the tokenizer file)"
        )
    if os.path.isdir(path):
        candidate = os.path.join(path, dir_file)
        if not os.path.isfile(candidate):
            raise DataError(
                f"--tokenizer-model {path}: the directory has no {dir_file}; pass the file itself"
            )
        return candidate
    if not os.path.isfile(path):
        raise DataError(f"--tokenizer-model {path}: no such file")
    return path


def build_tokenizer(
    tokenizer_type: Optional[str] = DEFAULT_TOKENIZER_TYPE,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
) -> Tokenizer:
    """The tokenizer for ``--tokenizer-type``/``--tokenizer-model``/``--vocab-size``.

    Tokenizer types (``--tokenizer-type``; the names are Megatron-LM's where it has one):

    =========================  ==================================================================
    ``ByteTokenizer``          default; UTF-8 bytes 0..255, ``eod`` = 256, ``pad`` = 257,
                               ``vocab_size`` = 258. No file, no download. (Megatron-LM has no
                               byte tokenizer type; megatron-core's ``ByteLevelTokenizer`` puts
                               eos/pad on bytes 0/1, which collide with real data, so this one
                               is our own.)
    ``HuggingFaceTokenizer``   ``--tokenizer-model`` = a ``tokenizer.json`` file or a directory
                               holding one, loaded with ``tokenizers.Tokenizer.from_file``
                               (optional package ``tokenizers``; Megatron-LM's type of the same
                               name goes through ``transformers.AutoTokenizer`` instead).
    ``SentencePieceTokenizer`` ``--tokenizer-model`` = a ``.model`` file (optional package
                               ``sentencepiece``); ``GPTSentencePieceTokenizer`` is accepted as
                               an alias.
    ``NullTokenizer``          ``--vocab-size V``: text is space-separated integer ids < V;
                               ``eod`` = V, ``vocab_size`` = V + 1 (Megatron-LM's NullTokenizer).
    =========================  ==================================================================

    Raises :class:`DataError` naming the flag and the fix for an unknown type, a missing or bad
    model file, a missing optional package, or a flag the type does not use.
    """
    name = tokenizer_type or DEFAULT_TOKENIZER_TYPE
    name = _ALIASES.get(name, name)
    if name not in TOKENIZER_TYPES:
        if name in _MEGATRON_LM_ONLY:
            raise DataError(
                f"--tokenizer-type {name}: a Megatron-LM tokenizer type that mcore-flash does not "
                f"implement; choose one of {', '.join(TOKENIZER_TYPES)} (a HuggingFace tokenizer.json "
                "covers GPT-2 BPE, Llama, ... via HuggingFaceTokenizer)"
            )
        lowered = {t.lower(): t for t in TOKENIZER_TYPES}
        stem = name.lower().rstrip("s").replace("tokenizer", "")
        close = [t for low, t in lowered.items() if stem and low.startswith(stem)]
        close = close or [
            lowered[c] for c in difflib.get_close_matches(name.lower(), lowered, n=1, cutoff=0.5)
        ]
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise DataError(
            f"--tokenizer-type {name!r} is unknown{hint}; choose one of {', '.join(TOKENIZER_TYPES)}"
        )
    if name != "NullTokenizer" and vocab_size is not None:
        raise DataError(
            f"--vocab-size is only used by --tokenizer-type NullTokenizer, not {name}; drop it"
        )
    if name in ("ByteTokenizer", "NullTokenizer") and tokenizer_model:
        raise DataError(
            f"--tokenizer-model {tokenizer_model}: --tokenizer-type {name} uses no model file; drop "
            "--tokenizer-model, or pass --tokenizer-type HuggingFaceTokenizer / SentencePieceTokenizer"
        )
    if name == "ByteTokenizer":
        return ByteTokenizer()
    if name == "NullTokenizer":
        if vocab_size is None:
            raise DataError("--tokenizer-type NullTokenizer needs --vocab-size (number of ids)")
        return NullTokenizer(vocab_size)
    if name == "HuggingFaceTokenizer":
        return HFTokenizer(tokenizer_model)
    return SentencePieceTokenizer(tokenizer_model)


def padded_vocab_size(
    vocab_size: int, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1
) -> int:
    """Megatron-LM's embedding size: ``vocab_size`` rounded up to a multiple of
    ``make_vocab_size_divisible_by * tensor_model_parallel_size`` (Megatron-LM's
    ``--make-vocab-size-divisible-by`` rule; ``ByteTokenizer``: 258 -> 384 with the default
    128)."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


# The directory, next to the ``iter_*`` checkpoints under a --save directory, that holds the
# tokenizer the checkpoints were converted or trained with (a Hugging Face tokenizer directory:
# ``transformers.AutoTokenizer.from_pretrained`` reads it as it is).
TOKENIZER_DIR = "tokenizer"
# A Hugging Face model directory's tokenizer: these files, whichever exist (the fast tokenizer,
# its settings and special tokens, a SentencePiece model, the slow tokenizers' vocabularies and
# the chat templates transformers writes beside them).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def _sha256(path: str) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            sha.update(block)
    return sha.hexdigest()


def tokenizer_record(directory: str) -> Optional[dict]:
    """What a checkpoint records of the tokenizer files in ``directory``:
    ``{"type": tokenizer type, "files": {name: sha256}}``, or None when it holds none of
    :data:`TOKENIZER_FILES`. ``type`` is ``HuggingFaceTokenizer`` with a ``tokenizer.json``,
    ``SentencePieceTokenizer`` with only a ``tokenizer.model``, else None (the files travel to
    an export, but the trainer cannot load them: it still needs ``--tokenizer-type``)."""
    files = {
        name: _sha256(os.path.join(directory, name))
        for name in TOKENIZER_FILES
        if os.path.isfile(os.path.join(directory, name))
    }
    if not files:
        return None
    kind = (
        "HuggingFaceTokenizer"
        if "tokenizer.json" in files
        else "SentencePieceTokenizer"
        if "tokenizer.model" in files
        else None
    )
    return {"type": kind, "files": files}


def check_stored_tokenizer(directory: str, record: dict, what: str) -> None:
    """Raise :class:`DataError` unless ``directory`` holds the files ``record`` lists, unchanged
    (``what`` names the checkpoint in the message)."""
    for name, sha in record["files"].items():
        path = os.path.join(directory, name)
        problem = (
            "is missing"
            if not os.path.isfile(path)
            else "has changed since the checkpoint was written"
            if _sha256(path) != sha
            else None
        )
        if problem:
            raise DataError(
                f"{what}: the checkpoint's tokenizer file {path} {problem}; restore it from the "
                "source model, or pass --tokenizer-type / --tokenizer-model explicitly"
            )


def store_tokenizer(source: str, target: str, record: Optional[dict] = None) -> Optional[dict]:
    """Copy the tokenizer files of directory ``source`` (those ``record`` lists, checked against
    it; default: whichever of :data:`TOKENIZER_FILES` exist) into directory ``target``; returns
    the record (None: no tokenizer files, nothing written).

    A missing ``target`` is written as ``<target>.tmp`` and renamed into place, so it is never
    half there; an existing one (an export directory) is written into.

    ``convert hf-to-mcore`` copies the source directory's tokenizer files this way into
    ``<save>/tokenizer/`` (:data:`TOKENIZER_DIR`) and records them in the checkpoint's common
    state (:func:`tokenizer_record`: the type they load as, each file's SHA-256); ``pretrain``
    copies them into every new ``--save`` it writes, and the commands given no
    ``--tokenizer-type``/``--tokenizer-model`` load them (:func:`stored_tokenizer`, through
    :func:`mcore_flash.runtime.tokenizer.run_tokenizer`)."""
    if record is None:
        record = tokenizer_record(source)
        if record is None:
            return None
    else:
        check_stored_tokenizer(source, record, source)
    fresh = not os.path.isdir(target)
    into = target.rstrip("/") + ".tmp" if fresh else target
    if fresh:
        shutil.rmtree(into, ignore_errors=True)
        os.makedirs(into)
    try:
        for name in record["files"]:
            shutil.copyfile(os.path.join(source, name), os.path.join(into, name))
        check_stored_tokenizer(into, record, target)
        if fresh:
            os.replace(into, target)
    except BaseException:
        if fresh:
            shutil.rmtree(into, ignore_errors=True)
        raise
    return record


def stored_tokenizer(
    directory: str, record: dict, model_vocab_size: Optional[int] = None, what: str = ""
) -> Tokenizer:
    """The tokenizer a checkpoint stores in ``directory`` (as ``record`` describes it, checked).

    ``model_vocab_size``: the checkpoint's (unpadded) vocabulary. A Hugging Face model may have
    more embedding rows than its tokenizer has tokens (Qwen2.5: 152064 rows, 151665 tokens); the
    tokenizer's ``vocab_size`` is then the model's, as in transformers (the extra ids are never
    produced by ``tokenize``; ``detokenize`` drops them)."""
    if record.get("type") is None:
        raise DataError(
            f"{what or directory}: the checkpoint's tokenizer files ({', '.join(record['files'])}) hold "
            "no tokenizer.json or tokenizer.model; pass --tokenizer-type / --tokenizer-model"
        )
    check_stored_tokenizer(directory, record, what or directory)
    tokenizer = build_tokenizer(record["type"], directory)
    if model_vocab_size is not None and model_vocab_size > tokenizer.vocab_size:
        tokenizer._vocab_size = model_vocab_size
        tokenizer.unique_identifiers["model_vocab_size"] = model_vocab_size
        tokenizer.unique_description = json.dumps(tokenizer.unique_identifiers, indent=4)
    return tokenizer

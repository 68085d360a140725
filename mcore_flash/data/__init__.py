"""Data layer of ``mcore-flash pretrain``: tokenizers, ``mcore-flash preprocess``, the built-in
synthetic long-range dataset and the GPT datasets, all in Megatron's own formats.

Modules (none imports megatron at import time; they do so inside the functions that need it):

* :mod:`mcore_flash.data.tokenizers` - ``build_tokenizer(tokenizer_type, tokenizer_model)``:
  ``ByteTokenizer`` (default, no download), ``HuggingFaceTokenizer`` (``tokenizer.json`` via
  the optional ``tokenizers`` package), ``SentencePieceTokenizer`` (optional
  ``sentencepiece``), ``NullTokenizer``.
* :mod:`mcore_flash.preprocess` - ``mcore-flash preprocess``: jsonl -> ``P_text_document.bin/.idx``
  written by ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``.
* :mod:`mcore_flash.data.synthetic` - the synthetic key/filler/query/answer task whose loss
  falls below a known floor only if attention reaches ~the whole sequence back.
* :mod:`mcore_flash.data.indexed` - atomic ``.bin/.idx`` writing and a strict ``.idx``/``.bin``
  checker that turns corrupt files into a :class:`DataError` naming the file and the fix.
* :mod:`mcore_flash.data.datasets` - ``build_datasets(...)``: megatron's
  ``BlendedMegatronDatasetBuilder`` + ``GPTDataset`` (or ``MockGPTDataset``), no S x S mask.
"""

from mcore_flash.data.errors import DataError

__all__ = ["DataError"]

"""A real tokenizer.json for tests, trained on the spot with the `tokenizers` package.

Byte-level BPE like Llama-3's, with a post-processor that puts ``bos`` before every encoding
(nothing is downloaded).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import tokenizers as t


def train_bpe(
    path: Path, corpus: Sequence[str], *, vocab_size: int, bos: str, special: Sequence[str] = ()
) -> str:
    """Train on ``corpus``, save to ``path``; returns the path as text."""
    tok = t.Tokenizer(t.models.BPE())
    tok.pre_tokenizer = t.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = t.decoders.ByteLevel()
    trainer = t.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[bos, *(s for s in special if s != bos)],
        initial_alphabet=t.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = t.processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    tok.save(str(path))
    return str(path)

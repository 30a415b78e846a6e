"""The output head of a language model without its logits (plain torch).

:func:`linear_cross_entropy` is the loss; :mod:`lightning_memopt.head.causal_lm` puts it in place of a
Hugging Face causal LM's own head (what ``AutoCheckpoint(head="auto")`` does).
"""

from lightning_memopt.head.loss import default_chunk_size, linear_cross_entropy

__all__ = ["default_chunk_size", "linear_cross_entropy"]

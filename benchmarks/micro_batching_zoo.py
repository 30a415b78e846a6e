"""Is micro-batching exact on transformers architectures this project did not write? A sweep.

Run from the repository root (about two minutes for all 169 rows on 2 CPU cores, a few seconds per
architecture; never run by the test suite)::

    PYTHONPATH=. python benchmarks/micro_batching_zoo.py               # every architecture, k = 2 and 3
    PYTHONPATH=. python benchmarks/micro_batching_zoo.py --limit 10    # the first 10
    PYTHONPATH=. python benchmarks/micro_batching_zoo.py --only gpt2 t5 --sizes 2
    PYTHONPATH=. python benchmarks/micro_batching_zoo.py --oom         # and OOMBackoff (8 fails, 4 fits)

Each architecture is a Hugging Face model class built from a tiny config in code (hidden 32, 2 layers,
vocabulary 96; nothing downloaded), in float64 with every dropout and LayerDrop off, wrapped in the zoo's
plain LightningModule (``training_step: return self.model(**batch).loss``, SGD). Batches of 8 samples,
two steps, realistic batches (:mod:`tests.zoo.models` and the functions below): token batches
right-padded to different lengths with ``labels`` -100 at padding (causal and masked LM, seq2seq,
tagging), one class, value or label set per sample (sequence classification), answer spans (QA, some
outside the input), 32x32 pixels (classification, masked patches, per-pixel classes with 255 ignored),
log-mel features and raw audio with padded transcripts. Ten rows train the same models on data whose
first batch has no padding (length-grouped batching), or whose first batch's answers all lie inside
the input. It trains once unsplit and once with ``AutoAccumulation(micro_batch_size=k)`` for each ``k``
of ``--sizes`` (2 and 3: 3 leaves an uneven last micro-batch), compares the parameters (the zoo tests'
``relative_difference``: max difference over the largest change of the update) and records every
``SplitNotExactWarning``. Each run is one of:

- ``exact``: within the bar and no warning;
- ``warned``: not within the bar, and a warning named why (the contract for what cannot be exact);
- ``false alarm``: within the bar, and a warning all the same;
- ``SILENT``: not within the bar and no warning (the one outcome the package must never give);
- ``crash``: the split run raised (its exception; the unsplit run trained, so the package is involved).

An architecture whose model cannot be built or cannot train unsplit (or ends it with non-finite
parameters) is ``skipped`` with the reason. The bar is 1e-10 of the update, except where a float64 model
computes in float32 (:func:`precision`; the ``precision`` column): its gradient then carries float32
rounding and the bar is 1e-5. It prints a Markdown table, then the totals (by each architecture's worst
run, and per split); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import math
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers.models.auto import modeling_auto

from lightning_memopt import AutoAccumulation, OOMBackoff, SplitNotExactWarning
from lightning_memopt.testing import OOMInjector
from tests.batching.helpers import quiet_trainer
from tests.zoo.models import (
    CLASSES,
    IMAGE,
    SEQ,
    VOCAB,
    ZooEntry,
    ZooModule,
    _padded_tokens,
    causal_lm_batch,
    image_batch,
    loader,
    masked_lm_batch,
    no_dropout,
    seq2seq_batch,
    unpadded_first_batch,
)
from tests.zoo.test_micro_batching_zoo import relative_difference

BATCH = 8  # samples per optimizer step
STEPS = 2
BAR = {torch.float64: 1e-10, torch.float32: 1e-5}  # by the dtype the loss comes back in
AUDIO = 1600  # raw audio samples per input (0.1 s at 16 kHz)
OUTCOMES = ("exact", "warned", "false alarm", "SILENT", "crash")


# ------------------------------------------------------------------------------------------ batches
def classification_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Padded token batches with one class per sample (sequence classification)."""
    ids, mask = _padded_tokens(n, seed)
    gen = torch.Generator().manual_seed(seed + 3)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": torch.randint(0, CLASSES, (n,), generator=gen),
    }


def eos_classification_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """:func:`classification_batch` with each sample's last real token the end-of-sequence token (2): BART
    classifies from the hidden state at the last ``eos``, and refuses samples without one."""
    batch = classification_batch(n, seed)
    last = batch["attention_mask"].sum(dim=1) - 1  # (n,)
    batch["input_ids"] = batch["input_ids"].masked_fill(batch["input_ids"] == 2, 3)
    batch["input_ids"][torch.arange(n), last] = 2
    return batch


def token_classification_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Padded token batches with a class per real token and -100 at padding (named-entity tagging)."""
    ids, mask = _padded_tokens(n, seed)
    gen = torch.Generator().manual_seed(seed + 3)
    tags = torch.randint(0, CLASSES, ids.shape, generator=gen)
    return {"input_ids": ids, "attention_mask": mask, "labels": tags.masked_fill(mask == 0, -100)}


def question_answering_batch(n: int, seed: int = 0, answerable: int = 0) -> dict[str, torch.Tensor]:
    """Padded token batches with an answer span inside each sample, except every third sample after the
    first ``answerable``, whose span lies outside the input (truncated away: Hugging Face clamps such
    positions to the sequence length and its loss ignores them)."""
    ids, mask = _padded_tokens(n, seed)
    gen = torch.Generator().manual_seed(seed + 3)
    lengths = mask.sum(dim=1)
    start = (torch.rand(n, generator=gen) * lengths).long()
    end = torch.minimum(start + torch.randint(0, 3, (n,), generator=gen), lengths - 1)
    outside = (torch.arange(n) % 3 == 2) & (torch.arange(n) >= answerable)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "start_positions": start.masked_fill(outside, 4 * SEQ),
        "end_positions": end.masked_fill(outside, 4 * SEQ),
    }


def multiple_choice_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two padded candidate sequences per sample, and the index of the right one."""
    first, second = _padded_tokens(n, seed), _padded_tokens(n, seed + 5)
    gen = torch.Generator().manual_seed(seed + 3)
    return {
        "input_ids": torch.stack([first[0], second[0]], dim=1),  # (n, 2, SEQ)
        "attention_mask": torch.stack([first[1], second[1]], dim=1),
        "labels": torch.randint(0, 2, (n,), generator=gen),
    }


def regression_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Padded token batches with one real-valued target per sample (``num_labels=1``: mean squared error)."""
    batch = classification_batch(n, seed)
    batch["labels"] = torch.randn(n, generator=torch.Generator().manual_seed(seed + 4))
    return batch


def multi_label_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Padded token batches with a 0/1 target per class (binary cross-entropy over samples x classes)."""
    batch = classification_batch(n, seed)
    gen = torch.Generator().manual_seed(seed + 4)
    batch["labels"] = (torch.rand(n, CLASSES, generator=gen) < 0.4).float()
    return batch


def masked_image_batch(n: int, seed: int = 0, patches: int = (IMAGE // 4) ** 2) -> dict[str, torch.Tensor]:
    """Pixels and a random 40% of the patches masked per image (SimMIM: an L1 loss over masked pixels)."""
    gen = torch.Generator().manual_seed(seed + 4)
    return {
        "pixel_values": image_batch(n, seed)["pixel_values"],
        "bool_masked_pos": torch.rand(n, patches, generator=gen) < 0.4,
    }


def segmentation_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Pixels and a class per pixel, 255 (Hugging Face's ignore value) outside a random box per image."""
    gen = torch.Generator().manual_seed(seed + 4)
    labels = torch.randint(0, CLASSES, (n, IMAGE, IMAGE), generator=gen)
    size = torch.randint(IMAGE // 4, IMAGE + 1, (n,), generator=gen)
    inside = (torch.arange(IMAGE)[None, :, None] < size[:, None, None]) & (
        torch.arange(IMAGE)[None, None, :] < size[:, None, None]
    )
    return {"pixel_values": image_batch(n, seed)["pixel_values"], "labels": labels.masked_fill(~inside, 255)}


def speech_seq2seq_batch(n: int, seed: int = 0, mels: int = 8, frames: int = 32) -> dict[str, torch.Tensor]:
    """Log-mel features (Whisper's fixed length, silence after each clip) and padded transcripts."""
    gen = torch.Generator().manual_seed(seed + 4)
    lengths = torch.randint(frames // 2, frames + 1, (n,), generator=gen)
    features = (
        torch.randn(n, mels, frames, generator=gen) * (torch.arange(frames) < lengths[:, None])[:, None, :]
    )
    return {"input_features": features, "labels": seq2seq_batch(n, seed)["labels"]}


def _audio(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(AUDIO // 2, AUDIO + 1, (n,), generator=gen)
    mask = (torch.arange(AUDIO)[None, :] < lengths[:, None]).long()
    return torch.randn(n, AUDIO, generator=gen) * mask, mask, gen


def ctc_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Raw audio zero-padded to one length, and character labels padded with -100 (Hugging Face's CTC)."""
    values, mask, gen = _audio(n, seed)
    lengths = torch.randint(2, 6, (n,), generator=gen)
    labels = torch.randint(1, VOCAB, (n, 5), generator=gen)
    labels = labels.masked_fill(torch.arange(5)[None, :] >= lengths[:, None], -100)
    return {"input_values": values, "attention_mask": mask, "labels": labels}


def audio_class_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    values, mask, gen = _audio(n, seed)
    return {
        "input_values": values,
        "attention_mask": mask,
        "labels": torch.randint(0, CLASSES, (n,), generator=gen),
    }


# Each task: its Auto* mapping (model type -> class name) and the zoo batch it trains on.
TASKS: dict[str, tuple[dict[str, str], Callable[[int, int], dict]]] = {
    "causal_lm": (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, causal_lm_batch),
    "masked_lm": (modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, masked_lm_batch),
    "seq2seq": (modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, seq2seq_batch),
    "seq_cls": (modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, classification_batch),
    "image_cls": (modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES, image_batch),
    "token_cls": (modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES, token_classification_batch),
    "qa": (modeling_auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES, question_answering_batch),
    "choice": (modeling_auto.MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES, multiple_choice_batch),
    "masked_image": (modeling_auto.MODEL_FOR_MASKED_IMAGE_MODELING_MAPPING_NAMES, masked_image_batch),
    "segmentation": (modeling_auto.MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES, segmentation_batch),
    "speech_seq2seq": (modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES, speech_seq2seq_batch),
    "ctc": (modeling_auto.MODEL_FOR_CTC_MAPPING_NAMES, ctc_batch),
    "audio_cls": (modeling_auto.MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES, audio_class_batch),
}

# ------------------------------------------------------------------------------------------ configs
# Sizes every text config gets (through each config's attribute_map where it names them otherwise);
# names a config does not know become unused attributes. Dropout in the config is 0 where it is named
# so, and no_dropout() catches the rest on the built modules.
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=37,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=0,
    num_labels=CLASSES,
    use_cache=False,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    attn_pdrop=0.0,  # GPT-2's family names its dropouts so; their attention passes it to sdpa as dropout_p
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    router_jitter_noise=0.0,  # mixture-of-experts routers that add noise in training (PhiMoE)
    input_jitter_noise=0.0,
)
SEQ2SEQ = dict(
    TEXT,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=37,
    decoder_ffn_dim=37,
    encoder_layerdrop=0.0,  # LayerDrop skips whole layers at random in training (M2M-100: 0.05)
    decoder_layerdrop=0.0,
)
T5 = dict(d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2, num_heads=4)  # T5's names for the sizes
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
VISION = dict(
    image_size=IMAGE,
    patch_size=4,
    num_channels=3,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    num_labels=CLASSES,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    drop_path_rate=0.0,
)
# Convolutional and staged models name their sizes per stage: only what every one of them takes.
CNN = dict(image_size=IMAGE, num_channels=3, num_labels=CLASSES, drop_path_rate=0.0)
AUDIO_CFG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    conv_dim=(16, 16),
    conv_stride=(5, 4),
    conv_kernel=(10, 8),
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=2,
    num_labels=CLASSES,
    pad_token_id=0,
    ctc_loss_reduction="mean",
    hidden_dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    feat_proj_dropout=0.0,
    layerdrop=0.0,
    mask_time_prob=0.0,
)


@dataclasses.dataclass(frozen=True)
class Arch:
    """One architecture of the sweep: a model type of ``transformers``, the task (which Auto* class), and
    the config's options (the task's defaults, then these)."""

    name: str
    model_type: str
    task: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    batch: Callable[[int, int], dict] | None = None  # None: the task's

    def config(self) -> Any:
        return transformers.AutoConfig.for_model(self.model_type, **self.options)

    def model_class(self) -> type:
        names = TASKS[self.task][0][self.model_type]  # a tuple where a task has several (DeiT: with teacher)
        return getattr(transformers, names if isinstance(names, str) else names[0])

    def build(self, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
        torch.manual_seed(0)
        model = self.model_class()(self.config())
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                # torch's init (scale 1, shift 0): some transformers inits draw BatchNorm scales of about
                # 0.02, which in EfficientNet shrink the features to 1e-34 (a constant classifier)
                module.reset_parameters()
        return no_dropout(model.to(dtype))

    def entry(self) -> ZooEntry:
        return ZooEntry(self.build, self.batch or TASKS[self.task][1], self.task)


def _text(name: str, model_type: str, task: str, drop: tuple[str, ...] = (), **options: Any) -> Arch:
    """A text architecture: the task's sizes, without the names in ``drop`` (a config that refuses them)."""
    base = {k: v for k, v in (SEQ2SEQ if task == "seq2seq" else TEXT).items() if k not in drop}
    return Arch(name, model_type, task, {**base, **options})


def _vision(name: str, model_type: str, task: str = "image_cls", **options: Any) -> Arch:
    return Arch(name, model_type, task, {**VISION, **options})


def _cnn(name: str, model_type: str, **options: Any) -> Arch:
    return Arch(name, model_type, "image_cls", {**CNN, **options})


def _audio_arch(name: str, model_type: str, task: str, **options: Any) -> Arch:
    return Arch(name, model_type, task, {**AUDIO_CFG, **options})


EAGER = dict(experts_implementation="eager")  # the grouped-matmul experts kernel takes no float64 on CPU
ARCHS: list[Arch] = [
    # causal language models: a token mean over labels != -100 after a one-position shift
    *[
        _text(t, t, "causal_lm")
        for t in (
            "gpt2 gpt_neox bloom opt llama mistral qwen2 qwen3 gemma gemma2 phi phi3 falcon stablelm "
            "starcoder2 olmo olmo2 granite cohere persimmon biogpt xglm mpt gpt_bigcode ctrl "
            "openai-gpt mamba rwkv glm nemotron exaone4 smollm3"
        ).split()
    ],
    *[
        _text(t, t, "causal_lm", **MOE, **EAGER)
        for t in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe")
    ],
    *[_text(t, t, "causal_lm", rotary_dim=4) for t in ("gptj", "codegen")],
    _text("helium", "helium", "causal_lm", head_dim=8),
    _text("gpt_neo", "gpt_neo", "causal_lm", attention_types=[[["global", "local"], 1]], num_layers=2),
    _text(
        "trocr",
        "trocr",
        "causal_lm",
        d_model=32,
        decoder_layers=2,
        decoder_attention_heads=4,
        decoder_ffn_dim=37,
    ),
    _text("bart_causal", "bart", "causal_lm", **SEQ2SEQ),
    _text("roberta_causal", "roberta", "causal_lm", is_decoder=True),
    _text(
        "xlnet",
        "xlnet",
        "causal_lm",
        d_model=32,
        n_layer=2,
        n_head=4,
        d_inner=37,
        drop=("max_position_embeddings",),
    ),
    # masked language models: a token mean over labels != -100
    *[
        _text(t, t, "masked_lm")
        for t in (
            "bert roberta distilbert electra deberta deberta-v2 convbert mpnet roformer xlm-roberta "
            "camembert esm megatron-bert rembert data2vec-text ernie layoutlm nystromformer yoso fnet "
            "ibert modernbert"
        ).split()
    ],
    _text("albert", "albert", "masked_lm", embedding_size=16),
    _text("roc_bert", "roc_bert", "masked_lm", shape_vocab_size=VOCAB, pronunciation_vocab_size=VOCAB),
    _text(
        "mobilebert",
        "mobilebert",
        "masked_lm",
        embedding_size=32,
        intra_bottleneck_size=16,
        num_feedforward_networks=2,
    ),
    _text("squeezebert", "squeezebert", "masked_lm", embedding_size=32, intermediate_size=64),
    _text(
        "funnel",
        "funnel",
        "masked_lm",
        drop=("num_hidden_layers",),
        block_sizes=[1, 1],
        d_model=32,
        n_head=4,
        d_head=8,
        d_inner=37,
    ),
    _text("xlm", "xlm", "masked_lm", emb_dim=32, n_layers=2, n_heads=4, pad_index=0),
    _text("big_bird", "big_bird", "masked_lm", attention_type="original_full"),
    # encoder-decoders: a token mean over the target's labels != -100, no shift (decoder inputs shifted)
    *[
        _text(t, t, "seq2seq")
        for t in ("bart mbart marian pegasus blenderbot blenderbot-small plbart m2m_100 mvp").split()
    ],
    _text(
        "led",
        "led",
        "seq2seq",
        attention_window=4,
        max_encoder_position_embeddings=64,
        max_decoder_position_embeddings=64,
    ),
    _text(
        "prophetnet",
        "prophetnet",
        "seq2seq",
        drop=("num_hidden_layers", "encoder_layers", "decoder_layers"),
        num_encoder_layers=2,
        num_decoder_layers=2,
        num_encoder_attention_heads=4,
        num_decoder_attention_heads=4,
        ngram=2,
    ),
    *[
        _text(t, t, "seq2seq", d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2, num_heads=4)
        for t in ("t5", "mt5", "umt5", "longt5")
    ],
    _text(
        "switch_transformers",
        "switch_transformers",
        "seq2seq",
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        num_decoder_layers=2,
        num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1,
        num_experts=4,
    ),
    # sequence classification: a mean over samples (one label each)
    *[
        _text(f"{t}_cls", t, "seq_cls")
        for t in (
            "bert",
            "roberta",
            "distilbert",
            "deberta-v2",
            "electra",
            "gpt2",
            "llama",
            "mistral",
            "qwen2",
        )
    ],
    dataclasses.replace(_text("bart_cls", "bart", "seq_cls", **SEQ2SEQ), batch=eos_classification_batch),
    # other heads' losses: regression (MSE), multi-label (BCE over samples x classes), tagging (a token mean
    # over labels != -100), extractive QA (two means over answerable samples, ignore_index = the sequence
    # length), multiple choice (a mean over samples of (n, 2, T) inputs)
    dataclasses.replace(_text("bert_regression", "bert", "seq_cls", num_labels=1), batch=regression_batch),
    dataclasses.replace(_text("llama_regression", "llama", "seq_cls", num_labels=1), batch=regression_batch),
    dataclasses.replace(
        _text("bert_multilabel", "bert", "seq_cls", problem_type="multi_label_classification"),
        batch=multi_label_batch,
    ),
    *[
        _text(f"{t}_token_cls", t, "token_cls")
        for t in "bert roberta distilbert deberta-v2 gpt2 llama".split()
    ],
    *[_text(f"{t}_qa", t, "qa", num_labels=2) for t in "bert roberta distilbert albert llama qwen2".split()],
    _text("bart_qa", "bart", "qa", **{**SEQ2SEQ, "num_labels": 2}),
    _text(
        "t5_qa", "t5", "qa", num_labels=2, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2, num_heads=4
    ),
    *[_text(f"{t}_choice", t, "choice") for t in "bert roberta distilbert".split()],
    _text(
        "xlnet_choice",
        "xlnet",
        "choice",
        d_model=32,
        n_layer=2,
        n_head=4,
        d_inner=37,
        drop=("max_position_embeddings",),
    ),
    # image classification from pixels: a mean over samples
    *[_vision(t, t) for t in ("vit", "deit", "beit", "data2vec-vision", "dinov2", "vit_msn", "ijepa")],
    _cnn("convnext", "convnext", depths=[1, 1], hidden_sizes=[16, 32], num_stages=2),
    _cnn("convnextv2", "convnextv2", depths=[1, 1], hidden_sizes=[16, 32], num_stages=2),
    _cnn("swin", "swin", patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4),
    _cnn("swinv2", "swinv2", patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4),
    _cnn("resnet", "resnet", embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic"),
    _cnn("regnet", "regnet", embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8),
    _cnn(
        "poolformer",
        "poolformer",
        hidden_sizes=[16, 32],
        depths=[1, 1],
        num_encoder_blocks=2,
        patch_sizes=[7, 3],
        strides=[4, 2],
        padding=[2, 1],
        pool_size=3,
    ),
    _cnn(
        "levit",
        "levit",
        drop_path_rate=0,
        patch_size=16,
        hidden_sizes=[32, 48],
        num_attention_heads=[2, 2],
        depths=[1, 1],
        key_dim=[8, 8],
        mlp_ratio=[2, 2],
        attention_ratio=[2, 2],
        down_ops=[["Subsample", 8, 2, 4, 2, 2]],
    ),
    _cnn("mobilenet_v1", "mobilenet_v1", depth_multiplier=0.25, min_depth=8),
    _cnn("mobilenet_v2", "mobilenet_v2", depth_multiplier=0.35),
    _cnn("efficientnet", "efficientnet", width_coefficient=0.25, depth_coefficient=0.3, hidden_dim=320),
    _cnn("mobilevit", "mobilevit", hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32]),
    _cnn(
        "segformer",
        "segformer",
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[16, 32],
        patch_sizes=[7, 3],
        strides=[4, 2],
        num_attention_heads=[1, 2],
        mlp_ratios=[2, 2],
    ),
    _cnn(
        "pvt",
        "pvt",
        num_encoder_blocks=2,
        depths=[1, 1],
        sequence_reduction_ratios=[2, 1],
        hidden_sizes=[16, 32],
        patch_sizes=[4, 2],
        strides=[4, 2],
        num_attention_heads=[1, 2],
        mlp_ratios=[2, 2],
    ),
    _cnn(
        "focalnet",
        "focalnet",
        patch_size=2,
        embed_dim=16,
        depths=[1, 1],
        focal_levels=[2, 2],
        focal_windows=[3, 3],
    ),
    _cnn(
        "bit",
        "bit",
        embedding_size=32,
        hidden_sizes=[32, 64],
        depths=[1, 1],
        layer_type="preactivation",
        num_groups=4,
    ),
    _cnn("cvt", "cvt", embed_dim=[8, 16, 32], num_heads=[1, 2, 4], depth=[1, 2, 3], drop_path_rate=[0.0] * 3),
    # masked image modeling (SimMIM: L1 over the masked pixels / (masked patches + 1e-5) / channels) and
    # semantic segmentation (a pixel mean over labels != 255 of logits upsampled to the labels)
    _vision("vit_mim", "vit", task="masked_image", encoder_stride=4),
    _vision("deit_mim", "deit", task="masked_image", encoder_stride=4),
    dataclasses.replace(
        _cnn(
            "swin_mim",
            "swin",
            patch_size=2,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[2, 2],
            window_size=4,
            encoder_stride=4,
        ),
        task="masked_image",
        batch=lambda n, seed=0: masked_image_batch(n, seed, patches=(IMAGE // 2) ** 2),
    ),
    dataclasses.replace(
        _cnn(
            "segformer_seg",
            "segformer",
            num_encoder_blocks=2,
            depths=[1, 1],
            sr_ratios=[2, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[7, 3],
            strides=[4, 2],
            num_attention_heads=[1, 2],
            mlp_ratios=[2, 2],
            decoder_hidden_size=32,
        ),
        task="segmentation",
    ),
    _vision(
        "beit_seg",
        "beit",
        task="segmentation",
        num_hidden_layers=4,
        out_indices=[1, 2, 3, 4],
        use_auxiliary_head=True,
        auxiliary_channels=16,
        pool_scales=[1, 2],
        channels=32,
    ),
    # speech: log-mel features to padded transcripts
    Arch(
        "whisper",
        "whisper",
        "speech_seq2seq",
        {**SEQ2SEQ, "num_mel_bins": 8, "max_source_positions": 16, "max_target_positions": 64},
    ),
    # the same models when the first batch has no padding (length-grouped batches: the longest first), and
    # QA when the first batch's answers all lie inside the input: what the engine learns on the first
    # batch meets padding, or an unanswerable sample, only later
    *[
        dataclasses.replace(arch, name=f"{arch.name}_unpadded_first", batch=unpadded_first_batch(*how, BATCH))
        for arch, how in [
            (_text("gpt2", "gpt2", "causal_lm"), (causal_lm_batch, "input_ids")),
            (_text("llama", "llama", "causal_lm"), (causal_lm_batch, "input_ids")),
            (_text("qwen2", "qwen2", "causal_lm"), (causal_lm_batch, "input_ids")),
            (_text("t5", "t5", "seq2seq", **T5), (seq2seq_batch, "tokens")),
            (_text("bart", "bart", "seq2seq"), (seq2seq_batch, "tokens")),
            (_text("marian", "marian", "seq2seq"), (seq2seq_batch, "tokens")),
            (_text("bert_token_cls", "bert", "token_cls"), (token_classification_batch, "classes")),
            (_text("llama_token_cls", "llama", "token_cls"), (token_classification_batch, "classes")),
        ]
    ],
    *[
        dataclasses.replace(
            _text(f"{t}_qa_answerable_first", t, "qa", num_labels=2),
            batch=functools.partial(question_answering_batch, answerable=BATCH),
        )
        for t in ("bert", "llama")
    ],
    # speech from raw audio: CTC over padded character labels, and one class per clip
    *[
        _audio_arch(f"{t}_ctc", t, "ctc")
        for t in ("wav2vec2", "hubert", "wavlm", "unispeech-sat", "data2vec-audio")
    ],
    _audio_arch("wav2vec2_ctc_sum", "wav2vec2", "ctc", ctc_loss_reduction="sum"),
    *[_audio_arch(f"{t}_cls", t, "audio_cls") for t in ("wav2vec2", "hubert")],
]


# ------------------------------------------------------------------------------------------ the sweep
@dataclasses.dataclass
class Run:
    """One split run: the relative difference, the warnings' texts, or the exception."""

    size: int | str  # micro_batch_size, or "oom" (OOMBackoff)
    rel: float = math.nan
    warnings: list[str] = dataclasses.field(default_factory=list)
    error: str = ""
    bar: float = BAR[torch.float64]

    @property
    def outcome(self) -> str:
        if self.error:
            return "crash"
        exact = self.rel <= self.bar  # NaN is not
        if self.warnings:
            return "false alarm" if exact else "warned"
        return "exact" if exact else "SILENT"


@dataclasses.dataclass
class Result:
    arch: Arch
    params: int = 0
    precision: str = ""  # "float64", or "float32" and what is: the loss, or parameters
    skipped: str = ""
    runs: list[Run] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def outcome(self) -> str:
        """The worst of the runs (crash, SILENT, false alarm, warned, exact), or ``skipped``."""
        if self.skipped:
            return "skipped"
        return max(
            (r.outcome for r in self.runs),
            key=lambda o: ("exact", "warned", "false alarm", "SILENT", "crash").index(o),
        )


class SweepModule(ZooModule):
    """The zoo's module (``model(**batch).loss``, SGD) that remembers the dtype its loss came back in."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.loss_dtype = loss.dtype
        return loss


def summary(error: BaseException) -> str:
    """The exception and the innermost frame it came from, on one line."""
    frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    where = f" ({frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} {frame.name})" if frame else ""
    return f"{type(error).__name__}: {' '.join(str(error).split())[:160]}{where}"


def precision(module: SweepModule) -> tuple[str, float]:
    """What a float64 model computed its update in, and the bar that goes with it: float32 where its loss
    came back in float32 (Hugging Face's causal-LM loss upcasts with ``.float()``) or where it made some of
    its parameters float32 (Switch Transformers' router casts its classifier in ``forward``)."""
    low = [n for n, p in module.named_parameters() if p.dtype == torch.float32]
    if module.loss_dtype == torch.float32:
        return "float32 loss", BAR[torch.float32]
    if low:
        return f"float32 params ({'.'.join(low[0].split('.')[-3:-1])})", BAR[torch.float32]
    return "float64", BAR[torch.float64]


def train(entry: ZooEntry, size: int | str | None) -> tuple[dict, SweepModule, list[str]]:
    """STEPS SGD steps on batches of BATCH in float64: unsplit (``size`` None), split by
    ``AutoAccumulation(micro_batch_size=size)``, or (``"oom"``) by ``OOMBackoff`` after an injected
    out-of-memory error above BATCH // 2 samples; the start parameters, the module and the texts of the
    SplitNotExactWarnings."""
    module = SweepModule(entry, dtype=torch.float64)
    start = {k: p.detach().clone() for k, p in module.named_parameters()}
    oom = OOMInjector(module.model, max_size=BATCH // 2) if size == "oom" else contextlib.nullcontext()
    callbacks = {None: [], "oom": [OOMBackoff(log=False)]}.get(size)
    callbacks = [AutoAccumulation(micro_batch_size=size, log=False)] if callbacks is None else callbacks
    with warnings.catch_warnings(record=True) as caught, oom:
        warnings.simplefilter("always")
        quiet_trainer(callbacks, max_steps=STEPS).fit(
            module, loader(entry, BATCH, batches=STEPS, dtype=torch.float64)
        )
    found = [str(w.message) for w in caught if issubclass(w.category, SplitNotExactWarning)]
    return start, module, found


def sweep_one(arch: Arch, sizes: list[int | str]) -> Result:
    result = Result(arch)
    began = time.perf_counter()
    try:
        entry = arch.entry()
        start, reference, _ = train(entry, None)
    except Exception as error:  # the model, not the package: it cannot train here unsplit
        result.skipped = summary(error)
        result.seconds = time.perf_counter() - began
        return result
    if not all(bool(torch.isfinite(p).all()) for p in reference.parameters()):
        result.skipped = (
            "the unsplit run's parameters are not finite: the model's own gradients on this batch"
        )
        result.seconds = time.perf_counter() - began
        return result
    result.params = sum(p.numel() for p in reference.parameters())
    result.precision, bar = precision(reference)
    for size in sizes:
        run = Run(size, bar=bar)
        try:
            _, split, run.warnings = train(entry, size)
            run.rel = relative_difference(start, split, reference)
        except Exception as error:
            run.error = summary(error)
        result.runs.append(run)
    result.seconds = time.perf_counter() - began
    return result


# ------------------------------------------------------------------------------------------ the table
def _cell(run: Run) -> str:
    return f"{run.outcome} ({'-' if run.error else f'{run.rel:.1e}'})"


def _label(size: int | str) -> str:
    return "OOMBackoff" if size == "oom" else f"k={size}"


def _note(result: Result) -> str:
    if result.skipped:
        return result.skipped
    for run in result.runs:  # the first run's text that explains the row
        if run.error:
            return f"{_label(run.size)}: {run.error}"
        if run.warnings:
            return f"{_label(run.size)}: {' '.join(run.warnings[0].split())[:220]}"
    return ""


def table(results: list[Result], sizes: list[int]) -> str:
    head = [
        "architecture",
        "task",
        "model type",
        "params",
        "precision",
        *[_label(k) for k in sizes],
        "outcome",
        "s",
        "warning / error",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [_cell(run) for run in r.runs] or ["-"] * len(sizes)
        row = [
            r.arch.name,
            r.arch.task,
            r.arch.model_type,
            f"{r.params:,}" if r.params else "-",
            r.precision or "-",
            *cells,
            r.outcome,
            f"{r.seconds:.1f}",
            _note(r).replace("|", "/"),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def totals(results: list[Result], sizes: list[int]) -> str:
    count = {o: sum(r.outcome == o for r in results) for o in (*OUTCOMES, "skipped")}
    lines = [
        f"architectures: {len(results)}; by their worst run: "
        + ", ".join(f"{o} {n}" for o, n in count.items())
    ]
    for i, k in enumerate(sizes):
        runs = [r.runs[i] for r in results if not r.skipped]
        lines.append(
            f"{_label(k)}: " + ", ".join(f"{o} {sum(run.outcome == o for run in runs)}" for o in OUTCOMES)
        )
    return "\n".join(lines)


def sweep_table(archs: list[Arch], one: Callable[[Arch], tuple[str, list[str]]], columns: list[str]) -> dict:
    """Print a Markdown table, a row per architecture (``one(arch)``: its outcome, and the row's cells
    after the name, under ``columns``), then the totals by outcome; progress goes to stderr. The sweeps
    of single treatments over these architectures (head_zoo.py, pointwise_zoo.py) print with it.
    Returns the totals."""
    totals: dict[str, int] = {}
    print(f"| architecture | {' | '.join(columns)} |\n|---|{'---|' * len(columns)}")
    for arch in archs:
        print(arch.name, file=sys.stderr)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outcome, cells = one(arch)
        totals[outcome] = totals.get(outcome, 0) + 1
        print(f"| {arch.name} | {' | '.join(cells)} |", flush=True)
    print("\n" + ", ".join(f"{k}: {v}" for k, v in sorted(totals.items())))
    return totals


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, help="only the first N architectures")
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", help="only these architectures (names of the table)"
    )
    parser.add_argument(
        "--sizes",
        type=lambda s: [int(k) for k in s.split(",")],
        default=[2, 3],
        help="micro-batch sizes, comma-separated (default 2,3)",
    )
    parser.add_argument(
        "--oom",
        action="store_true",
        help="also OOMBackoff after an injected out-of-memory error above 4 samples (8 fails, 4 fits)",
    )
    args = parser.parse_args(argv)
    sizes: list[int | str] = [*args.sizes, *(["oom"] if args.oom else [])]
    archs = ARCHS
    if args.only:
        unknown = sorted(set(args.only) - {a.name for a in ARCHS})
        if unknown:
            parser.error(f"unknown architectures {unknown}; known: {', '.join(a.name for a in ARCHS)}")
        archs = [a for a in ARCHS if a.name in args.only]
    archs = archs[: args.limit] if args.limit else archs
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # "GPU available", "max_steps reached"
    results = []
    for arch in archs:
        results.append(sweep_one(arch, sizes))
        r = results[-1]
        print(
            f"{arch.name:<22}{r.outcome:<12}{r.seconds:6.1f} s  {_note(r)[:150]}", file=sys.stderr, flush=True
        )
    print(table(results, sizes))
    print()
    print(totals(results, sizes))
    return results


if __name__ == "__main__":
    main()

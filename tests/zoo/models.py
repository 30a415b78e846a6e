"""A zoo of third-party architectures, built from tiny configs (nothing downloaded), with their defaults.

Every model here was written by someone else: Hugging Face transformers (text, mixture-of-experts,
encoder-decoder, vision transformers and CNNs) and ``torch.nn``'s Transformer stacks. Defaults are kept
(``use_cache=True``, dropout, in-place activations, BatchNorm) except where a test says otherwise: only
sizes are small, so that the whole zoo runs in CI on a CPU.

``ZOO[name]`` is a :class:`ZooEntry`: ``build()`` makes the bare model, ``batch(n, seed)`` a batch of
``n`` samples for it (token batches are right-padded to different lengths, with ``labels`` set to -100
at padded positions, the Hugging Face convention), and :class:`ZooModule` wraps either in a
LightningModule whose ``training_step`` returns the model's own loss.

Precision: Hugging Face's causal-LM loss upcasts logits with ``.float()``, which in a float64 model
casts *down* to float32; check those models' exactness in float32 (rel 1e-5). The others keep float64
throughout and are checked to 1e-10. Dropout draws different masks when a batch is split, so
exactness tests of micro-batching set the dropout probabilities to 0 (:func:`no_dropout`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

transformers = __import__("pytest").importorskip("transformers")

VOCAB = 96
SEQ = 16
IMAGE = 32
CLASSES = 5


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    """One architecture: how to build it and make its batches."""

    build: Callable[..., nn.Module]  # build(dtype=torch.float32)
    batch: Callable[[int, int], dict[str, torch.Tensor]]
    kind: str  # "causal_lm", "masked_lm", "seq2seq", "image", "torch"
    has_batchnorm: bool = False


def _lengths(n: int, gen: torch.Generator, low: int = 3) -> torch.Tensor:
    return torch.randint(low, SEQ + 1, (n,), generator=gen)


def _padded_tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (n, SEQ) right-padded with 0, and the attention mask (1 where a token is real)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=gen)
    mask = (torch.arange(SEQ)[None, :] < _lengths(n, gen)[:, None]).long()  # (n, SEQ)
    return ids * mask, mask


def causal_lm_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    ids, mask = _padded_tokens(n, seed)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def packed_causal_lm_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full-length sequences without ``attention_mask`` (packed pretraining batches): with no mask,
    transformers runs grouped-query attention inside SDPA (``enable_gqa``, its ``use_gqa_in_sdpa``) instead
    of repeating the key/value heads first, so key/value reach the attention op with fewer heads than the
    query (torch 2.11's FLOP formula for it asserts, issue 33)."""
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def masked_lm_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    ids, mask = _padded_tokens(n, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    chosen = (torch.rand(n, SEQ, generator=gen) < 0.3) & (mask == 1)
    chosen[:, 0] = True  # at least one predicted position per sample
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(~chosen, -100)}


def seq2seq_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    ids, mask = _padded_tokens(n, seed)
    target, target_mask = _padded_tokens(n, seed + 7)
    return {"input_ids": ids, "attention_mask": mask, "labels": target.masked_fill(target_mask == 0, -100)}


def image_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randn(n, 3, IMAGE, IMAGE, generator=gen),
        "labels": torch.randint(0, CLASSES, (n,), generator=gen),
    }


def unpadded_first_batch(
    fn: Callable[[int, int], dict], labels: str, first_samples: int = 8
) -> Callable[[int, int], dict]:
    """``fn``'s batches with the first ``first_samples`` samples (the first step's batch) at full length:
    no padding and no -100 label, as length-grouped batching (Hugging Face's ``group_by_length``) gives
    the longest batch first; the later batches padded as before. ``labels``: what fills the first batch's
    -100 labels, ``"input_ids"`` (a causal LM's labels are its inputs), ``"tokens"`` (a target sequence)
    or ``"classes"`` (tags)."""

    def batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
        b = fn(n, seed)
        gen = torch.Generator().manual_seed(seed + 12)
        first = (torch.arange(n) < first_samples)[:, None]  # (n, 1)
        tokens = torch.randint(1, VOCAB, b["input_ids"].shape, generator=gen)
        b["input_ids"] = torch.where(first & (b["attention_mask"] == 0), tokens, b["input_ids"])
        b["attention_mask"] = b["attention_mask"].masked_fill(first, 1)
        fill = {
            "input_ids": b["input_ids"],
            "tokens": torch.randint(1, VOCAB, b["labels"].shape, generator=gen),
            "classes": torch.randint(0, CLASSES, b["labels"].shape, generator=gen),
        }[labels]
        b["labels"] = torch.where(first & (b["labels"] == -100), fill, b["labels"])
        return b

    return batch


def _tiny_text(**extra: Any) -> dict[str, Any]:
    return {"vocab_size": VOCAB, "pad_token_id": 0, **extra}


def gpt2(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = transformers.GPT2Config(**_tiny_text(n_layer=3, n_embd=32, n_head=2, n_positions=SEQ))
    return transformers.GPT2LMHeadModel(cfg).to(dtype)


def llama(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = transformers.LlamaConfig(
        **_tiny_text(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
        )
    )
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def _gqa(**extra: Any) -> dict[str, Any]:
    """A tiny grouped-query config: 4 query heads share 2 key/value heads (num_key_value_heads <
    num_attention_heads, as Llama 3, Mistral, Qwen 2, Gemma 2 and Phi-3 ship)."""
    return _tiny_text(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        **extra,
    )


def mistral(dtype: torch.dtype = torch.float32) -> nn.Module:
    # sliding_window below SEQ: the window mask is exercised, not only the causal one
    cfg = transformers.MistralConfig(**_gqa(sliding_window=8))
    return transformers.MistralForCausalLM(cfg).to(dtype)


def qwen2(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = transformers.Qwen2Config(**_gqa())  # biases on q/k/v, unlike Llama
    return transformers.Qwen2ForCausalLM(cfg).to(dtype)


def gemma2(dtype: torch.dtype = torch.float32) -> nn.Module:
    # Gemma 2: a local (sliding) and a global layer alternating, soft-capped attention and logits, tied head
    cfg = transformers.Gemma2Config(**_gqa(head_dim=8, sliding_window=8))
    return transformers.Gemma2ForCausalLM(cfg).to(dtype)


def phi3(dtype: torch.dtype = torch.float32) -> nn.Module:
    # fused qkv_proj and gate_up_proj; its default eos_token_id (32000) is outside the tiny vocabulary
    cfg = transformers.Phi3Config(**_gqa(bos_token_id=1, eos_token_id=2))
    return transformers.Phi3ForCausalLM(cfg).to(dtype)


def mixtral(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = transformers.MixtralConfig(
        **_tiny_text(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=SEQ,
        ),
        # The default grouped-matmul experts kernel takes no float64 on CPU; the eager loop computes the same.
        experts_implementation=None if dtype == torch.float32 else "eager",
    )
    return transformers.MixtralForCausalLM(cfg).to(dtype)


def bert(dtype: torch.dtype = torch.float32, positions: int = SEQ) -> nn.Module:
    cfg = transformers.BertConfig(
        **_tiny_text(
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=positions,
        )
    )
    return transformers.BertForMaskedLM(cfg).to(dtype)


def t5(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = transformers.T5Config(
        **_tiny_text(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4),
        decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(cfg).to(dtype)


def vit(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = transformers.ViTConfig(
        image_size=IMAGE,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=CLASSES,
    )
    return transformers.ViTForImageClassification(cfg).to(dtype)


def resnet(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = transformers.ResNetConfig(
        embedding_size=16,
        hidden_sizes=[16, 32, 48, 64],
        depths=[2, 2, 2, 2],
        layer_type="basic",
        num_labels=CLASSES,
    )
    return transformers.ResNetForImageClassification(cfg).to(dtype)


def resnet_bottleneck(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = transformers.ResNetConfig(
        embedding_size=16,
        hidden_sizes=[32, 64, 96, 128],
        depths=[1, 2, 2, 1],
        layer_type="bottleneck",
        num_labels=CLASSES,
    )
    return transformers.ResNetForImageClassification(cfg).to(dtype)


def convnext(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = transformers.ConvNextConfig(hidden_sizes=[16, 32, 48, 64], depths=[2, 2, 2, 2], num_labels=CLASSES)
    return transformers.ConvNextForImageClassification(cfg).to(dtype)


def mobilenet_v2(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = transformers.MobileNetV2Config(image_size=IMAGE, depth_multiplier=0.35, num_labels=CLASSES)
    return transformers.MobileNetV2ForImageClassification(cfg).to(dtype)


def efficientnet(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = transformers.EfficientNetConfig(
        image_size=IMAGE, width_coefficient=0.25, depth_coefficient=0.3, hidden_dim=320, num_labels=CLASSES
    )
    model = transformers.EfficientNetForImageClassification(cfg).to(dtype)
    # transformers draws BatchNorm scales from N(0, 0.02): the features then shrink to ~1e-34 and only the
    # classifier's bias learns, so an exactness test on it could not fail; torch's init (1, 0) instead
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    return model


def swin(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = transformers.SwinConfig(
        image_size=IMAGE,
        patch_size=2,
        embed_dim=16,
        depths=[2, 2],
        num_heads=[2, 2],
        window_size=4,
        num_labels=CLASSES,
    )
    return transformers.SwinForImageClassification(cfg).to(dtype)


class TorchTransformerLM(nn.Module):
    """``nn.TransformerEncoder`` and ``nn.TransformerDecoder`` with their defaults (sequence-first,
    dropout 0.1, ReLU), as a sequence-to-sequence model over token ids; loss is HF-style: a token mean
    over ``labels != -100``."""

    def __init__(self, dtype: torch.dtype = torch.float32, d_model: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d_model, 4, 64), layers)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(d_model, 4, 64), layers)
        self.head = nn.Linear(d_model, VOCAB)
        self.to(dtype)

    def forward(self, input_ids, attention_mask, labels):
        src = self.embed(input_ids).transpose(0, 1)  # (T, B, C): the modules' default layout
        tgt = self.embed(labels.clamp(min=0)).transpose(0, 1)
        memory = self.encoder(src, src_key_padding_mask=attention_mask == 0)
        out = self.decoder(tgt, memory, memory_key_padding_mask=attention_mask == 0)
        logits = self.head(out).transpose(0, 1)  # (B, T, V)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        return transformers.modeling_outputs.Seq2SeqLMOutput(loss=loss, logits=logits)


ZOO: dict[str, ZooEntry] = {
    "gpt2": ZooEntry(gpt2, causal_lm_batch, "causal_lm"),
    "llama": ZooEntry(llama, causal_lm_batch, "causal_lm"),
    "mixtral": ZooEntry(mixtral, causal_lm_batch, "causal_lm"),
    "mistral": ZooEntry(mistral, causal_lm_batch, "causal_lm"),
    "qwen2": ZooEntry(qwen2, causal_lm_batch, "causal_lm"),
    "gemma2": ZooEntry(gemma2, causal_lm_batch, "causal_lm"),
    "phi3": ZooEntry(phi3, causal_lm_batch, "causal_lm"),
    "bert": ZooEntry(bert, masked_lm_batch, "masked_lm"),
    "t5": ZooEntry(t5, seq2seq_batch, "seq2seq"),
    "vit": ZooEntry(vit, image_batch, "image"),
    "resnet": ZooEntry(resnet, image_batch, "image", has_batchnorm=True),
    "resnet_bottleneck": ZooEntry(resnet_bottleneck, image_batch, "image", has_batchnorm=True),
    "convnext": ZooEntry(convnext, image_batch, "image"),
    "mobilenet_v2": ZooEntry(mobilenet_v2, image_batch, "image", has_batchnorm=True),
    "efficientnet": ZooEntry(efficientnet, image_batch, "image", has_batchnorm=True),
    "swin": ZooEntry(swin, image_batch, "image"),
    "torch_transformer": ZooEntry(TorchTransformerLM, seq2seq_batch, "torch"),
}


def trocr(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = transformers.TrOCRConfig(
        **_tiny_text(d_model=16, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=32),
        max_position_embeddings=30,
        use_cache=False,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    return transformers.TrOCRForCausalLM(cfg).to(dtype)


def marian(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = transformers.MarianConfig(
        **_tiny_text(d_model=16, encoder_layers=2, decoder_layers=2),
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=SEQ,
        decoder_start_token_id=0,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    return transformers.MarianMTModel(cfg).to(dtype)


def xlnet(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = transformers.XLNetConfig(
        **_tiny_text(d_model=32, n_layer=2, n_head=4, d_inner=64), mem_len=10, dropout=0.0
    )
    return transformers.XLNetLMHeadModel(cfg).to(dtype)


def xlm(dtype: torch.dtype = torch.float32) -> nn.Module:
    cfg = transformers.XLMConfig(
        **_tiny_text(emb_dim=32, n_layers=2, n_heads=4),
        max_position_embeddings=SEQ,
        pad_index=0,
        dropout=0.0,
        attention_dropout=0.0,
    )
    return transformers.XLMWithLMHeadModel(cfg).to(dtype)


# Generation heads whose own loss is a mean over the labels != -100 WITHOUT a causal shift (issue 19): a
# split weighted as if shifted is not exact. Kept out of ZOO (each ZOO test would run them). Sizes in
# the spirit of transformers' own test configs; dropout 0 in the config (they exist to test exactness).
UNSHIFTED: dict[str, ZooEntry] = {
    "trocr": ZooEntry(trocr, causal_lm_batch, "causal_lm"),
    "marian": ZooEntry(marian, seq2seq_batch, "seq2seq"),
    "xlnet": ZooEntry(xlnet, masked_lm_batch, "masked_lm"),
    "xlm": ZooEntry(xlm, masked_lm_batch, "masked_lm"),
}


def entry(name: str | ZooEntry) -> ZooEntry:
    """``ZOO[name]`` or ``UNSHIFTED[name]``; an entry built elsewhere (benchmarks/micro_batching_zoo.py's
    sweep) passes through, so :class:`ZooModule` and :func:`loader` take one in place of a name."""
    if isinstance(name, ZooEntry):
        return name
    return ZOO[name] if name in ZOO else UNSHIFTED[name]


class ZooModule(pl.LightningModule):
    """A LightningModule as a user writes one around a third-party model: ``model(**batch).loss``."""

    def __init__(self, name: str | ZooEntry, lr: float = 0.05, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = entry(name).build(dtype).to(dtype)
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader(
    name: str | ZooEntry,
    batch_size: int,
    batches: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    batch: Callable[[int, int], dict[str, torch.Tensor]] | None = None,
):
    """A DataLoader yielding ``batches`` batches of ``batch_size`` samples for ``ZOO[name]`` (or
    ``UNSHIFTED[name]``); ``batch``: another batch function than the entry's."""
    full = (batch or entry(name).batch)(batch_size * batches, seed)
    samples = [
        {k: (v[i].to(dtype) if v.is_floating_point() else v[i]) for k, v in full.items()}
        for i in range(batch_size * batches)
    ]
    return torch.utils.data.DataLoader(samples, batch_size=batch_size, shuffle=False)


def no_dropout(module: nn.Module) -> nn.Module:
    """Set every dropout probability in ``module`` to 0 (modules, HF attention-dropout attributes, and
    stochastic depth: HF's ``*DropPath`` modules keep theirs in ``drop_prob``, e.g. Swin's 0.1)."""
    for sub in module.modules():
        if isinstance(sub, nn.modules.dropout._DropoutNd):
            sub.p = 0.0
        for attr in ("attention_dropout", "dropout", "dropout_prob", "drop_prob"):
            if isinstance(getattr(sub, attr, None), float):
                setattr(sub, attr, 0.0)
    return module


class _SecondMicroBatchPeak(pl.Callback):
    """The peak of an accumulated step's second micro-batch (gradients held), its optimizer step included."""

    def __init__(self) -> None:
        self.peak, self.tracker = 0, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            from lightning_memopt.memory import MemoryTracker

            self.tracker = MemoryTracker(pl_module, trainer.optimizers)
            self.tracker.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 1:
            self.tracker.__exit__(None, None, None)
            self.peak = self.tracker.peak


def whole_job_limit(name: str, batch: int, precision: str) -> int:
    """A limit in live tensor bytes that a batch of ``batch`` samples of ``ZOO[name]`` does not fit whole: a
    plain step's peak at a quarter of the batch plus half its growth to half the batch (each the second
    micro-batch of an accumulated step, dropout off, SGD), so that the search's ways, the trial and the plan
    all run. The whole job's test and ``benchmarks/whole_job_zoo.py`` read it."""
    from tests.batching.helpers import quiet_trainer

    peaks = []
    for micro in (batch // 4, batch // 2):
        peak = _SecondMicroBatchPeak()
        trainer = quiet_trainer([peak], max_steps=1, precision=precision, accumulate_grad_batches=2)
        trainer.fit(no_dropout(ZooModule(name, lr=0.01)), loader(name, micro, batches=2))
        peaks.append(peak.peak)
    return peaks[0] + (peaks[1] - peaks[0]) // 2

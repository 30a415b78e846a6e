"""Architectures that break naive block discovery and recomputation (issue 21), from tiny configs.

Each entry builds a Hugging Face transformers model (or a small torch model) that exercises one failure
found from outside: a hybrid stack whose layer classes alternate, layers that write state in their
forward, layers called as ``layer.forward(...)``, reversible layers, a model whose image tokenizer the
text-only forward never runs, a stack of one layer, small CNNs where checkpointing saves little, and a
classifier with as many classes as blocks. Batches come from ``tests/zoo/models.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.zoo.models import CLASSES, VOCAB, ZooEntry, causal_lm_batch, image_batch, masked_lm_batch

transformers = __import__("pytest").importorskip("transformers")


def _text(**extra):
    return {"vocab_size": VOCAB, "pad_token_id": 0, **extra}


def jamba(dtype=torch.float32) -> nn.Module:
    """Mamba and attention layers alternating in one ModuleList (a hybrid stack); MoE on every 2nd."""
    cfg = transformers.JambaConfig(
        **_text(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4),
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        mamba_d_state=4,
        mamba_d_conv=2,
        mamba_expand=2,
        mamba_dt_rank=4,
        experts_implementation="eager",  # the grouped-matmul kernel takes no float64 on CPU
    )
    return transformers.JambaForCausalLM(cfg).to(dtype)


def recurrent_gemma(dtype=torch.float32) -> nn.Module:
    """Recurrent layers keep their recurrent and convolution states as attributes, written in forward."""
    cfg = transformers.RecurrentGemmaConfig(
        **_text(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4),
        num_key_value_heads=2,
        lru_width=32,
        attention_window_size=8,
        conv1d_width=3,
        head_dim=8,
        block_types=["recurrent", "recurrent", "attention"],
    )
    return transformers.RecurrentGemmaForCausalLM(cfg).to(dtype)


def xlstm(dtype=torch.float32) -> nn.Module:
    """transformers' own xLSTM test configuration (``use_cache=True``): the model passes each block its
    recurrent state from an ``xLSTMCache`` and copies the block's new state into those very tensors, in
    place, after the block returns: a block's recorded input is written after it ran."""
    cfg = transformers.xLSTMConfig(
        **_text(hidden_size=128, num_hidden_layers=2, num_heads=2), qk_dim_factor=0.5, v_dim_factor=1.0
    )
    return transformers.xLSTMForCausalLM(cfg).to(dtype)


def voxtral_realtime(dtype=torch.float32) -> nn.Module:
    """An audio tower whose stem (a causal conv embedder) takes the model's ``padding_cache`` (a
    ``VoxtralRealtimeConv1dPaddingCache``, no ``transformers.cache_utils.Cache``) and stores in it the frames
    it padded with, for the next call; text layers with grouped-query attention."""
    audio = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    audio.update(num_key_value_heads=4, head_dim=8, num_mel_bins=16, max_position_embeddings=AUDIO_FRAMES)
    audio.update(sliding_window=AUDIO_FRAMES)
    text = _text(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    text.update(num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=64)
    cfg = transformers.VoxtralRealtimeConfig(audio_config=audio, text_config=text)
    return transformers.VoxtralRealtimeForConditionalGeneration(cfg).to(dtype)


AUDIO_TOKENS = 8  # the text is as long as the audio embeddings it is summed with: 8 mel frames per token
AUDIO_FRAMES = 8 * AUDIO_TOKENS


def audio_text_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, AUDIO_TOKENS), generator=gen)
    return {
        "input_ids": ids,
        "labels": ids,
        "input_features": torch.randn(n, 16, AUDIO_FRAMES, generator=gen),
    }


def squeezebert(dtype=torch.float32) -> nn.Module:
    """The encoder calls its layers as ``layer.forward(...)``: module hooks never fire."""
    cfg = transformers.SqueezeBertConfig(
        **_text(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
        embedding_size=32,
        q_groups=2,
        k_groups=2,
        v_groups=2,
        post_attention_groups=2,
        intermediate_groups=4,
        output_groups=1,
    )
    return transformers.SqueezeBertForMaskedLM(cfg).to(dtype)


def ibert(dtype=torch.float32) -> nn.Module:
    """Quantization observers rebind their range buffers in every training forward."""
    cfg = transformers.IBertConfig(
        **_text(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
        quant_mode=True,
    )
    return transformers.IBertForMaskedLM(cfg).to(dtype)


def reformer(dtype=torch.float32) -> nn.Module:
    """Reversible layers: run without gradients inside the model's own autograd function."""
    cfg = transformers.ReformerConfig(
        **_text(hidden_size=32, num_attention_heads=2, attention_head_size=16, feed_forward_size=64),
        # Local attention only, without dropout: its layers draw seeds with torch.seed() (not reproducible)
        # and LSH attention hashes with random rotations, so two plain runs differ otherwise.
        attn_layers=["local", "local", "local", "local"],
        hidden_dropout_prob=0.0,
        local_attention_probs_dropout_prob=0.0,
        lsh_attention_probs_dropout_prob=0.0,
        axial_pos_embds=False,
        max_position_embeddings=16,
        is_decoder=True,
        local_attn_chunk_length=4,
        lsh_attn_chunk_length=4,
        num_buckets=2,
        num_hashes=1,
        local_num_chunks_before=1,
        local_num_chunks_after=0,
        lsh_num_chunks_before=1,
        lsh_num_chunks_after=0,
    )
    return transformers.ReformerModelWithLMHead(cfg).to(dtype)


def chameleon(dtype=torch.float32) -> nn.Module:
    """An image tokenizer (a VQ-VAE with repeated residual blocks) that a text-only forward never runs."""
    vq = dict(
        embed_dim=8,
        num_embeddings=16,
        base_channels=32,
        channel_multiplier=[1, 1],
        num_res_blocks=2,
        resolution=16,
        latent_channels=8,
        attn_resolutions=[],
    )
    cfg = transformers.ChameleonConfig(
        **_text(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
        num_key_value_heads=2,
        vq_config=vq,
        vocabulary_map={"<image>": VOCAB - 1, "IMGIMG0A": VOCAB - 2},
        image_token_id=VOCAB - 1,
    )
    return transformers.ChameleonForConditionalGeneration(cfg).to(dtype)


def llama_one_layer(dtype=torch.float32) -> nn.Module:
    """A stack of one layer."""
    cfg = transformers.LlamaConfig(
        **_text(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4),
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def resnet_small(dtype=torch.float32) -> nn.Module:
    """transformers' own ResNet test configuration: small stages, little to save."""
    cfg = transformers.ResNetConfig(
        embedding_size=10, hidden_sizes=[10, 20, 30, 40], depths=[1, 1, 2, 1], num_labels=CLASSES
    )
    return transformers.ResNetForImageClassification(cfg).to(dtype)


def bit(dtype=torch.float32) -> nn.Module:
    """transformers' own BiT test configuration (weight-standardized convolutions, group norm)."""
    cfg = transformers.BitConfig(
        embedding_size=10, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 2, 1], num_groups=1, num_labels=CLASSES
    )
    return transformers.BitForImageClassification(cfg).to(dtype)


class _Block(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x):  # (B, T, h) -> (B, T, h)
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class ThreeBlockClassifier(nn.Module):
    """Three blocks and a three-class head: as many classes as blocks, and no router anywhere."""

    def __init__(self, dtype=torch.float32, h: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, h)
        self.blocks = nn.ModuleList(_Block(h) for _ in range(3))
        self.head = nn.Linear(h, 3)
        self.to(dtype)

    def forward(self, input_ids, attention_mask=None, labels=None):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x.mean(1))  # (B, 3)
        loss = nn.functional.cross_entropy(logits, labels[:, 0].clamp(min=0) % 3)
        return transformers.modeling_outputs.SequenceClassifierOutput(loss=loss, logits=logits)


ROBUST: dict[str, ZooEntry] = {
    "jamba": ZooEntry(jamba, causal_lm_batch, "causal_lm"),
    "recurrent_gemma": ZooEntry(recurrent_gemma, causal_lm_batch, "causal_lm"),
    "xlstm": ZooEntry(xlstm, causal_lm_batch, "causal_lm"),
    "voxtral_realtime": ZooEntry(voxtral_realtime, audio_text_batch, "causal_lm"),
    "squeezebert": ZooEntry(squeezebert, masked_lm_batch, "masked_lm"),
    "ibert": ZooEntry(ibert, masked_lm_batch, "masked_lm"),
    "reformer": ZooEntry(reformer, causal_lm_batch, "causal_lm"),
    "chameleon": ZooEntry(chameleon, causal_lm_batch, "causal_lm"),
    "llama_one_layer": ZooEntry(llama_one_layer, causal_lm_batch, "causal_lm"),
    "resnet_small": ZooEntry(resnet_small, image_batch, "image", has_batchnorm=True),
    "bit": ZooEntry(bit, image_batch, "image"),
    "three_block_classifier": ZooEntry(ThreeBlockClassifier, masked_lm_batch, "torch"),
}

"""The ``trainer:`` block of a LightningCLI config that runs a configuration."""

from __future__ import annotations

from lightning_memopt.memory import format_bytes

__all__ = ["trainer_yaml"]


def trainer_yaml(evaluated, devices: int, capacity: int, headroom: float, batch_size: int) -> str:
    """YAML to paste under the config's top level (merge ``callbacks`` with your own)."""
    c = evaluated.config
    lines = ["trainer:", f"  precision: {c.precision}", f"  devices: {devices}"]
    if c.strategy == "fsdp":
        lines += [
            "  # FSDP2: in configure_model, fully_shard each block, then each top-level child holding other parameters",
            "  strategy:",
            "    class_path: lightning.pytorch.strategies.ModelParallelStrategy",
            "    init_args:",
            f"      data_parallel_size: {devices}",
            "      tensor_parallel_size: 1",
        ]
    elif devices > 1:
        lines.append("  strategy: ddp")
    callbacks = []
    if c.micro_batch_size < batch_size:  # the effective batch stays the DataLoader's
        callbacks += [
            "    - class_path: lightning_memopt.AutoAccumulation",
            "      init_args:",
            f"        micro_batch_size: {c.micro_batch_size}",
        ]
    if c.checkpoint != "none" or c.head == "chunked":
        # AutoCheckpoint computes a causal LM's loss chunk by chunk unless told head='keep'; with the
        # step fitting as planned, it checkpoints nothing more than the plan needs.
        callbacks += [
            "    - class_path: lightning_memopt.AutoCheckpoint",
            "      init_args:",
            f"        max_memory: {capacity}  # {format_bytes(capacity)}",
            f"        headroom: {headroom}",
            f"        allow_offload: {'true' if c.checkpoint == 'offload' else 'false'}",
            f"        head: {'chunked' if c.head == 'chunked' else 'keep'}",
        ]
    if callbacks:
        lines += ["  callbacks:  # add to your own callbacks", *callbacks]
    return "\n".join(lines)

"""A rank of the FSDP2 chunked-head check: a tiny float64 Llama sharded over 2 gloo ranks (each layer, then
the root; the head too where asked), one forward and backward with its own head and with take_over_heads
(head="auto"): the loss, the notes and every gradient (gathered) per rank, as JSON."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def _model(mesh, shard_head: bool):
    import transformers
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    config = transformers.LlamaConfig(
        vocab_size=50, num_key_value_heads=1, max_position_embeddings=32, **sizes
    )
    model = transformers.LlamaForCausalLM(config).double()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if shard_head:
        fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main(out_dir: str, shard_head: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_memopt.head.causal_lm import take_over_heads

    dist.init_process_group("gloo")
    try:
        rank, mesh, results = dist.get_rank(), init_device_mesh("cpu", (2,)), {}
        ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(rank))
        for head in ("keep", "auto"):
            model, notes = _model(mesh, shard_head == "1"), []
            undo = take_over_heads(model, head, note=notes.append)
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            undo()
            grads = {n: p.grad.full_tensor().tolist() for n, p in model.named_parameters()}
            results[head] = dict(loss=float(out.loss), notes=notes, grads=grads, logits="logits" in out)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])

"""MemoryMonitor's output-head line on a tiny Hugging Face GPT-2, own head and chunked, bytes by hand."""

import csv

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_memopt import MemoryMonitor
from lightning_memopt.head.causal_lm import take_over_heads
from lightning_memopt.head.loss import default_chunk_size
from lightning_memopt.memory import tracker
from lightning_memopt.memory.phases import record_metrics
from lightning_memopt.memory.report import PHASES
from tests.batching.helpers import quiet_trainer

transformers = pytest.importorskip("transformers")

F32, I64 = 4, 8
B, T, V, H = 4, 32, 99, 32  # batch, sequence, vocabulary, features: B * T != H, so no two sizes agree
LOGITS = B * T * V * F32


class GPT2(pl.LightningModule):
    """GPT-2, 2 layers, float32, tied head; SGD. ``chunked``: its loss through the chunked head."""

    def __init__(self, chunked: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=V, n_embd=H, n_layer=2, n_head=2, n_positions=T)
        self.model = transformers.GPT2LMHeadModel(config)
        if chunked:
            take_over_heads(self.model, "chunked", note=print)

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, module, **options):
    monitor = MemoryMonitor(log_every_n_steps=1, **options)
    trainer = quiet_trainer([monitor], max_steps=2, logger=CSVLogger(tmp_path), default_root_dir=tmp_path)
    torch.manual_seed(0)
    trainer.fit(module, torch.utils.data.DataLoader(list(torch.randint(0, V, (2 * B, T))), batch_size=B))
    return monitor


def test_own_head_line_is_the_logits_sized_tensors(tmp_path):
    monitor = _fit(tmp_path, GPT2())
    record = monitor.history[-1]
    # Forward's peak is at nll_loss inside ForCausalLMLoss: the logits and their log-softmax, the labels
    # padded by one position (B x (T + 1) int64) and shifted (B x T), the loss and nll's total weight.
    assert record["forward_head"] == 2 * LOGITS + B * (T + 1) * I64 + B * T * I64 + 2 * F32
    # Backward's peak is at log_softmax's backward: the saved log-softmax, the gradient w.r.t. it and the
    # gradient w.r.t. the logits, with three scalars: the loss, Lightning's loss / accumulate_grad_batches
    # (a new tensor, made while the head is open) and its gradient.
    assert record["backward_head"] == 3 * LOGITS + 3 * F32
    # The head is a part of the categories; the logged key is the head at the step's peak.
    for phase in PHASES:
        assert record[f"{phase}_head"] <= record[f"{phase}_activations"] + record[f"{phase}_other"]
    top = max(PHASES, key=lambda p: record[p])
    assert record_metrics(record)["memory/peak_head_gib"] == record[f"{top}_head"] / 2**30
    assert "of which the output head" in monitor.report_paths[0].read_text()


def test_chunked_head_line_is_its_chunk_and_held_gradients(tmp_path):
    monitor = _fit(tmp_path, GPT2(chunked=True))
    record = monitor.history[-1]
    n = B * (T - 1)  # tokens with a next token to predict
    chunk = default_chunk_size(n)  # 8
    # Held through the chunks: the hidden states and labels of the shifted positions (copies: the slice
    # is not contiguous), the gradients w.r.t. the hidden states and the weight, the per-token losses and
    # a one-element scale. GPT-2's lm_head has no bias.
    held = n * H * F32 + n * I64 + n * H * F32 + V * H * F32 + n * F32 + F32 + I64  # ... and the token count
    # The peak in the chunk's softmax: the chunk's logits and 42 bytes of per-token vectors per token
    # (tests/memory/test_tracker.py names them).
    assert record["forward_head"] == held + chunk * (4 * V + 42)
    assert chunk * V * F32 < LOGITS // 15  # the chunk is a sixteenth of the logits, rounded up
    # Backward's peak is in the blocks: the head's part of the tied weight's gradient, which autograd
    # holds until the embedding's part is added, and the three scalars of the loss (as with the own head).
    assert record["backward_head"] == V * H * F32 + 3 * F32


def test_no_head_line_without_a_head_and_a_bad_name_fails(tmp_path):
    monitor = _fit(tmp_path / "none", GPT2(), head=None)
    assert "forward_head" not in monitor.history[-1] and "head_us" not in monitor.history[-1]
    with pytest.raises(MisconfigurationException, match=r"head='decoder' names no submodule of GPT2"):
        _fit(tmp_path / "bad", GPT2(), head="decoder")
    with pytest.raises(
        TypeError, match=r"head must be 'auto', a submodule's name \(e.g. 'lm_head'\) or None"
    ):
        MemoryMonitor(head=1)
    named = _fit(tmp_path / "named", GPT2(), head="model.lm_head")
    assert named.history[-1]["backward_head"] == 3 * LOGITS + 3 * F32


@pytest.mark.parametrize("chunked", [False, True], ids=["own", "chunked"])
def test_the_head_is_timed_in_each_step_and_logged(tmp_path, chunked):
    module = GPT2(chunked=chunked)
    monitor = _fit(tmp_path, module)
    assert not module.model.lm_head._forward_pre_hooks and not tracker.TIMING  # nothing left attached
    for record in monitor.history:
        assert 0 < record["head_us"] < record["step_us"]
    rows = [r for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r["memory/head_seconds"]]
    assert len(rows) == 2
    for row, record in zip(rows, monitor.history):
        assert float(row["memory/head_seconds"]) == pytest.approx(record["head_us"] / 1e6)
        assert float(row["memory/step_seconds"]) == pytest.approx(record["step_us"] / 1e6)
    last = monitor.history[-1]
    share = f"{last['head_us'] / last['step_us']:.1%}"
    assert f"({share}; median of 1 step, the first left out)" in monitor.report_paths[0].read_text()

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_memopt.memory import CATEGORIES, MemoryTracker
from lightning_memopt.memory import tracker as tracker_module

F32 = 4


def _mlp(widths):
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def test_linear_stack_bytes_exact():
    """Every category of a 3-layer MLP with AdamW, computed by hand."""
    widths, batch = [32, 64, 64, 8], 16
    model = _mlp(widths)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(batch, 32)
    n_params = sum(a * b + b for a, b in zip(widths, widths[1:]))
    param_bytes = n_params * F32
    # AdamW: exp_avg and exp_avg_sq per parameter, plus a float32 scalar "step" per parameter tensor.
    opt_bytes = 2 * param_bytes + 6 * F32
    # Saved for backward: the input of every Linear (x, relu1 out, relu2 out); ReLU saves its output,
    # which is the next Linear's input: the same storage, counted once.
    act_bytes = batch * (32 + 64 + 64) * F32
    out_bytes, loss_bytes = batch * 8 * F32, F32

    model(x).sum().backward()  # first step creates the optimizer state outside the tracker
    opt.step()
    opt.zero_grad()

    with MemoryTracker(model, opt) as tracker:
        assert tracker.current_breakdown == {
            "parameters": param_bytes,
            "gradients": 0,
            "optimizer_state": opt_bytes,
            "activations": 0,
            "other": 0,
        }
        out = model(x)
        fwd = tracker.current_breakdown
        assert fwd["activations"] == act_bytes
        assert fwd["other"] == out_bytes
        loss = out.sum()
        # The forward peak is inside the second ReLU: all activations are saved and the Linear output it
        # reads (not saved: ReLU keeps its own output) is still alive, bigger than out + loss later.
        pre_relu = batch * 64 * F32
        assert tracker.peak == param_bytes + opt_bytes + act_bytes + pre_relu
        assert pre_relu > out_bytes + loss_bytes
        assert tracker.peak_breakdown["activations"] == act_bytes
        del out
        tracker.reset_peak()
        loss.backward()
        after = tracker.current_breakdown
        assert after["gradients"] == param_bytes
        assert after["activations"] == 0  # autograd released what it saved
        assert after["other"] == batch * 32 * F32 + loss_bytes  # x is alive (ours), and the loss
        # Backward peak: gradients of the last layers exist while earlier activations are still saved.
        assert tracker.peak > param_bytes + opt_bytes + act_bytes
        assert sum(tracker.peak_breakdown.values()) == tracker.peak
        opt.step()
        opt.zero_grad()
        assert tracker.current_breakdown["gradients"] == 0
        assert tracker.current_breakdown["optimizer_state"] == opt_bytes


def test_views_and_shared_storage_counted_once():
    base = torch.zeros(1000)
    with MemoryTracker() as tracker:
        y = base * 2  # 4000 bytes new
        views = [y[:10], y.view(10, 100), y.t() if y.dim() == 2 else y[::2]]
        z = torch.ones(250)  # 1000 bytes new
        assert views[0].untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
        assert tracker.current == 4000 + 4000 + 1000  # base is an input: counted once, from first use
        del y, views
        assert tracker.current == 4000 + 1000
        del z
        assert tracker.current == 4000
    assert tracker.peak == 9000


def test_peak_breakdown_sums_to_peak_and_categories_are_known():
    model = _mlp([8, 16, 4])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with MemoryTracker(model, opt) as tracker:
        for _ in range(3):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert set(tracker.peak_breakdown) == set(CATEGORIES)
    assert sum(tracker.peak_breakdown.values()) == tracker.peak
    # SGD momentum buffers, one per parameter, as big as the parameters.
    assert tracker.current_breakdown["optimizer_state"] == tracker.current_breakdown["parameters"]


def test_gradient_recognized_at_peak():
    """The grad is booked as a gradient in the peak it is part of, though the hook runs after the op."""
    w = torch.nn.Parameter(torch.randn(100))
    module = torch.nn.Module()
    module.w = w
    with MemoryTracker(module) as tracker:
        (w * 2).sum().backward()
    assert tracker.peak_breakdown["gradients"] == 400
    assert tracker.current_breakdown == {
        "parameters": 400,
        "gradients": 400,
        "optimizer_state": 0,
        "activations": 0,
        "other": 0,
    }


def test_mark_and_category_of():
    t = torch.zeros(10)
    with MemoryTracker() as tracker:
        tracker.mark(t, "activations")
        assert tracker.category_of(t) == "activations"
        assert tracker.category_of(torch.empty(0).new_zeros(3)) == "other"
    assert tracker.category_of(torch.zeros(2)) is None
    with pytest.raises(ValueError, match="category must be one of"):
        tracker.mark(t, "weights")


def test_bad_optimizer_type():
    with pytest.raises(TypeError, match="optimizers must be torch.optim.Optimizer"):
        MemoryTracker(optimizers=[object()])


def _train_step(model, opt, x):
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_fake_tensor_mode_matches_real_run():
    def run():
        torch.manual_seed(0)
        model = _mlp([32, 128, 128, 16])
        opt = torch.optim.AdamW(model.parameters())
        x = torch.randn(64, 32)
        _train_step(model, opt, x)
        with MemoryTracker(model, opt) as tracker:
            _train_step(model, opt, x)
        return tracker.peak, tracker.peak_breakdown

    real = run()
    with FakeTensorMode():
        fake = run()
    assert fake == real
    assert real[0] > 0


def test_cuda_fake_tensors_round_to_allocator_blocks():
    with FakeTensorMode():
        with MemoryTracker() as tracker:
            a = torch.empty(3, device="cuda")  # 12 bytes -> one 512-byte block
            b = torch.empty(200, device="cuda")  # 800 bytes -> two blocks
            assert tracker.current == 512 + 1024
            del a, b


def test_agrees_with_torch_mem_tracker_on_transformer_block():
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    block = torch.nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
    opt = torch.optim.AdamW(block.parameters())
    x = torch.randn(8, 32, 64)
    _train_step(block, opt, x)
    reference = MemTracker()
    reference.track_external(block, opt)
    with reference:
        _train_step(block, opt, x)
    ref_peak = reference.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    with MemoryTracker(block, opt) as tracker:
        _train_step(block, opt, x)
    assert abs(tracker.peak - ref_peak) <= 0.01 * ref_peak
    assert tracker.peak_breakdown["parameters"] == sum(p.numel() * 4 for p in block.parameters())


def test_reenter_continues_counts():
    model = torch.nn.Linear(4, 4)
    tracker = MemoryTracker(model)
    with tracker:
        y = model(torch.ones(1, 4))
    with tracker:
        assert tracker.current == 80 + 16 + 16  # parameters, y, and the input y's graph saved
        del y  # the graph dies with y, and the input with it
        assert tracker.current == 80


def test_nested_trackers_both_see_saved_tensors_and_exit_in_any_order():
    """Autograd calls only the innermost saved-tensor hooks; every entered tracker must still count."""
    model = _mlp([8, 16, 4])
    x = torch.randn(5, 8)
    alone = MemoryTracker(model)
    with alone:
        loss = model(x).sum()
    expected = alone.current_breakdown["activations"]
    assert expected == 5 * (8 + 16) * F32
    del loss

    outer, inner = MemoryTracker(model), MemoryTracker(model)
    outer.__enter__()
    inner.__enter__()
    loss = model(x).sum()
    assert outer.current_breakdown["activations"] == inner.current_breakdown["activations"] == expected
    outer.__exit__(None, None, None)  # not last-in-first-out: the inner tracker keeps counting
    y = torch.ones(100)
    assert inner.category_of(y) == "other" and outer.category_of(y) is None
    loss.backward()
    assert inner.current_breakdown["activations"] == 0
    assert outer.current_breakdown["activations"] == 0  # released, though outer was exited
    inner.__exit__(None, None, None)
    assert torch.UntypedStorage.resize_ is tracker_module._ORIGINAL_RESIZE
    assert not tracker_module._ACTIVE


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        # A string is iterable: it used to fail only when the tracker was entered.
        ({"modules": "model"}, r"modules must be torch.nn.Module instances, got 'm' \(str\)"),
        (
            {"modules": [torch.nn.Linear(2, 2), 3]},
            r"modules must be torch.nn.Module instances, got 3 \(int\)",
        ),
        ({"optimizers": "sgd"}, r"optimizers must be torch.optim.Optimizer instances, got str"),
        ({"heads": "lm_head"}, r"heads must be torch.nn.Module instances, got 'l' \(str\)"),
    ],
)
def test_wrong_types_raise_at_construction(kwargs, match):
    with pytest.raises(TypeError, match=match):
        MemoryTracker(**kwargs)


def test_track_modules_and_optimizers_check_types():
    tracker = MemoryTracker()
    with pytest.raises(TypeError, match=r"modules must be torch.nn.Module instances, got 'x' \(str\)"):
        tracker.track_modules("x")
    with pytest.raises(TypeError, match=r"optimizers must be torch.optim.Optimizer instances, got int"):
        tracker.track_optimizers(1)
    assert tracker._modules == [] and tracker._optimizers == []


# ---------------------------------------------------------------------------------------------- the head
N, H, V = 6, 8, 50  # tokens, features, vocabulary
LOGITS = N * V * F32


def _body_and_head():
    torch.manual_seed(0)
    return torch.nn.Linear(H, H), torch.nn.Linear(H, V), torch.randn(N, H), torch.randint(0, V, (N,))


def test_own_head_counts_the_logits_sized_tensors_exactly():
    body, head, x, y = _body_and_head()
    with MemoryTracker([body, head], heads=head) as tracker:
        loss = torch.nn.functional.cross_entropy(head(body(x)), y)
        # At the forward's peak (nll_loss): the logits, their log-softmax, the loss and nll's total weight
        # (one float each). Not the labels: an input first seen there, not made by the head.
        assert tracker.peak_head == 2 * LOGITS + 2 * F32
        # After it: the log-softmax autograd saved for backward, the loss and the total weight.
        assert tracker.current_head == LOGITS + 2 * F32
        assert tracker.peak_breakdown["activations"] >= LOGITS  # the head is a part of the categories
        tracker.reset_peak()
        loss.backward()
        # Backward's peak (log_softmax_backward): the saved log-softmax, the gradient w.r.t. it, the
        # gradient w.r.t. the logits, the loss and its gradient.
        assert tracker.peak_head == 3 * LOGITS + 2 * F32
        # The weight's and bias's gradients are gradients, and the gradient w.r.t. the head's input
        # belongs to the body; the loss's gradient went with backward(): only the loss is left.
        assert tracker.current_head == F32
        del loss
        assert tracker.current_head == 0
    with MemoryTracker([body, head]) as tracker:  # not told the head: no head line
        torch.nn.functional.cross_entropy(head(body(x)), y).backward()
    assert tracker.peak_head == 0


def test_chunked_head_counts_its_chunk_and_the_gradients_it_holds():
    from lightning_memopt.head import linear_cross_entropy

    body, head, x, y = _body_and_head()
    chunk = 2
    with MemoryTracker([body, head]) as tracker:  # linear_cross_entropy opens the head itself
        loss = linear_cross_entropy(body(x), head.weight, y, bias=head.bias, chunk_size=chunk)
        # losses, the one-element scale, the count of tokens (int64), d hidden, d weight, d bias
        held = N * F32 + F32 + 8 + N * H * F32 + V * H * F32 + V * F32
        # The peak is at the bias's gradient, db += dz.sum(0): the chunk's logits turned gradient (c, V),
        # their column sum (V,) and the chunk's losses (c,). (Without a bias it is in the chunk's softmax:
        # the logits and 42 bytes of per-token vectors per token.)
        assert tracker.peak_head == held + chunk * V * F32 + V * F32 + chunk * F32
        assert tracker.current_head == (N * H + V * H + V) * F32 + F32  # the held gradients and the loss
        tracker.reset_peak()
        loss.backward()
        del loss
        assert tracker.current_head == 0  # d weight and d bias are gradients; d hidden went to the body
    # At backward's peak: the loss and its gradient. The held gradients were alive too, but d weight and
    # d bias turned out to be gradients and d hidden the body's: not the head's, at that peak either.
    assert tracker.peak_head == 2 * F32


def test_head_closes_at_exit_and_without_gradient():
    body, head, x, y = _body_and_head()
    tracker = MemoryTracker([body, head], heads=head)
    with torch.no_grad(), tracker:
        head(body(x)).sum()
        assert tracker.current_head == 0  # the logits and the sum are gone
        # The peak: when the logits were made, the body's output still alive (freed before the sum).
        assert tracker.peak_head == LOGITS
    with tracker:
        body(x)
        assert tracker.current_head == 0  # closed at the last exit: the body's output is not the head's


def test_track_heads_after_construction():
    body, head, x, y = _body_and_head()
    tracker = MemoryTracker([body, head])
    with tracker:
        tracker.track_heads(head)
        head(x)
        assert tracker.current_head == 0  # the logits were dropped
        assert tracker.peak_head == LOGITS
    with pytest.raises(TypeError, match=r"heads must be torch.nn.Module instances, got 1 \(int\)"):
        tracker.track_heads(1)


def test_a_leaf_heads_input_keeps_no_hook_after_exit():
    from lightning_memopt.head import linear_cross_entropy

    _, head, x, y = _body_and_head()
    features = x.clone().requires_grad_(True)  # a leaf: its hooks live as long as it does
    with MemoryTracker(head) as tracker:
        linear_cross_entropy(features, head.weight, y).backward()
        assert features._backward_hooks  # the head's closing hook, while entered
    assert not features._backward_hooks
    assert tracker.current_head == 0


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p),
        lambda p: torch.optim.Adam(p, amsgrad=True),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda p: torch.optim.Adagrad(p),
        lambda p: torch.optim.RMSprop(p, centered=True, momentum=0.5),
        lambda p: torch.optim.NAdam(p),
    ],
)
def test_optimizer_state_to_come_is_what_the_first_step_creates(make):
    # Parameters of repeated kinds (shapes, dtypes) in two groups: the fake step runs one parameter of each
    # kind and counts its state once per parameter of that kind; a real first step creates exactly that
    # (Adagrad creates its state when constructed: none to come, none created by the step).
    from lightning_memopt.memory.tracker import optimizer_state_to_come, tensor_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)], torch.nn.Linear(8, 3))
    model[3].double()
    optimizer = make([{"params": model[:2].parameters()}, {"params": model[2:].parameters(), "lr": 0.01}])

    def held() -> int:
        return tensor_bytes(t for state in optimizer.state.values() for t in state.values())

    predicted, before = optimizer_state_to_come([optimizer]), held()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert predicted == held() - before
    assert optimizer_state_to_come([optimizer]) == 0  # it holds its state now


def test_bytes_of_counts_the_whole_storage_behind_a_view_and_nothing_unseen():
    model = torch.nn.Linear(4, 4)
    with MemoryTracker(model) as tracker:
        batch = torch.randn(6, 4)
        model(batch[:2]).sum().backward()  # the slice is saved: its storage counted whole
        assert tracker.bytes_of(batch[:2]) == tracker.bytes_of(batch) == 6 * 4 * 4
        assert tracker.bytes_of(model.weight) == 16 * 4
        assert tracker.bytes_of(torch.zeros(3)) == 12  # made under the tracker: seen
    assert tracker.bytes_of(torch.zeros(3)) == 0  # made after it: never seen

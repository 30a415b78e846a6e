import copy
import gc
import itertools
import random
import weakref

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_memopt.checkpointing import (
    CHOICES,
    ActivationMeter,
    BlockProfile,
    CostModel,
    NoPlanFitsError,
    OptionCost,
    apply_checkpointing,
    capture_block_inputs,
    checkpointed_blocks,
    evaluate_plan,
    find_blocks,
    plan_checkpointing,
    profile_blocks,
    remove_checkpointing,
)
from lightning_memopt.checkpointing.flops import OpCounter
from tests.checkpointing.helpers import LiveTensors
from tests.checkpointing.models import Block, TinyGPT
from tests.oracles import brute_force_plan


def _grads(model, idx, seed=0):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    model(idx).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------ find_blocks
def test_find_blocks_gpt_and_encoder_and_resnet_like():
    assert [n for n, _ in find_blocks(TinyGPT(3))] == ["h.0", "h.1", "h.2"]
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    enc = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    assert [n for n, _ in find_blocks(enc)] == ["layers.0", "layers.1", "layers.2"]

    class Bottleneck(nn.Sequential):
        pass

    stage1 = nn.Sequential(*[Bottleneck(nn.Conv2d(4, 4, 1)) for _ in range(2)])
    stage2 = nn.Sequential(*[Bottleneck(nn.Conv2d(8, 8, 3)) for _ in range(2)])
    resnet = nn.Sequential(stage1, nn.Conv2d(4, 8, 1), stage2)
    # Every stack, not the longest one: both stages' blocks, in forward order.
    assert [n for n, _ in find_blocks(resnet)] == ["0.0", "0.1", "2.0", "2.1"]


class _Residual(nn.Module):
    """A residual block: two conv units (conv + norm + activation) in a Sequential."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.layer = nn.Sequential(
            *[nn.Sequential(nn.Conv2d(c, c, 3), nn.BatchNorm2d(c), nn.ReLU()) for _ in range(2)]
        )


class _Stage(nn.Module):
    def __init__(self, c: int, n: int, downsample: bool) -> None:
        super().__init__()
        self.down = nn.Conv2d(c, c, 1) if downsample else nn.Identity()
        self.layers = nn.Sequential(*[_Residual(c) for _ in range(n)])


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.router = nn.Linear(8, 3)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 8)) for _ in range(3))


def test_find_blocks_takes_every_stack_and_the_finer_blocks_of_stages():
    # Stages made of residual blocks are containers: their blocks are taken, a one-block stage's too; the
    # conv units inside a residual block (one weight layer each) are not blocks.
    model = nn.Sequential(_Stage(4, 2, False), _Stage(4, 1, True), _Stage(4, 2, True))
    assert [n for n, _ in find_blocks(model)] == [
        "0.layers.0",
        "0.layers.1",
        "1.layers.0",
        "2.layers.0",
        "2.layers.1",
    ]
    # Two towers: both.
    towers = nn.ModuleDict(
        {"enc": nn.ModuleList(Block() for _ in range(2)), "dec": nn.ModuleList(Block() for _ in range(3))}
    )
    assert [n for n, _ in find_blocks(towers)] == ["enc.0", "enc.1", "dec.0", "dec.1", "dec.2"]
    # Experts picked by a router are parts of a block, not a stack.
    assert [n for n, _ in find_blocks(nn.ModuleList(_MoE() for _ in range(2)))] == ["0", "1"]
    # A run of parameterless modules is no stack.
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.ReLU())) == []


def _net(stem: nn.Module, *between: nn.Module) -> nn.Module:
    """A CNN: ``stem``, then ``between`` modules, then two stages of residual blocks under ``body``."""
    model = nn.Module()
    model.stem = stem
    for i, module in enumerate(between):
        model.add_module(f"between{i}", module)
    model.body = nn.Module()
    model.body.stages = nn.Sequential(_Stage(4, 2, False), _Stage(4, 1, True))
    return model


def test_find_blocks_takes_the_stem_before_the_first_stack():
    blocks = ["body.stages.0.layers.0", "body.stages.0.layers.1", "body.stages.1.layers.0"]
    conv_bn_relu = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2))
    # A sibling of the stacks' ancestor, registered before it, with a weight layer and submodules: a unit.
    assert [n for n, _ in find_blocks(_net(conv_bn_relu))] == ["stem", *blocks]
    # Parameterless modules in between do not hide it; the nearest module with parameters decides.
    assert [n for n, _ in find_blocks(_net(conv_bn_relu, nn.ReLU(), nn.Identity()))] == ["stem", *blocks]
    # Not a stem: a bare layer (checkpointing it keeps the input it saves anyway), a unit without a weight
    # layer, a composite stem hidden behind a nearer module with parameters, a ModuleList (no forward).
    assert [n for n, _ in find_blocks(_net(nn.Conv2d(3, 4, 3)))] == blocks
    assert [n for n, _ in find_blocks(_net(nn.Sequential(nn.BatchNorm2d(4), nn.ReLU())))] == blocks
    assert [n for n, _ in find_blocks(_net(conv_bn_relu, nn.BatchNorm2d(4)))] == blocks
    assert [n for n, _ in find_blocks(_net(nn.ModuleList([nn.Conv2d(3, 4, 3), nn.ReLU()])))] == blocks
    # Inside the first stack's container, the module before the first block is looked at first.
    seq = nn.Sequential(nn.Sequential(nn.Linear(2, 8), nn.ReLU()), *[Block(8) for _ in range(2)])
    assert [n for n, _ in find_blocks(seq)] == ["0", "1", "2"]
    # Blocks given by the user: exactly those, no stem.
    assert [n for n, _ in find_blocks(_net(conv_bn_relu), [_Residual])] == blocks


def stem_under_fully_shard_worker() -> None:
    """One gloo rank: blocks and the root fully_shard-ed (torchtitan's recipe); the root owns the stem."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    try:
        model = _net(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()))
        mesh = init_device_mesh("cpu", (1,))
        for _, block in find_blocks(model)[1:]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        blocks = ["body.stages.0.layers.0", "body.stages.0.layers.1", "body.stages.1.layers.0"]
        assert [n for n, _ in find_blocks(model)] == blocks
    finally:
        dist.destroy_process_group()


def test_find_blocks_leaves_out_a_stem_an_enclosing_fully_shard_owns():
    from tests.distributed import run_ranks

    run_ranks("tests.checkpointing.test_checkpointing:stem_under_fully_shard_worker", world_size=1)


def test_find_blocks_patterns_match_relative_to_any_submodule():
    holder = nn.Module()
    holder.model = TinyGPT(2)
    assert [n for n, _ in find_blocks(holder, "h.?")] == ["model.h.0", "model.h.1"]
    assert [n for n, _ in find_blocks(holder, "model.h.1")] == ["model.h.1"]
    with pytest.raises(
        ValueError,
        match=r"candidate block classes found: \['Block'\]; discovered blocks: \[model.h.0, model.h.1\]",
    ):
        find_blocks(holder, "layer?")


def test_find_blocks_overrides():
    model = TinyGPT(2)
    assert [n for n, _ in find_blocks(model, [Block])] == ["h.0", "h.1"]
    assert [n for n, _ in find_blocks(model, "Block")] == ["h.0", "h.1"]
    assert [n for n, _ in find_blocks(model, ["h.*"])] == ["h.0", "h.1"]
    assert [n for n, _ in find_blocks(model, ["*.fc", "head"])] == ["h.0.fc", "h.1.fc", "head"]


def test_find_blocks_errors():
    with pytest.raises(
        ValueError, match=r"matched no module of TinyGPT; candidate block classes found: \['Block'\]"
    ):
        find_blocks(TinyGPT(2), ["nope.*"])
    with pytest.raises(
        ValueError, match="blocks must be module classes, class names or name patterns, got 3"
    ):
        find_blocks(TinyGPT(2), [3])
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


# ------------------------------------------------------------------ apply / remove
@pytest.mark.parametrize("choice", CHOICES)
def test_gradients_equal_and_state_dict_unchanged(choice):
    torch.manual_seed(0)
    model = TinyGPT(3)
    idx = torch.randint(0, 32, (2, 8))
    ref = _grads(model, idx)
    keys = list(model.state_dict())
    apply_checkpointing(model, {n: choice for n, _ in find_blocks(model)})
    assert list(model.state_dict()) == keys
    got = _grads(model, idx)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-6, atol=0)


@pytest.mark.parametrize("choice", ["selective", "full"])
def test_gradients_equal_with_dropout(choice):
    torch.manual_seed(0)
    model = TinyGPT(2, dropout=0.3)
    idx = torch.randint(0, 32, (2, 8))
    ref = _grads(model, idx, seed=5)
    apply_checkpointing(model, {"h.0": choice, "h.1": choice})
    got = _grads(model, idx, seed=5)
    for n in ref:
        assert torch.equal(got[n], ref[n]), n


class _MLPBlock(nn.Module):
    def __init__(self, data_dependent: bool = False) -> None:
        super().__init__()
        self.fc, self.proj, self.data_dependent = nn.Linear(8, 32), nn.Linear(32, 8), data_dependent

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc(x))
        if self.data_dependent:
            h = h * (h.nonzero().shape[0] > 0)  # an op fake tensors cannot size
        return self.proj(h)


def _selective_cached_bytes(block, x):
    cached = []
    from lightning_memopt.checkpointing.apply import observe_saved

    apply_checkpointing(block, {"": "selective"})
    with observe_saved(lambda kind, t: cached.append(t.nbytes)):
        out = block(x)
    with OpCounter() as backward:  # FlopCounterMode's module hooks break selective recomputation
        out.sum().backward()
    remove_checkpointing(block)
    return cached, backward.flops


def test_selective_skips_compute_after_the_last_saved_tensor():
    torch.manual_seed(0)
    block, x = _MLPBlock(), torch.randn(4, 8, requires_grad=True)
    with OpCounter() as plain:
        block(x).sum().backward()
    ref = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    rng = torch.get_rng_state()
    with OpCounter() as outer:  # the fake-tensor analysis is invisible to modes the caller entered
        cached, backward = _selective_cached_bytes(block, x)
    assert torch.equal(torch.get_rng_state(), rng)
    # Only fc's output (4 x 32 fp32) is cached; proj runs after gelu's input and proj's input are saved,
    # so recomputation stops before it: not cached and not recomputed (backward FLOPs as without AC).
    assert cached == [4 * 32 * 4]
    assert backward == 2 * 2 * 4 * 8 * 32 * 2  # fc and proj: grad input and grad weight, no recompute
    assert outer.flops == plain.flops
    for p, r in zip(block.parameters(), ref):
        torch.testing.assert_close(p.grad, r, rtol=1e-6, atol=0)


def test_selective_caches_nothing_when_the_analysis_cannot_run():
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    # Fake tensors cannot run nonzero: nothing is known about later in-place changes, so nothing is cached
    # and fc is recomputed (its forward FLOPs, 2 * 4 * 8 * 32, join the backward's).
    cached, backward = _selective_cached_bytes(_MLPBlock(data_dependent=True), x)
    assert cached == []
    assert backward == 2 * 2 * 4 * 8 * 32 * 2 + 2 * 4 * 8 * 32
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # recomputation would reach proj
        cached, _ = _selective_cached_bytes(_MLPBlock(), x)
    assert cached == [4 * 32 * 4, 4 * 8 * 4]


class _InPlaceBlock(nn.Module):
    """conv -> in-place ReLU6 -> conv, as torchvision's and HF's MobileNet/EfficientNet blocks do."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.act = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 3, 1), nn.ReLU6(inplace=True)

    def forward(self, x):
        return self.b(self.act(self.a(x))) + x


def test_selective_recomputes_outputs_changed_in_place():
    torch.manual_seed(0)
    block, x = _InPlaceBlock(), torch.randn(2, 3, 8, 8, requires_grad=True)
    block(x).sum().backward()
    ref = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    # conv a's output is clamped in place: caching it would raise "Tensor cached during selective activation
    # checkpoint has been mutated" in backward. It is recomputed; conv b runs after the last save: not cached.
    cached, _ = _selective_cached_bytes(block, x)
    assert cached == []
    for p, r in zip(block.parameters(), ref):
        torch.testing.assert_close(p.grad, r, rtol=1e-6, atol=0)


def test_apply_twice_does_not_double_wrap_and_remove_restores():
    model = TinyGPT(2)
    block = model.h[0]
    assert "forward" not in block.__dict__
    apply_checkpointing(model, {"h.0": "full"})
    wrapped = block.__dict__["forward"]
    apply_checkpointing(model, {"h.0": "selective", "h.1": "full"})
    assert block.__dict__["forward"] is wrapped
    assert checkpointed_blocks(model) == {"h.0": "selective", "h.1": "full"}
    remove_checkpointing(model)
    assert "forward" not in block.__dict__ and checkpointed_blocks(model) == {}
    # A block with its own instance forward gets exactly that back.
    own = block.forward
    block.forward = own
    apply_checkpointing(model, {"h.0": "full"})
    remove_checkpointing(model)
    assert block.__dict__["forward"] is own


class _RMSNormed(nn.Module):
    """A block whose hand-written RMSNorm ``pointwise`` runs again with grad (its normalized input is as
    large as its output), after a GELU whose output goes too."""

    def __init__(self, h: int = 16) -> None:
        super().__init__()
        self.fc, self.act, self.out = nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)
        self.weight = nn.Parameter(torch.ones(4 * h))

    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def forward(self, x):
        return x + self.out(self.norm(self.act(self.fc(x))))


@pytest.mark.parametrize("choice", CHOICES)
def test_steps_leave_no_tensor_behind_and_nothing_holds_the_parameters(choice):
    # A saved-tensor hook that keeps what leads back to the autograd nodes holding it makes a cycle
    # through C++ that no collector frees: every step's tensors would stay (pointwise's run-again way did,
    # 134 MB a step on HF GPT-2), and a dry run's graph would hold the parameters after the model is gone.
    model = nn.Sequential(_RMSNormed(), _RMSNormed())
    apply_checkpointing(model, {"0": choice, "1": choice})
    x = torch.randn(2, 8, 16, requires_grad=True)
    live_tensors, counts = LiveTensors(), []
    for _ in range(3):
        model(x).square().sum().backward()
        counts.append(live_tensors())
    for _ in range(2):  # forwards that never run backward (an attempt given up): their graphs go too
        model(x)
        counts.append(live_tensors())
    assert counts == [counts[0]] * 5
    remove_checkpointing(model)
    alive = [weakref.ref(p) for p in model.parameters()]
    del model
    gc.collect()
    assert [ref() for ref in alive] == [None] * len(alive)


def test_checkpoint_loads_into_bare_model_and_back(tmp_path):
    model = TinyGPT(2)
    apply_checkpointing(model, {"h.0": "full", "h.1": "selective"})
    torch.save(model.state_dict(), tmp_path / "ac.pt")
    bare = TinyGPT(2)
    bare.load_state_dict(torch.load(tmp_path / "ac.pt"))
    torch.save(bare.state_dict(), tmp_path / "bare.pt")
    again = TinyGPT(2)
    apply_checkpointing(again, {"h.0": "full"})
    again.load_state_dict(torch.load(tmp_path / "bare.pt"))
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


def test_nothing_recomputed_under_eval_or_no_grad():
    torch.manual_seed(0)
    model = TinyGPT(2)
    idx = torch.randint(0, 32, (2, 8))
    apply_checkpointing(model, {"h.0": "full", "h.1": "full"})
    with FlopCounterMode(display=False) as train:
        model(idx).sum().backward()
    model.eval()
    with FlopCounterMode(display=False) as evaluated:
        model(idx).sum().backward()
    model.train()
    remove_checkpointing(model)
    with FlopCounterMode(display=False) as bare:
        model(idx).sum().backward()
    assert evaluated.get_total_flops() == bare.get_total_flops() < train.get_total_flops()
    apply_checkpointing(model, {"h.0": "full", "h.1": "full"})
    with torch.no_grad(), ActivationMeter(model, find_blocks(model)) as meter:
        model(idx)
    assert meter.block_bytes == {}


def test_apply_errors():
    model = TinyGPT(1)
    with pytest.raises(ValueError, match=r"choice for block 'h.0' must be one of .*got 'fast'"):
        apply_checkpointing(model, {"h.0": "fast"})
    with pytest.raises(ValueError, match="block 'h.9' is not a module of TinyGPT"):
        apply_checkpointing(model, {"h.9": "full"})
    with pytest.raises(ValueError, match="plan must be a Plan or a mapping"):
        apply_checkpointing(model, ["full"])


# ------------------------------------------------------------------ profiling
def test_profile_bytes_exact_and_predictions_match_measurement():
    torch.manual_seed(0)
    B, T, h = 2, 8, 16
    model = TinyGPT(3, h=h)
    idx = torch.randint(0, 32, (B, T))
    blocks = find_blocks(model)
    profiles = profile_blocks(model, blocks, idx)
    x_bytes = B * T * h * 4
    p = profiles[1]
    assert (p.input_bytes, p.output_bytes, p.chained) == (x_bytes, x_bytes, True)
    assert not profiles[0].chained  # its input comes from the embedding
    full = p.options["full"]
    assert (full.internal_bytes, full.saves_input, full.saves_output) == (0, True, False)
    assert p.options["offload"].internal_bytes == 0 and not p.options["offload"].saves_input
    # Selective caches exactly the outputs of the first 5 matmul-class ops: attn (B,T,3h), q@k (B,2,T,T),
    # att@v (B,2,T,h/2), proj (B,T,h), fc (B,T,4h); plus the input it keeps. Not fc_proj (B,T,h): it runs
    # after the block's last saved tensor, so recomputation stops before it and its output is not needed.
    cached = B * T * (3 * h + h + 4 * h) * 4 + B * 2 * T * T * 4 + B * T * h * 4
    assert p.options["selective"].internal_bytes == cached
    # Full recompute re-runs every matmul but the last (early stop: fc_proj's output is not needed).
    assert full.recompute_flops == p.forward_flops - 2 * B * T * 4 * h * h
    assert p.options["selective"].recompute_flops == 0 < p.options["selective"].recompute_bytes
    mixes = [
        ("keep",) * 3,
        ("full", "keep", "offload"),
        ("keep", "selective", "full"),
        ("offload", "keep", "keep"),
        ("pointwise", "selective", "full"),
        ("keep", "pointwise", "offload"),
    ]
    for choices in mixes + [(c,) * 3 for c in ("selective", "full", "offload", "pointwise")]:
        predicted = evaluate_plan(profiles, choices)
        apply_checkpointing(model, predicted)
        with ActivationMeter(model, blocks) as meter:
            loss = model(idx).sum()
        loss.backward()
        assert meter.block_bytes == predicted.block_bytes, choices


def test_profile_bf16_autocast_halves_activations():
    torch.manual_seed(0)
    model = TinyGPT(2)
    idx = torch.randint(0, 32, (2, 8))
    blocks = find_blocks(model)
    fp32 = profile_blocks(model, blocks, idx, choices=["selective"])
    bf16 = profile_blocks(
        model, blocks, idx, choices=["selective"], context=lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    )
    # The cached matmul outputs are bf16 under autocast: half the bytes (the fp32 block input stays).
    f, b = fp32[1].options["selective"].internal_bytes, bf16[1].options["selective"].internal_bytes
    assert b == f // 2


def test_profile_leaves_model_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)) for _ in range(2)]
    )
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(8, 4)
    rng = torch.get_rng_state()
    profile_blocks(model, find_blocks(model), x)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert checkpointed_blocks(model) == {}
    assert torch.equal(rng, torch.get_rng_state())


# ------------------------------------------------------------------ planner
def _random_profiles(rng: random.Random, n: int) -> list[BlockProfile]:
    profiles = []
    for i in range(n):
        size = rng.choice([100, 200, 300])
        keep = OptionCost(rng.randint(500, 1000), True, rng.random() < 0.5)
        sel = OptionCost(rng.randint(100, 500), True, False, 0, rng.randint(10, 100))
        full = OptionCost(0, True, False, rng.randint(1000, 5000), rng.randint(10, 100))
        off = OptionCost(0, False, False, transfer_bytes=rng.randint(500, 1000))
        options = {"keep": keep, "selective": sel, "full": full, "offload": off}
        profiles.append(BlockProfile(f"b{i}", 1000, size, size, i > 0, options))
    return profiles


def test_dp_equals_brute_force_on_random_instances():
    rng = random.Random(0)
    cost_model = CostModel(pointwise_flops_per_byte=20, offload_flops_per_byte=3)
    for trial in range(40):
        profiles = _random_profiles(rng, rng.randint(1, 6))
        allowed = ["keep", "selective", "full", "offload"] if trial % 2 else ["keep", "selective", "full"]
        top = evaluate_plan(profiles, ["keep"] * len(profiles)).activation_bytes
        max_bytes = rng.randint(top // 5, top)
        brute = brute_force_plan(profiles, max_bytes, allowed=allowed, cost_model=cost_model)
        if brute is None:
            with pytest.raises(NoPlanFitsError):
                plan_checkpointing(profiles, max_bytes, allowed=allowed, cost_model=cost_model)
            continue
        plan = plan_checkpointing(profiles, max_bytes, allowed=allowed, cost_model=cost_model)
        assert plan.cost == brute.cost, trial
        assert plan.activation_bytes <= plan.peak_bytes <= max_bytes


def test_budget_bounds_the_backward_peak_of_recomputation():
    # While a checkpointed block runs its backward it holds all it would have kept, and the blocks before
    # it still hold theirs: recompute early blocks, whose backward comes last, when the rest is freed.
    keep, full = OptionCost(100, False, False), OptionCost(0, False, False, recompute_flops=50)
    profiles = [BlockProfile(n, 0, 0, 0, False, {"keep": keep, "full": full}) for n in "ab"]
    late, early = evaluate_plan(profiles, ["keep", "full"]), evaluate_plan(profiles, ["full", "keep"])
    assert (late.activation_bytes, late.peak_bytes) == (100, 200)
    assert (early.activation_bytes, early.peak_bytes) == (100, 100)
    assert plan_checkpointing(profiles, 100, allowed=["keep", "full"]).choices == {"a": "full", "b": "keep"}


def test_plan_uses_boundary_sharing():
    # Block 0 keeps its output; block 1 keeping its input costs nothing extra.
    keep = OptionCost(10, True, True)
    profiles = [
        BlockProfile("a", 0, 100, 100, False, {"keep": keep}),
        BlockProfile("b", 0, 100, 100, True, {"keep": OptionCost(10, True, False)}),
    ]
    plan = evaluate_plan(profiles, ["keep", "keep"])
    assert plan.block_bytes == {"a": 210, "b": 10} and plan.activation_bytes == 220


def test_plan_budget_errors_and_table():
    profiles = _random_profiles(random.Random(1), 3)
    allowed = ["keep", "selective", "full"]
    minimum = min(evaluate_plan(profiles, c).peak_bytes for c in itertools.product(allowed, repeat=3))
    with pytest.raises(
        NoPlanFitsError, match=rf"smallest peak activation bytes .*\({minimum} bytes\).*allow 'offload'"
    ):
        plan_checkpointing(profiles, minimum - 1, allowed=allowed)
    assert plan_checkpointing(profiles, minimum, allowed=allowed).peak_bytes == minimum
    for bad in ["-1GB", "banana", 0]:
        with pytest.raises(ValueError, match="max_bytes must be"):
            plan_checkpointing(profiles, bad)
    with pytest.raises(ValueError, match="allowed treatments must be among .* got 'cheap'"):
        plan_checkpointing(profiles, 10**6, allowed=["cheap"])
    with pytest.raises(ValueError, match="pointwise_flops_per_byte must be >= 0, got -1"):
        CostModel(pointwise_flops_per_byte=-1)
    plan = plan_checkpointing(profiles, 10**6)
    assert set(plan.choices.values()) == {"keep"} and plan.cost == 0
    table = plan.table()
    assert table.splitlines()[0].split()[:3] == ["block", "choice", "activations"] and "total" in table
    assert "peak" not in table  # nothing recomputes: the peak is the end of the forward
    late = evaluate_plan(profiles, ["keep", "keep", "full"])
    assert late.peak_bytes > late.activation_bytes
    assert late.table().splitlines()[-1].split()[:3] == ["peak", "in", "backward"]


class Bottleneck(nn.Module):
    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


@pytest.mark.parametrize("choice", ["selective", "full"])
def test_batchnorm_statistics_updated_once_and_gradients_equal(choice):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), *[Bottleneck() for _ in range(2)])
    x = torch.randn(2, 3, 8, 8)
    ref_model = copy.deepcopy(model)
    ref_model(x).square().mean().backward()
    apply_checkpointing(model, {"1": choice, "2": choice})
    model(x).square().mean().backward()
    for (n, a), b in zip(model.state_dict().items(), ref_model.state_dict().values()):
        assert torch.equal(a, b), n  # running_mean/var and num_batches_tracked: one update
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_input_held_by_op_outside_blocks_counted_once():
    torch.manual_seed(0)
    # The stem's ReLU saves its output, which is the first block's input: keeping it costs block 0 nothing.
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), *[Bottleneck() for _ in range(2)])
    x = torch.randn(2, 3, 8, 8)
    blocks = find_blocks(model, [Bottleneck])
    profiles = profile_blocks(model, blocks, x, choices=["full"])
    assert [(p.chained, p.input_held) for p in profiles] == [(False, True), (True, False)]
    plan = evaluate_plan(profiles, ["full", "full"])
    assert plan.block_bytes == {"2": 0, "3": 2 * 4 * 6 * 6 * 4}
    apply_checkpointing(model, plan)
    with ActivationMeter(model, blocks) as meter:
        model(x).sum().backward()
    assert meter.block_bytes == plan.block_bytes


class _MaskedBlock(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x, mask):
        return x + self.fc2(torch.relu(self.fc1(x)) * mask)  # the product saves the mask for backward


class _Masked(nn.Module):
    def __init__(self, n: int, h: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_MaskedBlock(h) for _ in range(n))

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return x


def test_blocks_alike_but_for_an_input_an_earlier_one_holds_are_profiled_once_and_count_it_once():
    # Every layer takes the one mask; the first counts it. The layers run alike: one profile serves all,
    # and each takes off what an earlier layer holds (as a Hugging Face stack's attention mask).
    torch.manual_seed(0)
    B, T, h = 2, 8, 16
    model = _Masked(3, h)
    x, mask = torch.randn(B, T, h, requires_grad=True), (torch.rand(B, T, 4 * h) > 0.5).float()
    blocks = find_blocks(model, [_MaskedBlock])
    inputs = capture_block_inputs(model, blocks, x, mask)
    assert [inputs[n].shared for n, _ in blocks] == [(), (1,), (1,)]
    runs = {n: 0 for n, _ in blocks}
    hooks = [b.register_forward_pre_hook(lambda *a, n=n: runs.__setitem__(n, runs[n] + 1)) for n, b in blocks]
    profiles = profile_blocks(model, blocks, inputs=inputs)
    for hook in hooks:
        hook.remove()
    assert runs["layers.0"] > 0 and runs["layers.1"] == runs["layers.2"] == 0
    mask_bytes = B * T * 4 * h * 4
    first, later = profiles[0].options, profiles[1].options
    for choice in ("keep", "selective", "full"):  # full too: a checkpoint saves its inputs
        assert first[choice].internal_bytes - later[choice].internal_bytes == mask_bytes, choice
    assert later["full"].internal_bytes == 0  # its primary input alone, counted apart
    assert first["offload"].internal_bytes == later["offload"].internal_bytes == 0  # on the host
    assert [p.name for p in profiles] == [n for n, _ in blocks]
    for choices in [("keep",) * 3, ("full", "keep", "keep"), ("keep", "full", "selective"), ("full",) * 3]:
        predicted = evaluate_plan(profiles, choices)
        apply_checkpointing(model, predicted)
        with ActivationMeter(model, blocks) as meter:
            out = model(x, mask).sum()
        out.backward()
        assert meter.block_bytes == predicted.block_bytes, choices
    remove_checkpointing(model)


def test_profile_of_a_stem_whose_input_needs_no_grad_matches_measurement():
    torch.manual_seed(0)

    class Stem(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.norm = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x):
            # sin(x) saves x only where x requires grad: the batch does not, so nothing of it is held.
            return torch.relu(self.norm(self.conv(x.sin())))

    model = nn.Sequential(Stem(), *[Bottleneck() for _ in range(2)])
    x = torch.randn(2, 3, 8, 8)  # (B, C, H, W), as a batch: no grad
    blocks = find_blocks(model)
    assert [n for n, _ in blocks] == ["0", "1", "2"]
    inputs = capture_block_inputs(model, blocks, x)
    assert [inputs[n].grad_inputs for n, _ in blocks] == [(), (0,), (0,)]
    profiles = profile_blocks(model, blocks, inputs=inputs)
    # keep: conv saves sin(x) (2, 3, 8, 8), norm its input (2, 4, 6, 6) and its batch mean and inverse
    # std (4,) each, relu its output (the stem's output); x itself is not saved. full: only x is kept.
    stem = profiles[0]
    assert not stem.options["keep"].saves_input and stem.options["keep"].saves_output
    assert stem.options["keep"].internal_bytes == (2 * 3 * 8 * 8 + 2 * 4 * 6 * 6 + 2 * 4) * 4
    assert (stem.options["full"].internal_bytes, stem.options["full"].saves_input) == (0, True)
    for choices in [("keep", "keep", "keep"), ("full", "full", "full"), ("full", "keep", "full")]:
        plan = evaluate_plan(profiles, choices)
        apply_checkpointing(model, plan)
        with ActivationMeter(model, blocks) as meter:
            loss = model(x).sum()
        loss.backward()
        assert meter.block_bytes == plan.block_bytes, choices
    remove_checkpointing(model)


def test_profile_on_fake_tensors_gives_the_same_profile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    model = TinyGPT(2)
    real = profile_blocks(model, find_blocks(model), torch.randint(0, 32, (2, 8)))
    with FakeTensorMode():  # nothing allocated: the model and batch are fake
        model = TinyGPT(2)
        fake = profile_blocks(model, find_blocks(model), torch.randint(0, 32, (2, 8)))
    assert real == fake  # every byte, FLOP and pointwise byte of every treatment


def test_profile_and_plan_input_errors():
    model = TinyGPT(2)
    with pytest.raises(ValueError, match="block 'extra' was not called during the model's forward"):
        profile_blocks(model, [*find_blocks(model), ("extra", nn.Linear(2, 2))], torch.randint(0, 32, (1, 4)))
    profiles = _random_profiles(random.Random(2), 2)
    with pytest.raises(ValueError, match=r"need one choice per block \(2\), got 1"):
        evaluate_plan(profiles, ["keep"])
    del profiles[0].options["offload"]
    with pytest.raises(ValueError, match="block 'b0' has no profile for choice 'offload'"):
        evaluate_plan(profiles, ["offload", "keep"])
    with pytest.raises(ValueError, match=r"profiles lack the treatments \['offload'\]"):
        plan_checkpointing(profiles, 10**6, allowed=["keep", "selective", "full", "offload"])
    # By default the planner weighs what every block was profiled under.
    assert set(plan_checkpointing(profiles, 10**6).choices.values()) == {"keep"}
    with pytest.raises(ValueError, match="allowed must name at least one treatment"):
        plan_checkpointing(profiles, 10**6, allowed=[])


def test_keep_where_no_gain_keeps_blocks_whose_recompute_saves_nothing():
    from lightning_memopt.checkpointing import BlockProfile, OptionCost, keep_where_no_gain

    def block(name, keep_internal):
        # Full recompute holds only the input; keeping holds the input and `keep_internal` more bytes.
        options = {
            "keep": OptionCost(keep_internal, saves_input=True, saves_output=False),
            "full": OptionCost(0, saves_input=True, saves_output=False, recompute_flops=10),
        }
        return BlockProfile(name, 10, input_bytes=64, output_bytes=64, chained=True, options=options)

    profiles = [block("a", 100), block("b", 0), block("c", 32)]
    # b's own activations are only its input: recomputing it lowers nothing, so it keeps them.
    assert keep_where_no_gain(profiles, ["full"] * 3) == ["full", "keep", "full"]
    assert keep_where_no_gain(profiles, ["keep", "full", "keep"]) == ["keep", "keep", "keep"]


class _CachingBlock(nn.Module):
    """Attention-like block that appends its keys to a Hugging Face cache when one is passed."""

    def __init__(self) -> None:
        super().__init__()
        self.k, self.q = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, past_key_values=None, use_cache=False):
        k = self.k(x)  # (B, T, C)
        if past_key_values is not None:
            k, _ = past_key_values.update(k[:, None], k[:, None], 0)  # (B, 1, T_cache, C)
            k = k[:, 0]
        return (self.q(x) @ k.transpose(1, 2)).softmax(-1) @ k, use_cache


@pytest.mark.parametrize("choice", ["selective", "full", "offload"])
def test_checkpointed_blocks_run_without_the_key_value_cache(choice):
    cache_utils = pytest.importorskip("transformers.cache_utils")
    torch.manual_seed(0)
    block, x = _CachingBlock(), torch.randn(2, 4, 8)
    reference, _ = block(x)  # what training computes: no earlier keys in the cache
    reference.sum().backward()
    ref = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    apply_checkpointing(block, {"": choice})
    cache = cache_utils.DynamicCache()
    out, use_cache = block(x, past_key_values=cache, use_cache=True)
    out.sum().backward()  # a recomputation appending to the cache again would see twice the keys
    assert cache.get_seq_length() == 0 and use_cache is False
    torch.testing.assert_close(out, reference)
    for p, r in zip(block.parameters(), ref):
        torch.testing.assert_close(p.grad, r)
    # A block that only reads the cache says so, and keeps it.
    type(block)._can_checkpoint_with_cache = True
    try:
        block(x, past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == 4
    finally:
        del type(block)._can_checkpoint_with_cache
    remove_checkpointing(block)


def test_forward_probe_reads_whats_held_outside_the_blocks_after_micro_batches_ran_backward():
    """Under micro-batching each micro-batch's backward runs before the step's forward is over: the bytes
    held outside the blocks (embeddings, head, loss) are those at the most, not what is left (nothing)."""
    from lightning_memopt.checkpointing.meter import ForwardProbe

    torch.manual_seed(0)
    model = TinyGPT(2)
    blocks = find_blocks(model)
    idx = torch.randint(0, 32, (4, 8))

    def loss(x):
        return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())

    whole = ForwardProbe(model, blocks, record=False)
    out = loss(idx)
    whole.forward_done()  # the forward's end: everything still held
    del out
    split = ForwardProbe(model, blocks, record=False)
    for part in idx.split(2):
        loss(part).backward()  # each micro-batch's backward runs inside the step
    split.forward_done()
    whole_part = ForwardProbe(model, blocks, record=False)
    out = loss(idx[:2])
    whole_part.forward_done()
    del out
    assert split.outside_bytes == whole_part.outside_bytes > 0
    assert split.meter.total == whole_part.meter.total and whole.outside_bytes > split.outside_bytes


def test_forward_probe_counts_the_batch_autograd_does_not_hold_once():
    """The step's batch stays alive through the step: what autograd does not already hold of it counts in
    ``batch_bytes`` (the token ids are the embedding's saved indices: activations, not counted again), each
    storage once however many views of it the batch holds."""
    from lightning_memopt.checkpointing.meter import ForwardProbe

    torch.manual_seed(0)
    model = TinyGPT(2)
    idx, features = torch.randint(0, 32, (4, 8)), torch.zeros(4, 100)
    probe = ForwardProbe(model, find_blocks(model), record=False)
    out = model(idx).sum() + features.mean()
    probe.forward_done([idx, features, features[:2]])
    del out
    assert probe.batch_bytes == 4 * 100 * 4


def test_forward_probe_counts_a_batch_the_micro_batches_saved_once_after_their_backwards_ran():
    """Under micro-batching each micro-batch's backward has run by the end of the step's forward, and the
    token ids its embedding saved (views of the batch's one storage) are no longer held: they counted in
    ``outside_bytes`` when the activations were at their most, and are not counted again in
    ``batch_bytes`` (a ViT's images, which its patch embedding saves, were counted twice: its plan saw no
    room where the size search had measured the step to fit)."""
    from lightning_memopt.checkpointing.meter import ForwardProbe

    torch.manual_seed(0)
    model = TinyGPT(2)
    blocks = find_blocks(model)
    idx, features = torch.randint(0, 32, (4, 8)), torch.zeros(4, 100)
    probe = ForwardProbe(model, blocks, record=False)
    for part in idx.split(2):
        torch.nn.functional.cross_entropy(model(part).flatten(0, 1), part.flatten()).backward()
    probe.forward_done([idx, features])
    assert probe.batch_bytes == 4 * 100 * 4  # the features only
    whole = ForwardProbe(model, blocks, record=False)
    out = model(idx).sum()
    whole.forward_done([idx, features])
    del out
    assert whole.batch_bytes == probe.batch_bytes


@pytest.mark.parametrize("choice", ["keep", "full"])
def test_a_stem_that_saves_a_slice_of_its_batch_holds_the_slice_not_the_batch(choice):
    # A micro-batch is a slice of the DataLoader's batch (one storage); a stem block that saves its input
    # (a convolution or linear layer on the raw batch) makes autograd hold that storage, which the tracker
    # counts whole. The meter counts the slice, as the plan does: the rest of the batch is held anyway.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16)), nn.Sequential(nn.Linear(16, 8), nn.Tanh()))
    apply_checkpointing(model, {"0": choice, "1": choice})
    blocks = [("0", model[0]), ("1", model[1])]
    batch = torch.randn(12, 8)
    measured = []
    for x in (batch[:3], batch[:3].clone()):  # the slice, and the same samples as a storage of their own
        with ActivationMeter(model, blocks) as meter:
            model(x).sum().backward()
        measured.append(meter.block_bytes)
    assert measured[0] == measured[1]
    assert measured[0]["0"] == 3 * 8 * 4  # the slice (its output is held by the next block's linear layer)
    remove_checkpointing(model)


def test_the_meter_counts_no_replay():
    # The one-time exactness check runs the batch again as another split (a replay): its last micro-batch
    # is smaller, and a block's last forward would read too little.
    from lightning_memopt._replay import replaying

    torch.manual_seed(0)
    model = TinyGPT(2)
    blocks = find_blocks(model)
    apply_checkpointing(model, {n: "keep" for n, _ in blocks})
    with ActivationMeter(model, blocks) as meter:
        model(torch.randint(0, 32, (4, 8))).sum()
        measured = dict(meter.block_bytes)
        with replaying():
            model(torch.randint(0, 32, (1, 8))).sum()
    assert meter.block_bytes == measured and all(v > 0 for v in measured.values())
    remove_checkpointing(model)


def test_a_stem_handed_two_slices_of_one_storage_counts_both_slices_once():
    class Stem(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(4, 8)

        def forward(self, left, right):
            return self.a(left) + self.b(right)  # each linear layer saves its slice

    torch.manual_seed(0)
    stem = Stem()
    batch = torch.randn(12, 8)
    measured = []
    for x in (batch[:3], batch[:3].clone()):  # both slices of the batch, or of a 3-sample storage
        with ActivationMeter(stem, [("", stem)]) as meter:
            stem(x[:, :4], x[:, 4:]).sum().backward()
        measured.append(meter.block_bytes[""])
    assert measured == [3 * 8 * 4, 3 * 8 * 4]  # the two halves of three samples: what the block holds

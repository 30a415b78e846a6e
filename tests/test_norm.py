import copy
import os

import pytest
import torch
from torch import nn

import lightning_memopt.norm as norm
from lightning_memopt.memory import MemoryTracker
from lightning_memopt.norm import (
    ConvertedLayer,
    SkippedLayer,
    SwappedGroupNorm,
    convert_batchnorm,
    register_converter,
    revert_groupnorm,
)
from tests.distributed import free_port

X = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(0))


def _cnn(c=8, classes=4):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1),
        nn.BatchNorm2d(c),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(c, 6),
        nn.BatchNorm1d(6),
        nn.ReLU(),
        nn.Linear(6, classes),
    )


def _randomize(bn):
    """Non-default weight, bias, eps and running stats, so a copy that resets any of them is caught."""
    with torch.no_grad():
        if bn.weight is not None:
            bn.weight.uniform_(2.0, 4.0)
        if bn.bias is not None:
            bn.bias.uniform_(-2.0, -1.0)
        if bn.running_mean is not None:
            bn.running_mean.uniform_(-1.0, 1.0)
            bn.running_var.uniform_(1.0, 2.0)
            bn.num_batches_tracked.fill_(7)
    return bn


# ----------------------------------------------------------------------------------------- every kind


@pytest.mark.parametrize(
    ("bn", "shape", "groups"),
    [
        (nn.BatchNorm1d(12, eps=1e-3), (2, 12, 5), 12),  # (N, C, L): spatial extent, divisor rule
        (nn.BatchNorm2d(48, eps=1e-3), (2, 48, 3, 3), 24),  # largest divisor of 48 not above 32
        (nn.BatchNorm3d(64, eps=1e-3), (2, 64, 2, 2, 2), 32),
        (nn.SyncBatchNorm(17, eps=1e-3), None, 17),  # C=17: 17 groups, not gcd(32, 17) = 1
        (type("MyBatchNorm", (nn.BatchNorm2d,), {})(20, eps=1e-3), (2, 20, 2, 2), 20),  # plain subclass
    ],
)
def test_every_batchnorm_kind_becomes_groupnorm(bn, shape, groups):
    _randomize(bn).eval()
    weight, bias = bn.weight, bn.bias
    example = None if shape is None else torch.randn(shape)
    report = convert_batchnorm(bn, example_input=example)
    gn = report.module
    assert type(gn) is SwappedGroupNorm and isinstance(gn, nn.GroupNorm)
    assert (gn.num_channels, gn.num_groups, gn.eps, gn.affine) == (bn.num_features, groups, 1e-3, True)
    assert gn.weight is weight and gn.bias is bias
    assert gn.training is False
    assert report.converted == [
        ConvertedLayer(
            ("",), f"{type(bn).__module__}.{type(bn).__qualname__}", bn.num_features, groups, shape
        )
    ]
    if example is not None:  # and it computes GroupNorm with those very parameters
        expected = nn.functional.group_norm(example, groups, weight, bias, 1e-3)
        assert torch.equal(gn(example), expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_parameters_keep_dtype(dtype):
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).to(dtype)
    weight = model[1].weight
    convert_batchnorm(model)
    assert model[1].weight is weight and weight.dtype == dtype and model[1].bias.dtype == dtype
    x = torch.randn(2, 3, 4, 4, dtype=dtype)
    assert model(x).dtype == dtype  # Opacus' fix came back float32


def test_meta_parameters_stay_meta():
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    weight = model[1].weight
    convert_batchnorm(model)
    assert model[1].weight is weight and weight.is_meta and model[1].bias.is_meta
    assert [p.device.type for p in model.parameters()] == ["meta"] * 4


def test_affine_false_no_running_stats_and_biasless_do_not_crash():
    no_affine = nn.BatchNorm2d(4, affine=False)
    no_stats = nn.BatchNorm2d(4, track_running_stats=False)
    no_bias = nn.BatchNorm2d(4)
    no_bias.register_parameter("bias", None)
    model = nn.Sequential(no_affine, no_stats, no_bias)
    convert_batchnorm(model)
    assert model[0].affine is False and model[0].weight is None and model[0].bias is None
    assert model[1].weight is no_stats.weight and model[1].bias is no_stats.bias
    assert model[2].weight is no_bias.weight and model[2].bias is None
    assert list(model.state_dict()) == [
        "0.running_mean",
        "0.running_var",
        "0.num_batches_tracked",
        "1.weight",
        "1.bias",
        "2.weight",
        "2.running_mean",
        "2.running_var",
        "2.num_batches_tracked",
    ]  # the BatchNorms' keys, unchanged
    out = model(torch.randn(2, 4, 3, 3))
    assert out.shape == (2, 4, 3, 3)


# ------------------------------------------------------------------------------------------- groups


@pytest.mark.parametrize(
    ("channels", "kwargs", "groups"),
    [
        (48, {}, 24),
        (64, {}, 32),
        (17, {}, 17),
        (12, {"num_groups": 5}, 4),
        (12, {"num_groups": 1}, 1),
        (12, {"group_size": 4}, 3),
        (12, {"group_size": 12}, 1),
    ],
)
def test_group_count(channels, kwargs, groups):
    model = nn.Sequential(nn.BatchNorm2d(channels))
    report = convert_batchnorm(model, **kwargs)
    assert model[0].num_groups == groups and report.groups == {"0": groups}


def test_group_size_that_does_not_divide_raises_with_valid_sizes():
    with pytest.raises(
        ValueError,
        match=r"group_size=5 does not divide the 12 channels of '0'; valid group sizes: \[1, 2, 3, 4, 6, 12\]",
    ):
        convert_batchnorm(nn.Sequential(nn.BatchNorm2d(12)), group_size=5)


def test_explicit_count_that_does_not_divide_raises_with_valid_counts():
    model = nn.Sequential(nn.BatchNorm2d(12), nn.BatchNorm2d(8))
    with pytest.raises(
        ValueError,
        match=r"groups gives '1' 5 groups, which does not divide its 8 channels; valid group counts: \[1, 2, 4, 8\]",
    ):
        convert_batchnorm(model, groups={"0": 6, "1": 5})
    assert type(model[0]) is nn.BatchNorm2d  # nothing was swapped


def test_explicit_plan_converts_only_the_named_layers():
    model = nn.Sequential(nn.BatchNorm2d(12), nn.BatchNorm2d(8))
    report = convert_batchnorm(model, groups={"1": 2})
    assert type(model[0]) is nn.BatchNorm2d and model[1].num_groups == 2
    assert report.skipped == [
        SkippedLayer(("0",), "torch.nn.modules.batchnorm.BatchNorm2d", "not listed in groups")
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_groups": 0}, "num_groups must be a positive int, got 0"),
        ({"num_groups": True}, "num_groups must be a positive int, got True"),
        ({"num_groups": "8"}, "num_groups must be a positive int, got '8'"),
        ({"group_size": -2}, "group_size must be a positive int, got -2"),
        ({"groups": {"0": 0}}, r"groups\['0'\] must be a positive int, got 0"),
        (
            {"groups": {"0": 2}, "group_size": 2},
            r"pass one of num_groups=, group_size= or groups=, not group_size and groups "
            r"\(got num_groups=None, group_size=2, groups=\{'0': 2\}\)",
        ),
        (
            {"num_groups": 4, "group_size": 2},
            r"pass one of num_groups=, group_size= or groups=, not num_groups and group_size "
            r"\(got num_groups=4, group_size=2, groups=None\)",
        ),
        (
            {"num_groups": 4, "groups": {"0": 2}},
            r"pass one of num_groups=, group_size= or groups=, not num_groups and groups",
        ),
        (
            {"groups": [("0", 2)]},
            r"groups must be a mapping of layer name to group count \(like report.groups\), got \[\('0', 2\)\]",
        ),
        (
            {"groups": {"fc": 2}},
            r"groups names \['fc'\] that are not BatchNorm layers of the Sequential; its BatchNorm layers are \['0'\]",
        ),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        convert_batchnorm(nn.Sequential(nn.BatchNorm2d(4)), **kwargs)


def test_module_must_be_a_module():
    with pytest.raises(TypeError, match=r"convert_batchnorm expects a torch.nn.Module, got dict"):
        convert_batchnorm({"bn": nn.BatchNorm2d(4)})


@pytest.mark.parametrize("example_input", [None, torch.zeros(2, 5)], ids=["unprobed", "probed"])
def test_group_size_must_divide_every_layer_even_one_that_gets_one_group(example_input):
    """A BatchNorm1d on (N, C) gets 1 group; a group_size that does not divide its C is still an error
    (it used to become 1 group silently)."""
    model = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16))
    with pytest.raises(
        ValueError,
        match=r"group_size=3 does not divide the 16 channels of '1'; valid group sizes: \[1, 2, 4, 8, 16\]",
    ):
        convert_batchnorm(model, group_size=3, example_input=example_input)
    assert type(model[1]) is nn.BatchNorm1d  # nothing was swapped


def test_default_groups_for_counts_32_does_not_divide():
    """The largest divisor of C not above 32, as the module docstring lists."""
    counts = (8, 24, 48, 56, 64, 144, 336, 37)
    model = nn.Sequential(*(nn.BatchNorm2d(c) for c in counts))
    report = convert_batchnorm(model)
    assert [layer.num_groups for layer in report.converted] == [8, 24, 24, 28, 32, 24, 28, 1]


def test_unprobed_layer_with_one_value_per_group_refuses_to_run():
    """BatchNorm2d(32) on 1x1 maps, swapped without the input shape: 32 groups of one value would output
    the bias whatever the input; its first forward raises, naming the layer and the fix."""
    model = nn.Sequential(nn.Conv2d(3, 32, 1), nn.BatchNorm2d(32))
    convert_batchnorm(model)
    assert model[1].num_groups == 32
    assert model(torch.randn(2, 3, 2, 2)).shape == (2, 32, 2, 2)  # with spatial extent it runs
    with pytest.raises(
        ValueError,
        match=r"'1': GroupNorm\(32, 32\) swapped for a BatchNorm got input of shape \(2, 32, 1, 1\): each group "
        r"holds a single value per sample, so the layer would output a constant. Let the swap see the input "
        r"shape \(set example_input_array on the LightningModule, or pass example_input= to convert_batchnorm\)",
    ):
        model(torch.randn(2, 3, 1, 1))
    probed = nn.Sequential(nn.Conv2d(3, 32, 1), nn.BatchNorm2d(32))
    convert_batchnorm(probed, example_input=torch.randn(2, 3, 1, 1))
    assert probed[1].num_groups == 1
    out = probed(torch.randn(4, 3, 1, 1))
    assert out.std(dim=1).min() > 0.5  # normalized over the 32 channels, not erased


# ------------------------------------------------------------------------ no group of a single value


def test_batchnorm1d_on_features_keeps_unit_std():
    """BatchNorm1d(4) on (N, C): one group over the features, output std ~1; Opacus' GroupNorm(4, 4) gives 0."""
    torch.manual_seed(0)
    x = torch.randn(64, 4) * 5 + 3
    model = nn.Sequential(nn.BatchNorm1d(4))
    report = convert_batchnorm(model, example_input=x)
    assert model[0].num_groups == 1 and report.converted[0].input_shape == (64, 4)
    out = model(x)
    # GroupNorm(1, 4) normalizes each sample's 4 features: biased std exactly 1 up to eps
    assert torch.allclose(out.std(dim=1, unbiased=False), torch.ones(64), atol=1e-3)
    assert (
        nn.GroupNorm(4, 4)(x).std() < 1e-3
    )  # what a group per channel does: erases the data (~0, float noise)


def test_batchnorm1d_without_probe_warns_and_uses_one_group():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 6), nn.BatchNorm1d(6))
    with pytest.warns(
        UserWarning,
        match=r"BatchNorm1d layer\(s\) '1', '3' became GroupNorm\(1, C\), assuming \(N, C\) input; pass example_input",
    ) as record:
        report = convert_batchnorm(model)
    assert len(record) == 1 and report.unprobed == ["'1'", "'3'"]
    assert (model[1].num_groups, model[3].num_groups) == (1, 1)
    assert model(torch.randn(5, 3)).std(dim=1, unbiased=False).min() > 0.5


def test_probe_sees_no_spatial_extent_in_1x1_maps():
    model = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.BatchNorm2d(8), nn.Flatten())
    convert_batchnorm(model, example_input=torch.randn(2, 8, 5, 5))
    assert model[1].num_groups == 1


def test_single_value_per_sample_raises():
    with pytest.raises(
        ValueError, match=r"'0' sees a single value per sample \(1 channel, no spatial extent\)"
    ):
        convert_batchnorm(nn.Sequential(nn.BatchNorm1d(1)), example_input=torch.randn(4, 1))


def test_explicit_count_leaving_one_value_per_group_raises():
    with pytest.raises(
        ValueError, match=r"groups gives '0' 4 groups, which leaves one value per group \(output 0\)"
    ):
        convert_batchnorm(nn.Sequential(nn.BatchNorm1d(4)), groups={"0": 4}, example_input=torch.randn(3, 4))


def test_probe_restores_modes_rng_and_statistics():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 1), nn.Dropout(0.5), nn.BatchNorm2d(8), nn.Flatten(), nn.BatchNorm1d(8 * 9)
    )
    model.train()
    model[0].eval()
    stats = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "tracked" in k}
    example = (torch.randn(2, 3, 3, 3),)  # a tuple is *args
    torch.manual_seed(1)
    expected_draw = torch.rand(3)
    torch.manual_seed(1)
    report = convert_batchnorm(model, example_input=example)
    assert torch.equal(torch.rand(3), expected_draw)  # the probe's dropout drew from a forked RNG
    assert [m.training for m in model] == [False, True, True, True, True]
    assert [layer.input_shape for layer in report.converted] == [(2, 8, 3, 3), (2, 72)]
    assert model[4].num_groups == 1
    for name, value in stats.items():  # eval mode: the held BatchNorms' statistics were not updated
        layer = model[int(name.split(".")[0])].batchnorm
        assert torch.equal(getattr(layer, name.split(".")[1]), value)


def test_probe_of_a_meta_model_runs_on_meta():
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.BatchNorm1d(8 * 16))
    report = convert_batchnorm(model, example_input=torch.randn(2, 3, 6, 6))  # a CPU input
    assert [layer.input_shape for layer in report.converted] == [(2, 8, 4, 4), (2, 128)]
    assert (model[1].num_groups, model[3].num_groups) == (8, 1) and model[1].weight.is_meta


def test_probe_casts_the_input_to_the_model_dtype():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).to(torch.bfloat16)
    report = convert_batchnorm(model, example_input=torch.randn(2, 3, 5, 5))  # float32 input, bf16 model
    assert report.converted[0].input_shape == (2, 8, 3, 3) and model[1].weight.dtype == torch.bfloat16


def test_probe_with_keyword_input():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, *, features):
            return self.bn(features)

    model = Model()
    report = convert_batchnorm(model, example_input={"features": torch.randn(3, 4, 7)})
    assert report.converted[0].input_shape == (3, 4, 7) and model.bn.num_groups == 4


def test_probe_failure_raises():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with pytest.raises(
        RuntimeError,
        match=r"probing BatchNorm input shapes with example_input failed \(RuntimeError: .*shapes",
    ):
        convert_batchnorm(model, example_input=torch.randn(2, 5))
    assert type(model[1]) is nn.BatchNorm1d and model.training


# ------------------------------------------------------------------------------ batch independence


def test_output_of_a_sample_does_not_depend_on_its_batch():
    model = _cnn()
    x = torch.randn(8, 3, 6, 6)
    before = model(x)[:1]
    assert not torch.allclose(before, model(x[:2])[:1], atol=1e-3)  # BatchNorm: it does
    convert_batchnorm(model, example_input=x)
    alone, in_batch = model(x[:1]), model(x)[:1]
    torch.testing.assert_close(alone, in_batch, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------- subclasses, lazy, frozen, DTensor


class BatchNormReLU(nn.BatchNorm2d):
    def forward(self, x):
        return torch.relu(super().forward(x))


def test_subclass_overriding_forward_raises_with_its_qualified_name(monkeypatch):
    monkeypatch.setattr(norm, "_CONVERTERS", {})
    model = nn.Sequential(nn.BatchNorm2d(4), BatchNormReLU(4))
    with pytest.raises(
        TypeError,
        match=r"'1' is a tests.test_norm.BatchNormReLU, a BatchNorm subclass that overrides forward",
    ):
        convert_batchnorm(model)
    assert type(model[0]) is nn.BatchNorm2d


def test_registered_converter_is_used(monkeypatch):
    monkeypatch.setattr(norm, "_CONVERTERS", {})
    register_converter(
        BatchNormReLU, lambda bn, g: nn.Sequential(SwappedGroupNorm.from_batchnorm(bn, g), nn.ReLU())
    )
    model = nn.Sequential(BatchNormReLU(4))
    weight = model[0].weight
    convert_batchnorm(model, num_groups=2)
    assert isinstance(model[0][1], nn.ReLU) and model[0][0].num_groups == 2 and model[0][0].weight is weight
    assert model(torch.randn(2, 4, 3, 3)).min() >= 0


def test_register_converter_checks_arguments():
    with pytest.raises(
        TypeError,
        match="register_converter expects a BatchNorm subclass, got <class 'torch.nn.modules.linear.Linear'>",
    ):
        register_converter(nn.Linear, lambda bn, g: bn)
    with pytest.raises(
        TypeError, match=r"converter must be callable as converter\(batchnorm, num_groups\), got 3"
    ):
        register_converter(BatchNormReLU, 3)


def test_uninitialized_lazy_batchnorm_raises_then_converts_after_a_forward():
    model = nn.Sequential(nn.LazyBatchNorm2d())
    with pytest.raises(
        ValueError, match=r"lazy BatchNorm layer\(s\) '0' are not initialized yet.*run one forward first"
    ):
        convert_batchnorm(model)
    model(torch.randn(2, 6, 3, 3))
    convert_batchnorm(model)
    assert model[0].num_channels == 6 and model[0].num_groups == 6


class FrozenBatchNorm2d(nn.Module):
    """The shape of torchvision.ops.FrozenBatchNorm2d: statistics and affine in buffers."""

    def __init__(self, n):
        super().__init__()
        for name in ("weight", "bias", "running_mean", "running_var"):
            self.register_buffer(name, torch.ones(n))

    def forward(self, x):
        return x


def test_frozen_layers_are_skipped_and_reported():
    frozen_grad = nn.BatchNorm2d(4)
    frozen_grad.requires_grad_(False)
    model = nn.Sequential(FrozenBatchNorm2d(4), frozen_grad, nn.BatchNorm2d(4))
    report = convert_batchnorm(model)
    assert type(model[0]) is FrozenBatchNorm2d and model[1] is frozen_grad
    assert isinstance(model[2], SwappedGroupNorm)
    assert report.skipped == [
        SkippedLayer(
            ("0",), "tests.test_norm.FrozenBatchNorm2d", "frozen: fixed statistics, batch-independent"
        ),
        SkippedLayer(
            ("1",), "torch.nn.modules.batchnorm.BatchNorm2d", "frozen: requires_grad=False on weight and bias"
        ),
    ]
    assert [layer.name for layer in report.converted] == ["2"]
    assert "'0': FrozenBatchNorm2d skipped: frozen" in str(report)


def test_sharded_parameters_raise(monkeypatch):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    monkeypatch.setitem(os.environ, "MASTER_ADDR", "127.0.0.1")
    monkeypatch.setitem(os.environ, "MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        bn = nn.BatchNorm2d(4)
        bn.weight = nn.Parameter(distribute_tensor(bn.weight.detach(), mesh, [Replicate()]))
        with pytest.raises(
            ValueError,
            match=r"'0' has sharded \(DTensor\) parameters; convert BatchNorm layers before sharding",
        ):
            convert_batchnorm(nn.Sequential(bn))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ in place, references


def test_shared_layer_becomes_one_groupnorm():
    bn = nn.BatchNorm2d(4)
    a, b = nn.Sequential(bn), nn.Sequential(bn)
    model = nn.Sequential(a, b)
    report = convert_batchnorm(model)
    assert a[0] is b[0] and isinstance(a[0], SwappedGroupNorm)
    assert report.converted[0].names == ("0.0", "1.0") and report.groups == {"0.0": 4, "1.0": 4}
    assert len(list(model.parameters())) == 2


def test_second_conversion_changes_nothing():
    model = _cnn()
    convert_batchnorm(model, example_input=X)
    layers = list(model)
    state = copy.deepcopy(model.state_dict())
    report = convert_batchnorm(model, example_input=X)
    assert report.converted == [] and report.skipped == [] and report.module is model
    assert list(model) == layers and all(a is b for a, b in zip(model, layers))
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_optimizer_created_before_the_swap_still_trains_the_groupnorm():
    model = _cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    order = [id(p) for p in model.parameters()]
    convert_batchnorm(model, example_input=X)
    assert [id(p) for p in model.parameters()] == order  # so optimizer state_dicts (by position) still map
    before = model[1].weight.detach().clone()
    model(torch.randn(4, 3, 6, 6)).sum().backward()
    opt.step()
    assert model[1].weight.grad is not None and not torch.equal(model[1].weight, before)
    assert any(p is model[1].weight for p in opt.param_groups[0]["params"])


# -------------------------------------------------------------------------------------- checkpoints


def test_state_dict_keys_and_pre_swap_checkpoint_loads():
    old = _cnn()
    for m in (old[1], old[6]):
        _randomize(m)
    saved = copy.deepcopy(old.state_dict())
    model = _cnn()
    keys = list(model.state_dict())
    convert_batchnorm(model, example_input=X)
    assert list(model.state_dict()) == keys  # the swap changes no key
    assert str(model.load_state_dict(saved)) == "<All keys matched successfully>"
    for i in (1, 6):
        assert torch.equal(model[i].weight, saved[f"{i}.weight"]) and torch.equal(
            model[i].bias, saved[f"{i}.bias"]
        )
        # the statistics are the held BatchNorm's own tensors, for a faithful revert
        assert torch.equal(model[i].running_mean, saved[f"{i}.running_mean"])
        assert model[i].running_mean is model[i].batchnorm.running_mean
    # a checkpoint saved after the swap loads strictly into the original BatchNorm model
    assert str(_cnn().load_state_dict(model.state_dict())) == "<All keys matched successfully>"
    # one saved without the statistics (earlier versions of the swap dropped them) still loads
    stats = ("running_mean", "running_var", "num_batches_tracked")
    assert str(model.load_state_dict({k: v for k, v in saved.items() if not k.endswith(stats)})) == (
        "<All keys matched successfully>"
    )
    # the rest stays strict
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "1.extra"'):
        model.load_state_dict({**saved, "1.extra": torch.zeros(1)})
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "1.weight"'):
        model.load_state_dict({k: v for k, v in saved.items() if k != "1.weight"})


def test_revert_restores_batchnorm_faithfully():
    model = _cnn()
    bn = model[1]
    bn.momentum = 0.3
    _randomize(bn)
    stats = bn.running_mean.clone()
    weight = bn.weight
    convert_batchnorm(model, example_input=X)
    model.eval()
    reverted = revert_groupnorm(model)
    assert reverted is model and model[1] is bn and type(model[6]) is nn.BatchNorm1d
    assert (
        model[1].weight is weight and torch.equal(model[1].running_mean, stats) and model[1].momentum == 0.3
    )
    assert model[1].training is False  # the mode at revert time
    assert list(model.state_dict()) == list(_cnn().state_dict())


def test_root_batchnorm_round_trip():
    bn = _randomize(nn.BatchNorm2d(4))
    gn = convert_batchnorm(bn).module
    assert isinstance(gn, SwappedGroupNorm) and gn.batchnorm is bn
    assert revert_groupnorm(gn) is bn


def test_conversion_allocates_nothing():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    param_bytes = (8 * 3 * 9 + 8 + 8 + 8) * 4  # conv weight and bias, BatchNorm weight and bias (float32)
    stat_bytes = 2 * 8 * 4 + 8  # running_mean, running_var (float32), num_batches_tracked (int64)
    with MemoryTracker(model) as tracker:
        assert tracker.current == param_bytes + stat_bytes
        convert_batchnorm(model)
        assert tracker.peak == param_bytes + stat_bytes  # no tensor was created, not even on meta
    with MemoryTracker(model) as tracker:
        # the statistics are still the model's (same tensors, now buffers of the GroupNorm; the tracker
        # counts a module's buffers with its parameters)
        assert tracker.current_breakdown["parameters"] == param_bytes + stat_bytes


def test_micro_batch_gradients_match_the_full_batch():
    """The reason for the swap: 4 micro-batches of 2 give the full batch's gradient only without BatchNorm."""
    x, y = torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(2)), torch.arange(8) % 4

    def grads(model, micro):
        model.zero_grad()
        for xs, ys in zip(x.split(micro), y.split(micro)):
            (nn.functional.cross_entropy(model(xs), ys) * len(ys) / len(y)).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    model = _cnn()
    assert rel(grads(model, 2), grads(model, 8)) > 0.1  # BatchNorm: micro-batching changes the gradient
    convert_batchnorm(model, example_input=X)
    assert rel(grads(model, 2), grads(model, 8)) < 1e-6  # GroupNorm: only float rounding (rel 1e-6)


def test_explicit_plan_with_two_counts_for_one_shared_layer_raises():
    bn = nn.BatchNorm2d(4)
    model = nn.Sequential(bn, bn)
    with pytest.raises(
        ValueError, match=r"groups gives different counts \[1, 2\] to the shared layer \('0', '1'\)"
    ):
        convert_batchnorm(model, groups={"0": 2, "1": 1})


def test_revert_follows_the_model_to_a_new_dtype_and_out_of_meta():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), _randomize(nn.BatchNorm2d(4)))
    stats = model[1].running_var.clone()
    convert_batchnorm(model)
    model.double()
    revert_groupnorm(model)
    assert model[1].running_var.dtype == torch.float64 and torch.equal(model[1].running_var, stats.double())
    assert model[1].num_batches_tracked.dtype == torch.int64
    model(torch.randn(2, 3, 2, 2, dtype=torch.float64))  # BatchNorm runs with its statistics in float64

    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    convert_batchnorm(model)
    model.to_empty(device="cpu")
    revert_groupnorm(model)
    assert torch.equal(model[1].running_mean, torch.zeros(4)) and torch.equal(
        model[1].running_var, torch.ones(4)
    )
    assert model[1].num_batches_tracked.item() == 0 and not model[1].running_mean.is_meta

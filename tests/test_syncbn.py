"""ddp_lab.syncbn: synchronised BatchNorm equals BatchNorm over the global batch.

The distributed tests spawn 2 and 3 gloo processes holding *unequal* slices of one global
batch (one case with an empty slice) and compare forward output, input gradient, weight and
bias gradients (summed over ranks), running stats and eval output with a plain
``nn.BatchNorm*d`` applied to the concatenated batch in this process.
"""

from __future__ import annotations

import copy

import _syncbn_workers as workers
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import spawn_gloo
from torch import nn

from ddp_lab.models import SmallCNN
from ddp_lab.syncbn import (
    SyncBatchNorm,
    convert_sync_batchnorm,
    convert_sync_batchnorm_auto,
    sync_batch_norm,
)

#: Largest allowed max-abs difference from the single-process reference, per dtype.
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
CASE_NAMES = list(workers.cases(2))
SPAWN_TIMEOUT_S = 90.0


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"world{ws}")
def spawned(request, tmp_path_factory) -> tuple[int, list[dict]]:
    """(world_size, per-rank results) of one spawned run of every case."""
    world_size = request.param
    out_dir = tmp_path_factory.mktemp(f"syncbn_world{world_size}")
    with pytest.MonkeyPatch.context() as mpatch:
        mpatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the children
        spawn_gloo(workers.run_worker, world_size, str(out_dir), timeout=SPAWN_TIMEOUT_S)
    return world_size, [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _reference(case: workers.Case) -> dict:
    """nn.BatchNorm*d on the concatenated global batch, one process."""
    data = workers.make_data(case)
    ndim = 2 + len(case.tail)
    bn = workers.reference_bn(workers.CHANNELS, ndim, momentum=case.momentum).to(case.dtype)
    workers.load_state(bn, data)
    ref: dict = {"y": [], "grad_x": [], "grad_weight": [], "grad_bias": []}
    for x_global, dy in zip(data["x"], data["dy"], strict=True):
        x = x_global.clone().requires_grad_(True)
        y = bn(x)
        (y * dy).sum().backward()
        ref["y"].append(y.detach())
        ref["grad_x"].append(x.grad)
        ref["grad_weight"].append(bn.weight.grad.clone())
        ref["grad_bias"].append(bn.bias.grad.clone())
        bn.zero_grad(set_to_none=True)
    ref["running_mean"] = bn.running_mean.clone()
    ref["running_var"] = bn.running_var.clone()
    ref["num_batches_tracked"] = int(bn.num_batches_tracked)
    bn.eval()
    with torch.no_grad():
        ref["y_eval"] = bn(data["x_eval"])
    return ref


def _gathered(results: list[dict], name: str) -> dict:
    """The ranks' results put together: batch-shaped ones concatenated, gradients summed."""
    per_rank = [r[name] for r in results]
    steps = range(len(per_rank[0]["y"]))
    out = {
        key: [torch.cat([r[key][s] for r in per_rank]) for s in steps] for key in ("y", "grad_x")
    }
    for key in ("grad_weight", "grad_bias"):  # what DDP's all-reduce would add up
        out[key] = [sum(r[key][s] for r in per_rank) for s in steps]
    out["y_eval"] = torch.cat([r["y_eval"] for r in per_rank])
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        out[key] = per_rank[0][key]
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case_name", CASE_NAMES)
def test_syncbn_matches_batchnorm_on_concatenated_global_batch(spawned, case_name):
    world_size, results = spawned
    case = workers.cases(world_size)[case_name]
    ref, got = _reference(case), _gathered(results, case_name)
    tol = TOL[case.dtype]
    diffs = {}
    for key in ("y", "grad_x", "grad_weight", "grad_bias"):
        diffs[key] = max(_max_diff(g, r) for g, r in zip(got[key], ref[key], strict=True))
    for key in ("running_mean", "running_var", "y_eval"):
        diffs[key] = _max_diff(got[key], ref[key])
    print(f"world {world_size} {case_name} sizes {case.sizes}: max abs diffs {diffs}")
    assert {k: d for k, d in diffs.items() if not d <= tol} == {}, f"tolerance {tol}"
    assert got["num_batches_tracked"] == ref["num_batches_tracked"] == workers.STEPS


@pytest.mark.timeout(120)
def test_syncbn_running_stats_identical_on_every_rank(spawned):
    _, results = spawned
    for name in CASE_NAMES:
        for r in results[1:]:
            assert torch.equal(r[name]["running_mean"], results[0][name]["running_mean"])
            assert torch.equal(r[name]["running_var"], results[0][name]["running_var"])


@pytest.mark.timeout(120)
def test_ddp_with_converted_cnn_matches_single_process_big_batch(spawned):
    """Local weight/bias grads + DDP's averaging = the big-batch gradient, SGD steps and all."""
    world_size, results = spawned
    model = workers.small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=workers.DDP_LR)
    for images, labels in workers.ddp_batches(world_size):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), labels).backward()
        opt.step()
    ref = model.state_dict()
    for r in results:
        got = r["ddp_cnn"]
        assert got.keys() == ref.keys()
        worst = max(_max_diff(got[k].double(), ref[k].double()) for k in ref)
        assert worst <= 1e-10, worst


# ---------------------------------------------------------------- sensitivity of the setup


def _naive_bn(x_splits: list[torch.Tensor], eps: float = 1e-5) -> torch.Tensor:
    """The classic mistake: average the per-rank means and variances (unweighted)."""
    dims = [0, *range(2, x_splits[0].dim())]
    means = torch.stack([x.mean(dims) for x in x_splits]).mean(0)
    var = torch.stack([x.var(dims, correction=0) for x in x_splits]).mean(0)
    shape = (1, -1, *([1] * (x_splits[0].dim() - 2)))
    x = torch.cat(x_splits)
    return (x - means.reshape(shape)) / (var.reshape(shape) + eps).sqrt()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_averaging_per_rank_statistics_would_be_caught(world_size):
    case = workers.cases(world_size)["image_float64"]
    x = workers.make_data(case)["x"][0]
    splits = list(x.split(list(case.sizes)))
    expected = F.batch_norm(x, None, None, training=True)
    naive = (_naive_bn(splits) - expected).abs().max().item()
    unsynced = torch.cat([F.batch_norm(s, None, None, training=True) for s in splits]) - expected
    assert naive > 1e-3, naive
    assert unsynced.abs().max().item() > 1e-3


@pytest.mark.timeout(120)
def test_inputs_that_differ_beyond_the_batch_dimension_fail_on_every_rank(spawned):
    """Ranks with 4x4 and 3x3 images cannot be one batch: every rank raises the same clear
    error (none waits for the others in a collective that never comes)."""
    _, results = spawned
    errors = {r["mismatch_error"] for r in results}
    assert len(errors) == 1, errors
    message = errors.pop()
    assert "must share every dimension but the batch dimension" in message, message
    assert "[2, 3, 4, 4]" in message and "[2, 3, 3, 3]" in message, message


# -------------------------------------------------------------------- world size 1: exact


def _steps_equal(ours: nn.Module, ref: nn.Module, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        x = torch.randn(*shape, generator=g) * 2 + 1
        dy = torch.randn(*shape, generator=g)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, yb = ours(xa), ref(xb)
        (ya * dy).sum().backward()
        (yb * dy).sum().backward()
        assert torch.equal(ya, yb)
        assert torch.equal(xa.grad, xb.grad)
        assert torch.equal(ours.weight.grad, ref.weight.grad)
        assert torch.equal(ours.bias.grad, ref.bias.grad)
    assert torch.equal(ours.running_mean, ref.running_mean)
    assert torch.equal(ours.running_var, ref.running_var)
    assert torch.equal(ours.num_batches_tracked, ref.num_batches_tracked)
    ours.eval()
    ref.eval()
    x = torch.randn(*shape, generator=g)
    assert torch.equal(ours(x), ref(x))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 5, 5)], ids=["flat", "image"])
def test_syncbn_without_process_group_equals_batchnorm_exactly(shape, momentum):
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    ref = workers.reference_bn(3, len(shape), momentum=momentum)
    ours = SyncBatchNorm(3, momentum=momentum)
    ours.load_state_dict(ref.state_dict())
    _steps_equal(ours, ref, shape)


@pytest.mark.timeout(120)
def test_synchronising_path_in_world_of_one_is_batchnorm_with_its_gradients():
    """sync_batch_norm (gather, F.batch_norm on the gathered batch, own rows) in a world of one:
    BatchNorm's output and running stats, and gradcheck passes through the gather."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        x = torch.randn(5, 3, 2, 2, dtype=torch.float64, requires_grad=True)
        w = (1 + 0.3 * torch.randn(3, dtype=torch.float64)).requires_grad_(True)
        b = torch.randn(3, dtype=torch.float64, requires_grad=True)
        rm, rv = torch.randn(3, dtype=torch.float64), 1 + torch.rand(3, dtype=torch.float64)
        ours_rm, ours_rv = rm.clone(), rv.clone()
        y = sync_batch_norm(x, ours_rm, ours_rv, w, b, 0.1, 1e-5)
        ref = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1)
        assert _max_diff(y, ref) <= 1e-12
        assert _max_diff(ours_rm, rm) <= 1e-12 and _max_diff(ours_rv, rv) <= 1e-12

        def fn(x, w, b):
            return sync_batch_norm(x, None, None, w, b, 0.1, 1e-5)

        assert torch.autograd.gradcheck(fn, (x, w, b))
        with pytest.raises(ValueError, match="more than 1 value per channel"):
            sync_batch_norm(torch.randn(1, 3), None, None, None, None, 0.1, 1e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_syncbn_in_world_of_one_equals_batchnorm_exactly():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ref, ours = nn.BatchNorm2d(3), SyncBatchNorm(3)
        _steps_equal(ours, ref, (4, 3, 5, 5))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ conversion


@pytest.mark.timeout(120)
def test_convert_sync_batchnorm_replaces_only_batchnorm_and_keeps_state():
    torch.manual_seed(0)
    model = SmallCNN(width=4)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bns) == 3
    with torch.no_grad():
        for i, bn in enumerate(bns):
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.num_batches_tracked.fill_(5 + i)
    bns[1].weight.requires_grad_(False)  # a frozen layer stays frozen
    bns[2].eval()  # and a layer in eval mode stays in eval mode
    before = copy.deepcopy(model)
    others = {n: m for n, m in model.named_modules() if not isinstance(m, nn.BatchNorm2d)}
    params = dict(model.named_parameters())

    converted = convert_sync_batchnorm(model)

    assert converted is model
    syncs = {n: m for n, m in converted.named_modules() if isinstance(m, SyncBatchNorm)}
    assert len(syncs) == 3
    assert not any(type(m) is nn.BatchNorm2d for m in converted.modules())
    for name, module in converted.named_modules():
        if name not in syncs:
            assert module is others[name], name  # untouched, same object
    for name, p in converted.named_parameters():
        assert p is params[name]  # same Parameter: value, requires_grad, optimizer state
    assert before.state_dict().keys() == converted.state_dict().keys()
    for key, value in before.state_dict().items():
        assert torch.equal(converted.state_dict()[key], value), key
    old = [m for m in before.modules() if isinstance(m, nn.BatchNorm2d)]
    for new, orig in zip(syncs.values(), old, strict=True):
        assert (new.eps, new.momentum, new.affine) == (orig.eps, orig.momentum, orig.affine)
        assert new.training == orig.training
        assert new.weight.requires_grad == orig.weight.requires_grad
    before.eval()
    converted.eval()
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(converted(x), before(x))


@pytest.mark.timeout(120)
def test_convert_sync_batchnorm_handles_bare_and_stateless_layers():
    bn = nn.BatchNorm1d(4, affine=False, track_running_stats=False, momentum=None)
    new = convert_sync_batchnorm(bn, process_group="pg")
    assert isinstance(new, SyncBatchNorm) and new is not bn
    assert new.weight is None and new.running_mean is None and new.momentum is None
    assert new.process_group == "pg"
    no_bias = convert_sync_batchnorm(nn.BatchNorm2d(2, bias=False))
    assert no_bias.bias is None and no_bias.weight is not None


@pytest.mark.timeout(120)
def test_convert_sync_batchnorm_auto_picks_implementation_by_device():
    def net() -> nn.Module:
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))

    assert type(convert_sync_batchnorm_auto(net(), torch.device("cpu"))[1]) is SyncBatchNorm
    assert type(convert_sync_batchnorm_auto(net(), "cuda")[1]) is nn.SyncBatchNorm

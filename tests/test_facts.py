"""The facts the course states about PyTorch, asserted against the installed torch (2.14.1).

Each test is named after a claim that a notebook, its "the seeds, checked" box or
``ddp_lab`` makes (a default, a size, a timeout, a communication volume, an API's
behaviour), and its docstring names the file of torch (or of the other project) that decides
it: an upgrade that changes one turns CI red. Everything runs in this process, in seconds:
single-rank gloo groups through an in-memory store (no port), and torch's fake process group
where a measurement needs a world of several ranks (the collectives do nothing; the sharding
is the real code's).
"""

from __future__ import annotations

import ast
import datetime
import inspect
import io
import json
import math
import pickle
import re
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ddp_lab.answers.lab07 import references as lab07_ref
from ddp_lab.parallel import compare, hybrid, timeline

ROOT = Path(__file__).resolve().parents[1]
TORCH = Path(torch.__file__).parent


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank in this process (any group left before is ended)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ===============================================================================================
# Labs 1 to 4: DataParallel, collectives, DDP, SyncBatchNorm
# ===============================================================================================


# --- lab 1: nn.DataParallel and splitting a batch --------------------------------------------


def test_chunk_makes_ceil_sized_pieces_and_may_make_fewer_than_asked():
    """lab01 section 2: torch.chunk(10 into 4) gives 3, 3, 3, 1; 6 into 4 gives three chunks
    (chunk's documented contract, torch/_tensor_docs.py / torch/functional.py)."""
    assert [len(c) for c in torch.chunk(torch.arange(10), 4)] == [3, 3, 3, 1]
    assert [len(c) for c in torch.chunk(torch.arange(6), 4)] == [2, 2, 2]


def test_tensor_split_gives_the_first_b_mod_n_pieces_one_more_and_empty_ones_last():
    """lab01 ex1's contract and lab02's ring chunks: tensor_split(B into n) gives the first
    B % n pieces one element more, and the empty pieces (n > B) come last."""
    assert [len(c) for c in torch.tensor_split(torch.arange(10), 4)] == [3, 3, 2, 2]
    assert [len(c) for c in torch.tensor_split(torch.arange(2), 3)] == [1, 1, 0]


def test_dataparallel_scatters_without_chunk_sizes():
    """lab01 section 5: DataParallel's scatter passes no chunk sizes, so comm.scatter divides
    the batch into 'equal chunks' (torch/nn/parallel/scatter_gather.py, comm.py)."""
    from torch.nn.parallel import comm, scatter_gather

    assert "Scatter.apply(target_gpus, None, dim, obj)" in inspect.getsource(scatter_gather)
    assert "divided" in comm.scatter.__doc__ and "into equal chunks" in comm.scatter.__doc__


def test_dataparallel_replicate_and_reduce_work_in_buffers_of_10_mib():
    """lab01 section 5: broadcast_coalesced and reduce_add_coalesced pack tensors into buffers
    of 10 MiB = 10485760 bytes (torch/nn/parallel/comm.py)."""
    from torch.nn.parallel import comm

    for fn in (comm.broadcast_coalesced, comm.reduce_add_coalesced):
        assert inspect.signature(fn).parameters["buffer_size"].default == 10 * 2**20
    source = (TORCH / "nn" / "parallel" / "_functions.py").read_text()
    assert "comm.broadcast_coalesced" in source and "comm.reduce_add_coalesced" in source


def test_dataparallel_without_gpus_just_calls_the_module():
    """lab01 dp_on_cpu: with no CUDA device, DataParallel has no device_ids and forwards to
    the module itself (torch/nn/parallel/data_parallel.py)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU host: DataParallel has devices here")
    model = nn.Linear(3, 2)
    dp = nn.DataParallel(model)
    x = torch.randn(4, 3)
    assert dp.device_ids == [] and torch.equal(dp(x), model(x))


# --- lab 2: backends and timeouts -------------------------------------------------------------


def test_gloo_takes_cpu_and_cuda_tensors_nccl_only_cuda():
    """lab02 section 2: gloo is not CPU-only (Backend.backend_capability, in
    torch/distributed/distributed_c10d.py; its CUDA broadcast and all_reduce are in
    torch/csrc/distributed/c10d/ProcessGroupGloo.cpp), NCCL takes CUDA tensors only."""
    assert dist.Backend.backend_capability[dist.Backend.GLOO] == ["cpu", "cuda"]
    assert dist.Backend.backend_capability[dist.Backend.NCCL] == ["cuda"]
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"
    assert dist.Backend.default_device_backend_map["cuda"] == "nccl"


def test_default_collective_timeouts_are_30_minutes_gloo_and_10_nccl():
    """lab02 section 9, lab03 section 7: the process group's default timeout is 30 minutes,
    NCCL's 10 (torch/distributed/constants.py)."""
    from torch.distributed import constants

    assert constants.default_pg_timeout == datetime.timedelta(minutes=30)
    assert constants.default_pg_nccl_timeout == datetime.timedelta(minutes=10)


def test_init_process_group_refuses_a_timeout_in_seconds():
    """The seeds' box of lab02: init_process_group(timeout=1800) raises TypeError; the timeout
    is a datetime.timedelta (_check_valid_timeout in torch/distributed/distributed_c10d.py)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    with pytest.raises(TypeError, match="datetime.timedelta"):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=1800)
    assert not dist.is_initialized()


def test_torch_distributed_launch_is_deprecated_in_favour_of_torchrun():
    """The seeds' box of lab02: torch.distributed.launch's main() warns (FutureWarning) that
    the module is deprecated, names torchrun, and says to read LOCAL_RANK from the environment
    instead of --local-rank (torch/distributed/launch.py)."""
    from torch.distributed import launch

    with pytest.warns(FutureWarning, match="Use torchrun") as said, pytest.raises(SystemExit):
        launch.main(["--help"])
    assert "os.environ['LOCAL_RANK']" in str(said[0].message)


def test_torchrun_nproc_per_node_accepts_gpu():
    """lab03 'On real GPUs': torchrun --nproc_per_node=gpu starts one process per GPU
    (torch/distributed/run.py)."""
    source = (TORCH / "distributed" / "run.py").read_text()
    assert '``"gpu"`` (spawn one process per GPU)' in source


# --- lab 3: DDP --------------------------------------------------------------------------------


def test_ddp_buckets_are_25_mib_with_a_1_mib_first_bucket_by_default():
    """lab03 section 6: bucket_cap_mb defaults to None, which means 25 MiB buckets with the
    first bucket capped at dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB; an explicit
    bucket_cap_mb caps the first bucket the same as the others
    (_BucketCapacityConfig.create in torch/nn/parallel/distributed.py)."""
    from torch.nn.parallel import distributed as ddp_module

    assert inspect.signature(DDP).parameters["bucket_cap_mb"].default is None
    assert ddp_module._DEFAULT_BUCKET_CAP_MB == 25
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20
    default = ddp_module._BucketCapacityConfig.create(None, None, False)
    assert (default.first_bucket_bytes_cap, default.bucket_bytes_cap) == (2**20, 25 * 2**20)
    given = ddp_module._BucketCapacityConfig.create(25, None, False)
    assert given.first_bucket_bytes_cap == given.bucket_bytes_cap == 25 * 2**20


def _rebuilt_buckets(model: nn.Module, **kwargs) -> tuple[list[int], list[int]]:
    """DDP's bucket sizes (bytes) in its first step and once rebuilt (logged from the third
    step on): one-rank gloo."""
    wrapped = DDP(model, **kwargs)
    sizes = []
    for _ in range(3):
        wrapped(torch.randn(2, 256)).sum().backward()
        data = wrapped._get_ddp_logging_data()
        sizes.append([int(s) for s in str(data.get("rebuilt_bucket_sizes", "")).split(",") if s])
    first = [int(s) for s in str(data["bucket_sizes"]).split(",")]
    return first, sizes[-1]


def test_ddp_first_step_uses_one_bucket_then_rebuilds_with_a_1_mib_first(world_of_one):
    """lab03 section 6, measured: without find_unused_parameters DDP's first step puts every
    gradient in one bucket (sys.maxsize limits, compute_bucket_size_limits in
    torch/nn/parallel/distributed.py); after it, the buckets are rebuilt in the order the
    gradients became ready, the first closing at 1 MiB by default and at bucket_cap_mb when
    that is given."""
    torch.manual_seed(0)
    layer_bytes = (256 * 256 + 256) * 4  # 263168 bytes: four layers pass 1 MiB
    layers = 12
    first, rebuilt = _rebuilt_buckets(nn.Sequential(*[nn.Linear(256, 256) for _ in range(12)]))
    assert first == [layers * layer_bytes], "the first step: one bucket"
    assert rebuilt == [4 * layer_bytes, (layers - 4) * layer_bytes], "1 MiB first, then 25 MiB"
    _, explicit = _rebuilt_buckets(
        nn.Sequential(*[nn.Linear(256, 256) for _ in range(12)]), bucket_cap_mb=25
    )
    assert explicit == [layers * layer_bytes], "bucket_cap_mb=25 given: no small first bucket"


def test_ddp_forward_sync_buffers_replaces_broadcast_buffers_default_true(world_of_one):
    """lab03 section 1, lab04 section 4: DDP copies rank 0's buffers at every forward by
    default; since torch 2.13 the flag is forward_sync_buffers (None means True) and
    broadcast_buffers is deprecated, with a FutureWarning (torch/nn/parallel/distributed.py)."""
    params = inspect.signature(DDP).parameters
    assert params["forward_sync_buffers"].default is None
    assert params["broadcast_buffers"].default is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped = DDP(nn.BatchNorm1d(3))
    assert wrapped.forward_sync_buffers is True and wrapped.broadcast_buffers is True
    with pytest.warns(FutureWarning, match="broadcast_buffers` is deprecated"):
        DDP(nn.BatchNorm1d(3), broadcast_buffers=True)


def test_ddp_output_device_is_where_the_output_goes_and_cpu_modules_take_none():
    """The seeds' box of lab03: output_device is the 'device location of output' of a
    single-device CUDA module, device_ids[0] by default, and must be None for CPU modules;
    it does not say where gradients are reduced (torch/nn/parallel/distributed.py)."""
    doc = DDP.__doc__
    assert "output_device (int or torch.device): Device location of output" in doc
    assert "``device_ids[0]``" in doc
    source = inspect.getsource(DDP.__init__)
    assert "output_device = device_ids[0]" in source


def test_ddp_without_find_unused_parameters_fails_at_the_next_forward(world_of_one):
    """lab03 section 7 and its seeds' box: a parameter without a gradient makes the NEXT
    forward raise (not hang), and the message names find_unused_parameters
    (torch/nn/parallel/distributed.py, the reducer's check)."""

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 1), nn.Linear(3, 1)

        def forward(self, x, head):
            return (self.a if head == 0 else self.b)(x)

    wrapped = DDP(TwoHeads())
    wrapped(torch.randn(2, 3), 0).sum().backward()
    with pytest.raises(RuntimeError, match="find_unused_parameters=True"):
        wrapped(torch.randn(2, 3), 1).sum().backward()


def test_distributed_sampler_pads_from_its_own_beginning_or_drops_the_tail():
    """lab03 section 2 and ex1: DistributedSampler seeds its permutation with seed + epoch,
    pads with the order's own first indices (repeated as often as needed) or, with
    drop_last, drops the tail, and deals the order out rank after rank
    (torch/utils/data/distributed.py)."""
    data = list(range(10))

    def shards(world, **kw):
        return [list(DistributedSampler(data, world, r, **kw)) for r in range(world)]

    assert shards(4, shuffle=False) == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    assert shards(4, shuffle=False, drop_last=True) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shards(3, shuffle=False, drop_last=False)[0] == [0, 3, 6, 9]
    one = [list(DistributedSampler([0], 3, r, shuffle=False)) for r in range(3)]
    assert one == [[0], [0], [0]], "one sample on 3 ranks: repeated for everyone"
    sampler = DistributedSampler(data, 2, 0, shuffle=True, seed=5)
    sampler.set_epoch(3)
    order = torch.randperm(10, generator=torch.Generator().manual_seed(5 + 3)).tolist()
    assert list(sampler) == order[0::2]
    assert len(DistributedSampler(list(range(11)), 4, 0, drop_last=True)) == math.floor(11 / 4)


# --- lab 4: SyncBatchNorm ----------------------------------------------------------------------


def test_syncbatchnorm_refuses_cpu_tensors_in_a_process_group(world_of_one):
    """lab04 section 5: in training, inside a process group, nn.SyncBatchNorm raises
    ValueError on a CPU tensor (accelerators only); outside one it runs plain BatchNorm
    (torch/nn/modules/batchnorm.py)."""
    with pytest.raises(ValueError, match="expected input tensor to be on GPU"):
        nn.SyncBatchNorm(3)(torch.randn(4, 3))


def test_syncbatchnorm_all_gathers_mean_invstd_and_count_and_weights_by_count():
    """lab04 section 5 and its seeds' box: SyncBatchNorm does not average the ranks'
    statistics; it all-gathers each rank's mean, invstd and count (zeros for an empty
    rank) and combines them weighted by the counts (torch/nn/modules/_functions.py; the
    combining kernel has no CPU implementation)."""
    source = (TORCH / "nn" / "modules" / "_functions.py").read_text()
    assert "torch.cat([mean, invstd, count], dim=0)" in source
    assert "Use allgather instead of allreduce because count could be different" in source
    assert "torch.batch_norm_gather_stats_with_counts" in source


# ===============================================================================================
# Lab 5: number formats, autocast, GradScaler, clipping, no_sync
# ===============================================================================================


LAB05_NOTEBOOK = ROOT / "solutions" / "lab05_amp_accumulation" / "lab05_amp_accumulation.ipynb"


def _lab05_cell(cell_id: str) -> str:
    cells = json.loads(LAB05_NOTEBOOK.read_text())["cells"]
    src = next(c for c in cells if c["id"] == cell_id)["source"]
    return "".join(src) if isinstance(src, list) else src


def _cast(value: float, dtype: torch.dtype) -> float:
    """``value`` as a float32 tensor, cast to ``dtype``, back as a Python float."""
    return float(torch.tensor(value, dtype=torch.float32).to(dtype).float())


def _subnormal(dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


# --- number formats (c10/util/BFloat16.h, Half.h; torch.finfo) --------------------------------


def test_the_notebooks_format_table_matches_torch_finfo():
    """Section 1's table (largest, smallest normal, smallest subnormal, relative precision)
    equals ``torch.finfo`` to the two digits it prints."""
    rows = {}
    for line in _lab05_cell("formats_md").splitlines():
        cols = [c.strip() for c in line.strip("|").split("|")]
        if cols and cols[0] in ("float32", "bfloat16", "float16"):
            rows[cols[0]] = cols
    assert set(rows) == {"float32", "bfloat16", "float16"}
    for name, cols in rows.items():
        dtype = getattr(torch, name)
        info = torch.finfo(dtype)
        bits = [int(b) for b in re.findall(r"\d+", cols[1])]
        assert bits == [1, info.bits - 1 - _mantissa_bits(dtype), _mantissa_bits(dtype)]
        for text, value in zip(
            cols[2:6], (info.max, info.smallest_normal, _subnormal(dtype), info.eps), strict=True
        ):
            assert float(text) == pytest.approx(value, rel=0.05), (name, text, value)


def _mantissa_bits(dtype: torch.dtype) -> int:
    return round(-math.log2(torch.finfo(dtype).eps))


def test_bfloat16_has_float32s_normal_range_but_not_its_subnormals():
    """bfloat16 keeps float32's 8 exponent bits: the same largest and smallest normal number.
    Its subnormals stop at 2**-133 (about 9.2e-41), float32's at 2**-149 (about 1.4e-45): a
    float32 value at or below 2**-134 becomes 0 in bfloat16 (the lab's corrected claim;
    "what float32 holds never underflows in bf16" was wrong)."""
    f32, bf16 = torch.finfo(torch.float32), torch.finfo(torch.bfloat16)
    assert bf16.max == pytest.approx(f32.max, rel=2**-7) and bf16.smallest_normal == 2.0**-126
    assert f32.smallest_normal == 2.0**-126
    assert _subnormal(torch.bfloat16) == 2.0**-133 and _subnormal(torch.float32) == 2.0**-149
    assert _cast(2.0**-149, torch.float32) == 2.0**-149, "float32 holds its smallest subnormal"
    assert _cast(2.0**-134, torch.bfloat16) == 0.0, "half of bf16's smallest subnormal: 0"
    assert _cast(2.0**-140, torch.bfloat16) == 0.0
    assert _cast(2.0**-133, torch.bfloat16) == 2.0**-133
    assert _cast(1.5 * 2.0**-134, torch.bfloat16) == 2.0**-133, "above half: rounds up"
    assert _cast(2.0**-126, torch.bfloat16) == 2.0**-126, "normal numbers: the same range"


def test_float16_rounds_to_zero_at_half_its_smallest_subnormal_and_to_inf_from_65520():
    """float16: max 65504, smallest normal 2**-14, smallest subnormal 2**-24. Round to
    nearest, ties to even: 2**-25 (a tie) becomes 0, anything above it 2**-24; 65520 (max
    plus half the top spacing of 32) becomes inf, the float32 number just below it 65504."""
    info = torch.finfo(torch.float16)
    assert (info.max, info.smallest_normal, _subnormal(torch.float16)) == (
        65504.0,
        2.0**-14,
        2.0**-24,
    )
    below = float(torch.nextafter(torch.tensor(65520.0), torch.tensor(0.0)))
    assert _cast(below, torch.float16) == 65504.0
    assert math.isinf(_cast(65520.0, torch.float16))
    assert _cast(2.0**-25, torch.float16) == 0.0
    assert _cast(2.0**-25 * (1 + 2.0**-20), torch.float16) == 2.0**-24


def test_a_power_of_two_scale_above_2_127_is_inf_in_float32_but_not_in_float64():
    """Why ex1's scale search runs in float64: a float32 tensor times ``2.0**128`` is inf
    (the Python scalar becomes a float32 inf), so a search in float32 stops at 2**127, wrong
    when the largest gradient is below 65520 * 2**-128 (about 1.9e-34)."""
    tiny = torch.tensor(1e-36, dtype=torch.float32)
    assert torch.isinf(tiny * 2.0**128) and not torch.isinf(tiny * 2.0**127)
    assert torch.isfinite(tiny.double() * 2.0**128)
    assert 65520 * 2.0**-128 == pytest.approx(1.925e-34, rel=1e-3)
    assert not torch.isinf((tiny.double() * 2.0**130).half()), "the true scale is above 2**127"


def test_a_power_of_two_scale_changes_the_exponent_only():
    """A loss scale 2**k leaves the mantissa as it is: bfloat16's rounding error is the same
    at every scale (why a scaler cannot buy bfloat16 precision)."""
    x = torch.randn(1000, dtype=torch.float32)
    for k in (-20, 7, 40):
        scaled = (x * 2.0**k).to(torch.bfloat16).float() / 2.0**k
        assert torch.equal(scaled, x.to(torch.bfloat16).float())


# --- autocast (torch/testing/_internal/autocast_test_lists.py) -------------------------------


def test_cpu_autocast_runs_matmuls_in_16_bits_losses_in_float32_softmax_as_its_input():
    """On the CPU, matrix products and convolutions run in the autocast dtype, the losses
    (cross_entropy, mse_loss) in float32, while softmax, layer_norm and sums keep their
    input's dtype (not on CPU autocast's float32 list)."""
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    img, kernel = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            h = x @ w
            assert h.dtype == dtype and F.linear(x, w).dtype == dtype
            assert F.conv2d(img, kernel).dtype == dtype
            assert torch.softmax(h, -1).dtype == dtype and h.sum().dtype == dtype
            assert F.layer_norm(h, (8,)).dtype == dtype
            assert F.cross_entropy(h, torch.zeros(4, dtype=torch.long)).dtype == torch.float32
            assert F.mse_loss(h, torch.zeros(4, 8)).dtype == torch.float32
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert torch.get_autocast_dtype("cuda") == torch.float16


def _fp32_list(cls: str) -> set[str]:
    """The op names of ``cls``'s ``torch_fp32`` list in autocast_test_lists.py (parsed, not
    imported: the module needs ``expecttest``)."""
    tree = ast.parse((TORCH / "testing" / "_internal" / "autocast_test_lists.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    for stmt in ast.walk(node):
        if (
            isinstance(stmt, ast.Assign)
            and isinstance(stmt.targets[0], ast.Attribute)
            and stmt.targets[0].attr == "torch_fp32"
        ):
            return {e.elts[0].value for e in stmt.value.elts if isinstance(e, ast.Tuple)}
    raise AssertionError(f"no torch_fp32 list in {cls}")


def test_cuda_autocast_keeps_softmax_norms_and_sums_in_float32_and_the_cpu_does_not():
    """The lab's sentence on the float32 list: CUDA's holds softmax, log_softmax, layer_norm,
    group_norm, norm and sum; the CPU's none of them (mostly losses)."""
    cuda, cpu = _fp32_list("AutocastTestLists"), _fp32_list("AutocastCPUTestLists")
    wanted = {"softmax", "log_softmax", "layer_norm", "group_norm", "norm", "sum"}
    assert wanted <= cuda
    assert not wanted & cpu and {"poisson_nll_loss", "triplet_margin_loss"} <= cpu


def _attention_inputs(score: float, d: int = 32, seq: int = 8):
    """q and k whose largest scaled score ``q . k / sqrt(d)`` is ``score`` (one pair)."""
    q, k, v = torch.zeros(1, 1, seq, d), torch.zeros(1, 1, seq, d), torch.randn(1, 1, seq, d)
    q[..., 0] = k[..., 0] = math.sqrt(score * math.sqrt(d))  # q . k = score * sqrt(d)
    return q, k, v


def test_fp16_attention_written_out_overflows_in_the_unscaled_product():
    """Lab 5, section 7: under CPU float16 autocast ``q @ k.T`` returns float16, so a product
    above 65504 is inf before the ``1 / sqrt(d)`` and the softmax row becomes NaN, although
    the scaled score (a sqrt(d) times smaller) would fit; bfloat16 keeps it finite."""
    assert torch.finfo(torch.float16).max == 65504.0
    q, k, _ = _attention_inputs(2e4)  # product 1.13e5 > 65504 > score 2e4
    for dtype, finite in ((torch.float16, False), (torch.bfloat16, True)):
        with torch.autocast("cpu", dtype=dtype):
            raw = q @ k.transpose(-2, -1)
            weights = torch.softmax(raw * (1 / math.sqrt(32)), dim=-1)
        assert raw.dtype == dtype and bool(raw.isfinite().all()) is finite
        assert bool(weights.isfinite().all()) is finite
    assert float((q @ k.transpose(-2, -1)).max()) / math.sqrt(32) == pytest.approx(2e4)


def test_fused_attention_in_float16_on_the_cpu_stays_finite_past_65504():
    """Lab 5, section 7: F.scaled_dot_product_attention on float16 CPU tensors, with its math
    and its flash kernel, returns finite float16 output for scores of 2.6e5 (it does not
    hold the scores in float16), where the written-out form is NaN."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.half() for t in _attention_inputs(2.6e5))
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert out.dtype == torch.float16 and bool(out.isfinite().all()), backend
    written = torch.softmax((q @ k.transpose(-2, -1)) * (1 / math.sqrt(32)), -1)
    assert not bool(written.isfinite().all())


# --- GradScaler (torch/amp/grad_scaler.py) ---------------------------------------------------


def test_grad_scaler_defaults_are_2_16_growth_2_backoff_half_interval_2000():
    params = inspect.signature(torch.amp.GradScaler.__init__).parameters
    got = {k: params[k].default for k in ("init_scale", "growth_factor", "backoff_factor")}
    assert got == {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5}
    assert params["growth_interval"].default == 2000 and params["device"].default == "cuda"


def _scaler_step(scaler, inf: bool) -> float:
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(p.sum()).backward()
    if inf:
        p.grad[0] = math.inf
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale()


def test_grad_scaler_grows_after_interval_good_steps_and_backs_off_restarting_the_count():
    """Section 2's rules: ``S *= growth_factor`` after ``growth_interval`` good steps in a row,
    ``S *= backoff_factor`` after a skipped one, and the count restarts there."""
    s = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
    assert [_scaler_step(s, inf) for inf in (False, False, False)] == [8.0, 8.0, 16.0]
    assert [_scaler_step(s, inf) for inf in (False, False, True)] == [16.0, 16.0, 8.0]
    assert [_scaler_step(s, inf) for inf in (False, False, False)] == [8.0, 8.0, 16.0]


def test_grad_scaler_skips_an_inf_step_and_unscale_twice_raises():
    s = torch.amp.GradScaler("cpu", init_scale=4.0)
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    s.scale(p.sum()).backward()
    assert torch.equal(p.grad, torch.full((2,), 4.0)), "scale(loss).backward(): S x g"
    p.grad[1] = math.nan
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        s.unscale_(opt)
    s.step(opt)
    assert torch.equal(p.detach(), torch.ones(2)), "a NaN step is skipped"


def test_autocast_keeps_float32_grads_and_unscale_refuses_float16_ones():
    """Section 4: under ``torch.autocast`` the parameters and their ``.grad`` stay float32
    (the float16 copies are not leaves); ``unscale_`` refuses float16 gradients."""
    layer = nn.Linear(4, 3)
    with torch.autocast("cpu", dtype=torch.float16):
        out = layer(torch.randn(2, 4))
    assert out.dtype == torch.float16
    out.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32
    half = nn.Parameter(torch.ones(2, dtype=torch.float16))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(half.float().sum()).backward()
    assert half.grad.dtype == torch.float16
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(torch.optim.SGD([half], lr=1.0))


def test_a_disabled_grad_scaler_passes_the_loss_through_and_steps_plainly():
    """A disabled scaler (bfloat16): ``scale`` returns the loss itself, ``unscale_`` and
    ``update`` do nothing, ``step`` is ``optimizer.step()``, the scale reads 1.0."""
    s = torch.amp.GradScaler("cpu", enabled=False)
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    loss = p.sum()
    assert s.scale(loss) is loss
    loss.backward()
    s.unscale_(opt)
    assert torch.equal(p.grad, torch.ones(2))
    s.step(opt)
    s.update()
    assert torch.equal(p.detach(), torch.zeros(2)) and s.get_scale() == 1.0


def test_torch_cuda_amp_is_deprecated():
    """The seed's ``torch.cuda.amp``: ``autocast`` and ``GradScaler`` there warn
    (torch/cuda/amp/autocast_mode.py, torch/cuda/amp/grad_scaler.py)."""
    for make in (torch.cuda.amp.autocast, torch.cuda.amp.GradScaler):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make()
        assert any(issubclass(w.category, FutureWarning) for w in caught), make


# --- clipping (torch/nn/utils/clip_grad.py) ---------------------------------------------------


@pytest.mark.parametrize("norm", [0.5, 0.999, 1.001, 9.9, 10.1, 1e4])
def test_clip_grad_norm_returns_the_norm_before_and_scales_by_min_1_max_over_norm(norm):
    """``clip_grad_norm_`` multiplies by ``min(1, max_norm / (||g|| + 1e-6))`` and returns
    ``||g||``: continuous in the norm, unlike the seed's "clip to 1.0 above 10"."""
    p = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    g = torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.float64)
    p.grad = g / g.norm() * norm
    got = torch.nn.utils.clip_grad_norm_([p], max_norm=1.0)
    assert float(got) == pytest.approx(norm, rel=1e-12)
    factor = min(1.0, 1.0 / (norm + 1e-6))
    assert float(p.grad.norm()) == pytest.approx(norm * factor, rel=1e-12)
    assert float(p.grad.norm()) <= 1.0 + 1e-12


def test_clipping_scaled_gradients_shrinks_the_step_by_the_scale():
    """Clipping ``S g`` to ``max_norm`` and then dividing by ``S`` leaves ``g max_norm /
    (S ||g||)``: ``1 / S`` of the right clipped gradient (the lab's written answer)."""
    scale, g = 2.0**16, torch.tensor([3.0, 4.0], dtype=torch.float64)  # ||g|| = 5
    p = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    p.grad = g * scale
    reported = torch.nn.utils.clip_grad_norm_([p], 1.0)
    assert float(reported) == pytest.approx(5 * scale)
    wrong, right = p.grad / scale, g / 5
    assert torch.allclose(wrong * scale, right, rtol=1e-6)


def test_no_sync_is_decided_by_the_forward_pass_and_the_next_sync_sends_everything(world_of_one):
    """Section 3: a backward all-reduces unless its *forward* ran inside ``no_sync()``
    (DDP's docstring warns the forward must be inside); what accumulated locally is in
    ``.grad`` when the next synchronised backward all-reduces. The notebook's demo model
    (256 -> 512 -> 10, about 0.55 MB of float32 gradients) fits DDP's first bucket (1 MiB
    by default, ``dist._DEFAULT_FIRST_BUCKET_BYTES``): one all-reduce per synced backward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)))
    calls, sent = [0], []

    def hook(state, bucket):
        calls[0] += 1
        sent.append(bucket.buffer().clone())
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    model.register_comm_hook(None, hook)
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 1024 * 1024
    assert sum(p.numel() * 4 for p in model.parameters()) < dist._DEFAULT_FIRST_BUCKET_BYTES
    x, y = torch.randn(4, 256), torch.zeros(4, dtype=torch.long)

    def backward(out):
        F.cross_entropy(out, y).backward()

    backward(model(x))
    assert calls == [1]
    with model.no_sync():
        backward(model(x))
    assert calls == [1], "forward and backward inside: nothing sent"
    out = model(x)
    with model.no_sync():
        backward(out)
    assert calls == [2], "a forward outside no_sync synchronises its backward anyway"
    model.zero_grad(set_to_none=True)
    with model.no_sync():
        out = model(x)
    backward(out)
    assert calls == [2], "a forward inside no_sync: its backward stays local"
    backward(model(x))
    assert calls == [3]
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    # (DDP rebuilds its bucket after the first iteration, in the order gradients arrive:
    # compare the values, not their positions)
    last, first = sent[-1].sort().values, sent[0].sort().values
    assert torch.allclose(last, 2 * first, rtol=1e-5, atol=1e-7), "both passes' sum"
    assert torch.allclose(sent[-1].sum(), grads.sum(), rtol=1e-4)


# ===============================================================================================
# Lab 6: timeouts, torchrun, checkpoints
# ===============================================================================================


NCCL_HEADER = TORCH / "include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp"


# --- timeouts: the process group's, NCCL's watchdog and its heartbeat monitor -----------------


def test_default_process_group_timeouts_are_30_minutes_and_10_with_nccl():
    """torch/distributed/constants.py: default_pg_timeout (gloo and the others) and
    default_pg_nccl_timeout (NCCL's, from the C++ layer)."""
    from torch.distributed import constants

    assert constants.default_pg_timeout == datetime.timedelta(minutes=30)
    if constants.default_pg_nccl_timeout is None:
        pytest.skip("torch built without NCCL")
    assert constants.default_pg_nccl_timeout == datetime.timedelta(minutes=10)


def test_the_heartbeat_monitor_is_a_separate_check_of_the_watchdog_thread():
    """include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp: the monitoring thread
    aborts the process when the watchdog thread is stuck with no heartbeat for
    TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (its default, 8 minutes, is in ProcessGroupNCCL.cpp's
    HeartbeatMonitor, not installed), switched by TORCH_NCCL_ENABLE_MONITORING."""
    if not NCCL_HEADER.is_file():
        pytest.skip("torch installed without its C++ headers")
    text = NCCL_HEADER.read_text()
    assert '"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"' in text
    assert '"TORCH_NCCL_ENABLE_MONITORING"' in text
    assert "Watchdog thread gets stuck and no heartbeat is detected" in text
    together = "must be set together with\n// TORCH_NCCL_ENABLE_MONITORING=1 and"
    assert f"{together} TORCH_NCCL_TRACE_BUFFER_SIZE > 0" in text


def test_async_error_handling_defaults_to_skip_clean_up():
    """ProcessGroupNCCL.hpp: TORCH_NCCL_ASYNC_ERROR_HANDLING's default is 3 (SkipCleanUp):
    a timed-out collective ends the process."""
    if not NCCL_HEADER.is_file():
        pytest.skip("torch installed without its C++ headers")
    assert "the default value (3 - SkipCleanUp)" in NCCL_HEADER.read_text()


def test_init_process_group_wants_a_timedelta_not_seconds():
    """torch/distributed/distributed_c10d.py: _check_valid_timeout (the seeds' timeout=1800
    raises TypeError)."""
    from torch.distributed.distributed_c10d import _check_valid_timeout

    with pytest.raises(TypeError, match="datetime.timedelta"):
        _check_valid_timeout(1800)
    _check_valid_timeout(datetime.timedelta(seconds=1800))


def test_is_initialized_is_only_whether_a_default_group_exists():
    """torch/distributed/distributed_c10d.py: is_initialized returns
    ``GroupMember.WORLD is not None``: no health check (the seeds' monitor)."""
    source = inspect.getsource(dist.is_initialized)
    assert "GroupMember.WORLD is not None" in source
    assert "store" not in source.split('"""')[-1] and "barrier" not in source


# --- torchrun -----------------------------------------------------------------------------------


def test_torchrun_restarts_nothing_by_default_and_polls_every_tenth_of_a_second():
    """torch/distributed/run.py: --max-restarts defaults to 0, --monitor-interval to 0.1 s
    (torch/distributed/launcher/api.py's LaunchConfig, the Python API, defaults to 3)."""
    from torch.distributed.launcher.api import LaunchConfig
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(["train.py"])
    assert args.max_restarts == 0
    assert args.monitor_interval == pytest.approx(0.1)
    assert LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1).max_restarts == 3


# --- torch.distributed.checkpoint (torch/distributed/checkpoint/state_dict_saver.py) -----------


def test_dcp_async_save_writes_in_a_thread_by_default_and_returns_a_future():
    """Lab 6, section 7: ``async_save`` returns once the state is staged and writes in a
    background thread (``AsyncCheckpointerType.THREAD``, its default); the caller waits on
    the returned future before the next save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    default = inspect.signature(dcp.async_save).parameters["async_checkpointer_type"].default
    assert default is AsyncCheckpointerType.THREAD
    doc = " ".join((dcp.async_save.__doc__ or "").split())
    assert "Future" in doc


# --- torch.save / torch.load --------------------------------------------------------------------


def test_torch_load_defaults_to_weights_only():
    """torch/serialization.py: _default_to_weights_only (True when no pickle_module is
    given, since 2.6): a pickled object that is not a tensor, a container or an allowed
    type is refused."""
    from torch.serialization import _default_to_weights_only

    assert _default_to_weights_only(None) is True
    buf = io.BytesIO()
    torch.save({"f": datetime.datetime(2026, 1, 1)}, buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(buf)


class _Unpicklable:
    def __reduce_ex__(self, protocol):
        raise RuntimeError("crash while writing")


def test_torch_save_in_place_destroys_the_previous_file_when_it_fails(tmp_path):
    """torch/serialization.py: torch.save opens the path for writing (truncating it) before
    it serialises, so a save that raises leaves no loadable checkpoint (section 2)."""
    path = tmp_path / "ckpt.pt"
    torch.save({"step": 100}, path)
    with pytest.raises(RuntimeError, match="crash while writing"):
        torch.save({"step": 200, "oops": _Unpicklable()}, path)
    with pytest.raises(Exception):  # noqa: B017 - whichever error: the old one is gone
        torch.load(path, weights_only=True)


def test_torch_load_does_not_notice_a_flipped_byte_inside_a_tensor(tmp_path):
    """torch/serialization.py: the zip format checks no checksum of tensor data."""
    path = tmp_path / "flipped.pt"
    torch.save({"w": torch.ones(10_000)}, path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    w = torch.load(path, weights_only=True)["w"]
    assert int((w != 1).sum()) == 1


def test_load_without_map_location_restores_the_saved_device():
    """torch/serialization.py: default_restore_location puts a storage on the device it was
    saved from; on a machine without CUDA a cuda:0 storage raises."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    storage = torch.UntypedStorage(4)
    with pytest.raises(RuntimeError, match="map_location=torch.device\\('cpu'\\)"):
        torch.serialization.default_restore_location(storage, "cuda:0")


def test_optimizer_load_state_dict_moves_the_state_to_each_parameter_device():
    """torch/optim/optimizer.py: _process_value_according_to_param_policy casts each state
    tensor to its parameter's device (and floating dtype)."""
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3, dtype=torch.float64)
    opt.step()
    state = opt.state_dict()
    state["state"][0]["momentum_buffer"] = state["state"][0]["momentum_buffer"].float()
    fresh = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    fresh.load_state_dict(state)
    assert fresh.state[p]["momentum_buffer"].dtype == torch.float64


# --- the trap of exercise 2 and the seeds' OOM remedy -------------------------------------------


def test_iter_of_a_dataloader_draws_from_the_global_generator_even_without_workers():
    """torch/utils/data/dataloader.py: _BaseDataLoaderIter draws its base seed with
    loader._get_shared_seed / torch.empty((), dtype=torch.int64).random_()."""
    loader = DataLoader(list(range(10)), batch_size=4, num_workers=0)
    before = torch.get_rng_state()
    iter(loader)
    assert not torch.equal(before, torch.get_rng_state())


def test_empty_cache_does_not_give_pytorch_more_memory():
    """torch/cuda/memory.py: empty_cache's docstring says it "doesn't increase the amount
    of GPU memory available for PyTorch" (it releases unused cached blocks)."""
    doc = " ".join(torch.cuda.empty_cache.__doc__.split())
    assert "doesn't increase the amount of GPU memory available for PyTorch" in doc


# --- what the lab says about torchrun's workers, the sampler and DETAIL ------------------------


def test_restarted_workers_learn_the_attempt_from_torchelastic_restart_count():
    """torch/distributed/elastic/agent/server/local_elastic_agent.py: every worker's
    environment holds TORCHELASTIC_RESTART_COUNT (section 4)."""
    from torch.distributed.elastic.agent.server import local_elastic_agent

    source = inspect.getsource(local_elastic_agent)
    assert '"TORCHELASTIC_RESTART_COUNT": str(restart_count)' in source


def test_distributed_sampler_shuffles_with_seed_plus_epoch():
    """torch/utils/data/distributed.py: __iter__ seeds its generator with seed + epoch."""
    from torch.utils.data import DistributedSampler

    data = list(range(17))
    a = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=5)
    b = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=3)
    a.set_epoch(1)
    b.set_epoch(3)
    assert list(a) == list(b)


def test_detail_wraps_every_process_group_in_a_checking_wrapper():
    """torch/distributed/distributed_c10d.py: with TORCH_DISTRIBUTED_DEBUG=DETAIL (and gloo
    available) each new group's backend is wrapped by _create_process_group_wrapper, which
    compares the collectives' fingerprints across ranks before running each one."""
    from torch.distributed import distributed_c10d

    source = inspect.getsource(distributed_c10d._new_process_group_helper)
    detail = source.index("if get_debug_level() == DebugLevel.DETAIL:")
    assert "_create_process_group_wrapper(" in source[detail : detail + 900]


# ===============================================================================================
# Lab 7: FSDP2, ZeRO, the 16 bytes, hybrid layouts, pipelines
# ===============================================================================================


LAB07_NOTEBOOK = Path(__file__).parents[1] / "solutions/lab07_beyond_ddp/lab07_beyond_ddp.ipynb"


def _lab_text(notebook: Path = LAB07_NOTEBOOK) -> str:
    cells = json.loads(notebook.read_text())["cells"]
    return "\n".join(
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells
    )


LAB09_NOTEBOOK = LAB07_NOTEBOOK.parents[1] / "lab09_fsdp_dtensor/lab09_fsdp_dtensor.ipynb"


@contextmanager
def _fake_world(rank: int, world: int):
    """This process as rank ``rank`` of a fake group of ``world`` (no communication)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mlp() -> nn.Sequential:
    """The MLP ``ddp_lab.parallel.compare`` trains in section 3 (85,002 parameters)."""
    return compare.build(256, 3)


# --- FSDP2's shards ------------------------------------------------------------------------


def test_fsdp2_cuts_each_parameter_by_rows_with_torch_chunk_4_4_2_on_3_ranks():
    """``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``: ``_chunk_with_empty`` is
    ``torch.chunk`` plus empty chunks; ``_fsdp_param.py`` shards with it. 10 rows on 3
    ranks: 4, 4, 2 (not ``tensor_split``'s 4, 3, 3); 2 rows on 3 ranks: 1, 1, 0."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common, _fsdp_param

    chunk = _fsdp_common._chunk_with_empty
    assert [c.shape[0] for c in chunk(torch.empty(10, 256), 3, 0)] == [4, 4, 2]
    assert [c.shape[0] for c in chunk(torch.empty(2, 4), 3, 0)] == [1, 1, 0]
    assert [len(t) for t in torch.tensor_split(torch.arange(10), 3)] == [4, 3, 3]
    assert "_chunk_with_empty(param_data, shard_world_size, dim=shard_dim)" in inspect.getsource(
        _fsdp_param
    )
    assert "4, 4 and 2 rows" in _lab_text()


def test_fully_shard_gives_each_of_3_ranks_the_written_answers_shares_of_the_mlp():
    """``fully_shard`` itself on the section-3 MLP over 3 ranks: local shards of 28,720,
    28,720 and 27,562 numbers (rank 2's storage padded to rank 0's size), against the flat
    ZeRO-3 chunks of 28,334 (exercise 1's reference)."""
    from torch.distributed.fsdp import fully_shard

    local, stored = [], []
    for rank in range(3):
        with _fake_world(rank, 3):
            model = _mlp()
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
            shards = [p.to_local() for p in model.parameters()]
            local.append(sum(s.numel() for s in shards))
            stored.append(sum(s.untyped_storage().nbytes() // 4 for s in shards))
    assert local == [28_720, 28_720, 27_562] and sum(local) == 85_002
    assert stored == [28_720] * 3
    flat = lab07_ref.memory_per_rank([p.numel() for p in _mlp().parameters()], 4, 3, 3)
    assert [r["params"] // 4 for r in flat] == [28_334] * 3
    text = _lab_text()
    for number in ("28,720", "27,562", "28,334", "459,520", "440,992", "453,344"):
        assert number in text
    assert local[0] * 16 == 459_520 and local[2] * 16 == 440_992 and 28_334 * 16 == 453_344


def test_fsdp2_moments_are_unpadded_and_a_units_gradients_share_one_padded_buffer():
    """Lab 9, section 1: AdamW's moments are ``torch.zeros_like`` of the rank's rows
    (``torch/optim/adam.py``), not padded; the gradients of one unit are views of one buffer,
    the reduce-scatter's output, padded to the first chunk's rows of every parameter."""
    from torch.distributed.fsdp import fully_shard
    from torch.optim import adam

    assert "torch.zeros_like(" in inspect.getsource(adam.Adam._init_group)
    with _fake_world(2, 3):
        model = nn.Sequential(nn.Linear(4, 10), nn.Linear(10, 2))
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        rows = [p.to_local().shape[0] for p in model.parameters()]
        grads = {p.grad.to_local().untyped_storage().nbytes() for p in model.parameters()}
        moments = [optimizer.state[p]["exp_avg"].to_local().numel() for p in model.parameters()]
    assert rows == [2, 2, 0, 0], "rank 2 of 3: 10 rows fall 4, 4, 2; 2 rows 1, 1, 0"
    assert grads == {(4 * 4 + 4 + 1 * 10 + 1) * 4}, "one buffer, every parameter padded"
    assert moments == [8, 2, 0, 0]


def test_fsdp2_gathers_the_root_once_and_each_block_twice_a_step():
    """Lab 9, section 2 and exercise 2: a GPT of L blocks, each an FSDP unit and the model
    too, calls 2 L + 1 all-gathers and L + 1 reduce-scatters in a forward and backward pass
    (the root unit is not resharded after its forward: ``_fsdp_state.py`` sets the root's
    ``post_forward_mesh_info`` to None); the model alone as one unit, 1 and 1."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_state
    from torch.distributed.tensor.debug import CommDebugMode

    from ddp_lab.checks.lab09.common import collectives
    from ddp_lab.gpt import GPT, GPTConfig

    assert "post_forward_mesh_info = None" in inspect.getsource(_fsdp_state)

    def counts(layers: int, per_block: bool) -> dict:
        with _fake_world(0, 2):
            model = GPT(GPTConfig(seq_len=8, width=16, heads=2, layers=layers))
            if per_block:
                for block in model.blocks:
                    fully_shard(block)
            fully_shard(model)
            tokens = torch.randint(0, 256, (2, 8))
            with CommDebugMode() as mode:
                model(tokens).sum().backward()
            return collectives(mode)

    for layers in (1, 3):
        assert counts(layers, True) == {"all_gather": 2 * layers + 1, "reduce_scatter": layers + 1}
    assert counts(3, False) == {"all_gather": 1, "reduce_scatter": 1}


def test_torch_zero1_gives_the_256x256_weight_to_one_rank_77_percent_3_4_times():
    """``torch/distributed/optim/zero_redundancy_optimizer.py``, ``_partition_parameters``:
    largest parameter first, to the rank with the fewest numbers so far. On 2 ranks the
    section-3 MLP splits 65,536 / 19,466 numbers."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    with _fake_world(0, 2), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _mlp()
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
        owned = [
            sum(p.numel() for g in r for p in g["params"]) for r in opt._partition_parameters()
        ]
    assert owned == [65_536, 19_466]
    assert round(100 * owned[0] / sum(owned)) == 77 and round(owned[0] / owned[1], 1) == 3.4
    assert "77 %" in _lab_text() and "3.4 times" in _lab_text()


# --- communication ---------------------------------------------------------------------------


def _fsdp_collectives(reshard: bool) -> dict[str, int]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    with _fake_world(0, 3), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
        for layer in (model[0], model[2]):
            fully_shard(layer, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        with CommDebugMode() as comm:
            model(torch.randn(2, 8)).sum().backward()
        return {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}


def test_fsdp2_moves_two_all_gathers_and_one_reduce_scatter_per_layer_1_5_times_ddp():
    """One FSDP2 step of 2 sharded layers calls 4 all-gathers (before forward, again before
    backward) and 2 reduce-scatters: ``3 (n - 1) / n * S`` with ring collectives, against
    DDP's all-reduce ``2 (n - 1) / n * S``: 1.5 times (``hybrid.plan`` counts the same);
    ``reshard_after_forward=False`` drops the second all-gather (DDP's bytes)."""
    assert _fsdp_collectives(True) == {"_allgather_base_": 4, "_reduce_scatter_base_": 2}
    assert _fsdp_collectives(False) == {"_allgather_base_": 2, "_reduce_scatter_base_": 2}
    kw = dict(layers=8, hidden=64, seq=16, global_batch=32, dp=4, tp=1, pp=1, micro_batches=1)
    ddp = hybrid.plan(**kw, memory_fn=lab07_ref.memory_per_rank, zero_stage=0)["comm"]["data"]
    zero1 = hybrid.plan(**kw, memory_fn=lab07_ref.memory_per_rank, zero_stage=1)["comm"]["data"]
    zero3 = hybrid.plan(**kw, memory_fn=lab07_ref.memory_per_rank, zero_stage=3)["comm"]["data"]
    s = 12 * 64 * 64 * 8 * 2  # bytes of the bf16 gradients
    assert ddp == zero1 == pytest.approx(2 * 3 / 4 * s)
    assert zero3 == pytest.approx(3 * 3 / 4 * s) and zero3 / ddp == pytest.approx(1.5)
    text = _lab_text()
    assert "1.5 times" in text and "a third more communication" not in text


def test_fully_shard_reshards_after_forward_except_for_the_root_by_default():
    """``torch/distributed/fsdp/_fully_shard/_fully_shard.py``: ``reshard_after_forward``
    defaults to None, "True for non-root modules and False for root modules"."""
    from torch.distributed.fsdp import fully_shard

    impl = inspect.unwrap(fully_shard)
    assert inspect.signature(impl).parameters["reshard_after_forward"].default is None
    doc = " ".join((fully_shard.__doc__ or impl.__doc__ or "").split())
    assert "set to ``True`` for non-root modules and ``False`` for root modules" in doc


# --- the 16 bytes ------------------------------------------------------------------------------


def test_mixed_precision_adamw_holds_16_bytes_per_parameter_12_of_them_optimizer_state():
    """The ZeRO paper's accounting, measured: bf16 parameter and gradient (2 + 2), a float32
    master copy and torch.optim.AdamW's two float32 moments (12); ``hybrid.plan`` counts the
    same; plain float32 AdamW is 4 + 4 + 8."""
    master = nn.Parameter(torch.randn(1000))
    opt = torch.optim.AdamW([master])
    master.grad = torch.randn(1000)
    opt.step()
    state = sum(t.numel() * t.element_size() for k, t in opt.state[master].items() if k != "step")
    low = torch.zeros(1000, dtype=torch.bfloat16)
    per_param = (2 * low.numel() * low.element_size() + master.numel() * 4 + state) / 1000
    assert per_param == 16 and (master.numel() * 4 + state) / 1000 == 12
    plan = hybrid.plan(8, 64, 16, 32, 1, 1, 1, 1, lab07_ref.memory_per_rank, zero_stage=0)
    n = plan["params"]
    assert plan["memory"]["optimizer"] == 12 * n and plan["memory"]["total"] == 16 * n
    fp32 = hybrid.plan(8, 64, 16, 32, 1, 1, 1, 1, lab07_ref.memory_per_rank, 0, 4, 4)["memory"]
    assert (fp32["params"], fp32["grads"], fp32["optimizer"]) == (4 * n, 4 * n, 8 * n)
    text = _lab_text()
    assert "`12N` for Adam's state" in text and "16N for the state alone" not in text


# --- parameters without a gradient --------------------------------------------------------------


def test_adamw_skips_a_parameter_without_gradient_and_counts_steps_per_parameter():
    """``torch/optim/adam.py``, ``_init_group``: only ``p.grad is not None`` parameters are
    stepped, and each keeps its own ``step``; weight decay does not move a frozen one.
    ``clip_grad_norm_`` leaves None gradients out of the norm."""
    frozen = nn.Parameter(torch.full((2,), 2.0), requires_grad=False)
    sometimes, always = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([frozen, sometimes, always], lr=0.1, weight_decay=0.1)
    for step in range(3):
        sometimes.grad = None if step == 1 else torch.ones(3)
        always.grad = torch.ones(3)
        opt.step()
    assert torch.equal(frozen, torch.full((2,), 2.0)) and frozen not in opt.state
    assert float(opt.state[sometimes]["step"]) == 2 and float(opt.state[always]["step"]) == 3
    sometimes.grad, always.grad = None, torch.full((3,), 4.0)
    norm = torch.nn.utils.clip_grad_norm_([frozen, sometimes, always], 1e9)
    assert float(norm) == pytest.approx(float(torch.full((3,), 4.0).norm()))


# --- layouts, pipelines, the seeds ---------------------------------------------------------------


def test_hybrid_ranks_put_the_pipeline_outermost_as_megatron_orders_them():
    """Megatron-LM, ``megatron/core/parallel_state.py``: ``initialize_model_parallel(...,
    order="tp-cp-ep-dp-pp")``, i.e. ``rank = tp + dp * t + pp * t * d``; ``hybrid.coords``
    inverts the same formula, and the notebook states it."""
    dp, tp, pp = 2, 4, 2
    for r in range(dp * tp * pp):
        d, p, t = hybrid.coords(r, dp=dp, tp=tp)
        assert t + d * tp + p * tp * dp == r
    assert hybrid.layout(dp, tp, pp)["pipeline"][0] == [0, 8]
    text = _lab_text()
    assert "r = (pp d + dd) t + tt" in text and "megatron/core/parallel_state.py" in text
    assert "r = (d p + pp) t + tt" not in text


def test_gpipe_bubble_is_43_percent_for_4_stages_and_4_micro_batches():
    """The seeds-checked box: ``(p - 1) / (m + p - 1)`` = 3/7 for p = m = 4."""
    assert timeline.gpipe_bubble(4, 4) == pytest.approx(3 / 7)
    assert round(100 * timeline.gpipe_bubble(4, 4)) == 43 and "43 %" in _lab_text()


def test_the_collectives_the_lab_names_exist_and_want_equal_sizes():
    """``torch/distributed/distributed_c10d.py``: ``reduce_scatter_single`` and
    ``all_gather_single`` (the names section 2 and exercise 2 use) exist, and their
    docstrings ask for the same size on every rank."""
    for name in ("reduce_scatter_single", "all_gather_single"):
        doc = " ".join((inspect.unwrap(getattr(dist, name)).__doc__ or "").split())
        assert "same size" in doc, name


# --- activations (section 7) ---------------------------------------------------------------


def _block(seq: int, width: int, heads: int, device: str = "cpu"):
    from ddp_lab.gpt import Block, GPTConfig

    with torch.device(device):
        return Block(GPTConfig(seq_len=seq, width=width, heads=heads, layers=1))


def test_autograd_keeps_what_the_activation_formula_counts_over_many_sizes():
    """Exercise 5's reference (``e (16 B T C + B H T^2 + 4 B T) + T^2``) against
    ``saved_tensors_hooks`` on real blocks: LayerNorm keeps its mean and 1/std, the batched
    matmuls keep contiguous copies of the transposed heads, ``masked_fill`` keeps the bool
    mask, softmax's output is kept once. A torch that saves otherwise turns this red."""
    from ddp_lab.parallel.memory import saved_bytes

    for b, t, c, h, dtype in [
        (1, 1, 8, 1, torch.float32),
        (3, 5, 24, 4, torch.float32),
        (2, 16, 24, 8, torch.float64),
        (1, 7, 12, 3, torch.float64),
    ]:
        block = _block(t, c, h).to(dtype)
        x = torch.randn(b, t, c, dtype=dtype, requires_grad=True)
        want = lab07_ref.activation_bytes(b, t, c, h, dtype.itemsize)
        assert saved_bytes(block, x) == want


def test_a_gpt2_small_block_keeps_0_81_gb_at_1024_tokens_seven_times_its_model_states():
    """Section 7's figures: width 768, 12 heads, batch 8, 1,024 tokens, float32, measured on
    the meta device; 12 blocks 9.7 GB; GPT-2 small's 124 M parameters (tied embeddings) at
    16 bytes: 2.0 GB."""
    from ddp_lab.parallel.memory import saved_bytes

    block = _block(1024, 768, 12, "meta")
    kept = saved_bytes(block, torch.empty(8, 1024, 768, device="meta", requires_grad=True))
    states = 16 * sum(p.numel() for p in block.parameters())
    gpt2_small = 12 * sum(p.numel() for p in block.parameters()) + (50257 + 1024) * 768 + 2 * 768
    assert round(kept / 1e9, 2) == 0.81 and round(states / 1e6) == 113
    assert round(kept / states) == 7 and round(12 * kept / 1e9, 1) == 9.7
    assert round(gpt2_small / 1e6) == 124 and round(16 * gpt2_small / 1e9, 1) == 2.0
    text = _lab_text()
    for said in ("0.81 GB", "113 MB", "9.7 GB", "2.0 GB", "124 M"):
        assert said in text


def test_a_checkpointed_block_keeps_its_input_only_and_gives_the_same_gradients():
    """``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` as ``GPT`` uses it:
    the outer graph keeps the block's input, nothing else; the written answer's numbers for
    4 blocks (width 128, 8 heads, batch 8 x 128 tokens)."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from ddp_lab.gpt import GPT, GPTConfig
    from ddp_lab.parallel.memory import saved_tensors

    assert callable(create_selective_checkpoint_contexts)
    block = _block(8, 16, 2)
    x = torch.randn(3, 8, 16, requires_grad=True)
    rows = saved_tensors(
        lambda t: checkpoint(block, t, use_reentrant=False), x, exclude=block.parameters()
    )
    assert [(r["shape"], r["bytes"]) for r in rows] == [((3, 8, 16), 3 * 8 * 16 * 4)]

    from ddp_lab.parallel.memory import saved_bytes

    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=128, width=128, heads=8, layers=4))
    tokens = torch.randint(0, 256, (8, 128))
    targets = torch.randint(0, 256, (8, 128))
    kept, grads = {}, {}
    for ckpt in (False, True):
        model.checkpoint_blocks = ckpt
        kept[ckpt] = saved_bytes(model, tokens)
        model.zero_grad()
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        grads[ckpt] = [p.grad.clone() for p in model.parameters()]
    assert kept == {False: 51_528_704, True: 3_163_136}
    assert lab07_ref.activation_bytes(8, 128, 128, 8, 4) == 12_615_680
    assert kept[False] - 4 * 12_615_680 == kept[True] - 4 * 524_288 == 1_065_984
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True], strict=True))
    text = _lab_text()
    for said in ("12,615,680", "50,462,720", "524,288", "51,528,704", "3,163,136", "1,065,984"):
        assert said in text


def test_dtensor_plan_of_a_block_all_reduces_2_forward_4_backward_and_2_with_the_input_once():
    """Lab 9's section 3 DTensor block, counted by ``CommDebugMode`` (on a fake group of 2: the
    counts, not the values): ``ColwiseParallel`` on q, k, v and fc, ``RowwiseParallel`` on
    the projections; each column layer reduces its input's gradient alone, unless the
    attention's input is made a DTensor once (``PrepareModuleInput``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }
    once = PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
    )
    counts = {}
    with _fake_world(0, 2):
        mesh = init_device_mesh("cpu", (2,))
        for name, p in (("plan", plan), ("once", {"attn": once, **plan})):
            block = parallelize_module(_block(8, 24, 6), mesh, p)
            x = torch.randn(2, 8, 24, requires_grad=True)
            with CommDebugMode() as fwd:
                y = block(x)
            with CommDebugMode() as bwd:
                y.sum().backward()
            counts[name] = [{str(k): v for k, v in m.get_comm_counts().items()} for m in (fwd, bwd)]
    reduce = "c10d_functional.all_reduce"
    assert counts["plan"] == [{reduce: 2}, {reduce: 4}]
    assert counts["once"] == [{reduce: 2}, {reduce: 2}]
    text = _lab_text(LAB09_NOTEBOOK)
    assert "Backward: 4" in text and "2 all-reduces per pass" in text


def test_torch_pipelining_has_the_schedules_section_4_names():
    """``torch/distributed/pipelining/schedules.py``: GPipe, 1F1B and interleaved 1F1B."""
    from torch.distributed import pipelining

    for name in ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "PipelineStage"):
        assert hasattr(pipelining, name), name
    text = _lab_text()
    assert "ScheduleInterleaved1F1B" in text and "Schedule1F1B" in text


def test_fused_attention_keeps_q_k_v_its_output_and_a_logsumexp_per_row_not_t_by_t():
    """``F.scaled_dot_product_attention`` (causal, float32, CPU): no ``T x T`` tensor saved."""
    from ddp_lab.parallel.memory import saved_tensors

    q, k, v = (torch.randn(2, 4, 64, 8, requires_grad=True) for _ in range(3))
    rows = saved_tensors(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    shapes = sorted(r["shape"] for r in rows)
    assert shapes == sorted([(2, 4, 64, 8)] * 4 + [(2, 4, 64)])
    assert "one number per row" in _lab_text()


# ===============================================================================================
# Lab 8: profiling, compression, FLOPs
# ===============================================================================================

LAB08_NOTEBOOK = ROOT / "solutions/lab08_profiling/lab08_profiling.ipynb"


def _lab08_text() -> str:
    cells = json.loads(LAB08_NOTEBOOK.read_text())["cells"]
    lines = "\n".join("".join(c["source"]) for c in cells).splitlines()
    return " ".join(" ".join(line.removeprefix(">") for line in lines).split())


def test_autocast_leaves_ddp_buckets_in_float32(world_of_one):
    """The seeds box of lab08: under autocast (bf16 on the CPU) the parameters and their
    gradients stay float32, so DDP's buckets, what it all-reduces, are float32: autocast
    does not shrink the bytes a step sends; a compression hook does."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    sent = []

    def hook(state, bucket):
        sent.append(bucket.buffer().dtype)
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model.register_comm_hook(None, hook)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(4, 8))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert sent and set(sent) == {torch.float32}
    assert "autocast does not shrink what DDP sends" in _lab08_text()


def test_ddp_first_bucket_and_flight_recorder_names_as_lab08_states():
    """The seeds box and "On real GPUs" of lab08: the first bucket's 1 MiB cap and the flight
    recorder's buffer variables (``torch/distributed/distributed_c10d.py``)."""
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20
    source = (TORCH / "distributed" / "distributed_c10d.py").read_text()
    assert '"TORCH_FR_BUFFER_SIZE"' in source and '"TORCH_NCCL_TRACE_BUFFER_SIZE"' in source
    text = _lab08_text()
    assert "dist._DEFAULT_FIRST_BUCKET_BYTES" in text and "TORCH_NCCL_TRACE_BUFFER_SIZE" in text


def test_flop_counter_counts_two_per_multiply_add_and_only_needed_gradients():
    """Lab 8 section 4: ``FlopCounterMode`` counts ``2 m k n`` per matrix product, nothing for
    the bias or an activation, and a backward computes the input's gradient only when
    something before the layer needs one."""
    from torch.utils.flop_counter import FlopCounterMode

    layer = nn.Linear(3, 5)
    for needs, factor in ((False, 1), (True, 2)):
        x = torch.randn(4, 3, requires_grad=needs)
        with FlopCounterMode(display=False) as fwd:
            y = torch.relu(layer(x)).sum()
        with FlopCounterMode(display=False) as bwd:
            y.backward()
        assert fwd.get_total_flops() == 2 * 4 * 3 * 5
        assert bwd.get_total_flops() == factor * 2 * 4 * 3 * 5
    assert "`2 m k n` FLOPs" in _lab08_text()

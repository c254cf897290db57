"""Lab 2's reference collectives equal torch's, the reference parameter server follows the
checks' trajectory, the cost model fits its own data, and the runtime's bandwidth tool times
any collective.

The references live in the instructor's part (``ddp_lab.answers.lab02.references``), the
timing tool in the runtime (``ddp_lab.bandwidth``). Distributed cases run in real gloo
process groups of 2 and 3 processes, started once per world size (a module-scoped fixture)
with ``_harness.spawn_gloo`` (no port); the workers live in ``tests/_collective_workers.py``
and save their differences to files that the tests read.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:  # spawn copies sys.path into the children: they find it too
    sys.path.insert(0, _TESTS_DIR)

import _collective_workers as workers  # noqa: E402
from _harness import spawn_gloo  # noqa: E402

from ddp_lab.answers.lab02.references import (  # noqa: E402
    fit_alpha_beta,
    ring_all_reduce,
    ring_allreduce_time,
    ring_owned_chunk,
    ring_schedule,
    server_step_time,
)
from ddp_lab.answers.lab02.servers import reduce_broadcast_average  # noqa: E402
from ddp_lab.bandwidth import measure_all_reduce  # noqa: E402

WORLD_SIZES = [2, 3]
#: Lengths not divisible by 2 or 3, and shorter than the world size; two 2-D shapes.
CASES = [((n,), "float64") for n in (1, 2, 7, 10, 1001)] + [
    ((7,), "float32"),
    ((1001,), "float32"),
    ((3, 5), "float64"),
    ((4, 7), "float32"),
]
TOLERANCE = {"float64": 1e-12, "float32": 1e-5}
GROUP_TIMEOUT_S = 90
TEST_TIMEOUT_S = 150


def run_group(world_size: int, out_dir: Path) -> list[dict]:
    """Spawn ``world_size`` workers, wait (bounded), kill stragglers, return each rank's dict."""
    try:
        spawn_gloo(workers.worker_main, world_size, str(out_dir), CASES, timeout=GROUP_TIMEOUT_S)
    finally:
        errors = sorted(out_dir.glob("rank*.err"))
        assert not errors, "\n".join(e.read_text() for e in errors)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"world{n}")
def group_results(request, tmp_path_factory) -> tuple[int, list[dict]]:
    world_size = request.param
    return world_size, run_group(world_size, tmp_path_factory.mktemp(f"world{world_size}"))


def _case_id(case: tuple) -> str:
    shape, dtype = case
    return f"{'x'.join(map(str, shape))}-{dtype}"


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_ring_all_reduce_matches_dist_all_reduce(group_results, case):
    world_size, ranks = group_results
    for rank, res in enumerate(ranks):
        diff = res["ring"][case]
        assert diff <= TOLERANCE[case[1]], f"world {world_size}, rank {rank}: max diff {diff}"
        assert res["in_place"][case], f"rank {rank}: result is not the input tensor, in place"


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_average_through_one_rank_matches_all_reduce_mean(group_results, case):
    world_size, ranks = group_results
    for rank, res in enumerate(ranks):
        diff = res["ps"][case]
        assert diff <= TOLERANCE[case[1]], f"world {world_size}, rank {rank}: max diff {diff}"


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_ring_skipping_last_reduce_scatter_step_is_detected(group_results, case):
    world_size, ranks = group_results
    # every case has a non-empty chunk, so some rank must see a wrong sum
    worst = max(res["broken"][case] for res in ranks)
    assert worst > 1e-3, f"world {world_size}: the broken ring went unnoticed ({worst})"


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_collectives_handle_non_contiguous_tensors_and_sub_groups(group_results):
    world_size, ranks = group_results
    assert all(res["noncontig"] <= 1e-12 for res in ranks), [r["noncontig"] for r in ranks]
    subgroup = [res["subgroup"] for res in ranks if "subgroup" in res]
    assert len(subgroup) == len(range(world_size - 1, -1, -2))
    assert all(d <= 1e-12 for d in subgroup), subgroup


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_parameter_server_follows_the_one_process_trajectory_with_and_without_staleness(
    group_results,
):
    world_size, ranks = group_results
    for rank, res in enumerate(ranks):
        for staleness, diff in res["server"].items():
            assert diff <= 1e-12, f"world {world_size}, rank {rank}, staleness {staleness}"


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_measure_all_reduce_gives_positive_finite_times_agreed_by_all_ranks(group_results):
    _, ranks = group_results
    for key in ("measured", "measured_ring"):
        times = ranks[0][key]
        assert len(times) == 2
        assert all(math.isfinite(t) and t > 0 for t in times), times
        assert all(res[key] == times for res in ranks), "ranks report different times"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_ring_schedule_reduces_each_chunk_once_then_gathers_everywhere(world_size):
    n = world_size
    steps = ring_schedule(n)
    assert len(steps) == 2 * (n - 1)
    # contributions[rank][chunk]: the set of ranks whose values that copy of the chunk sums
    contributions = [[{r} for _ in range(n)] for r in range(n)]
    for step in steps[: n - 1]:
        assert sorted(src for src, _, _ in step) == list(range(n)), "one send per rank"
        assert all(dst == (src + 1) % n for src, dst, _ in step), "only to the right neighbour"
        sent = [(dst, chunk, set(contributions[src][chunk])) for src, dst, chunk in step]
        for dst, chunk, values in sent:
            assert not values & contributions[dst][chunk], "a contribution counted twice"
            contributions[dst][chunk] |= values
    everyone = set(range(n))
    for chunk in range(n):
        holders = [r for r in range(n) if contributions[r][chunk] == everyone]
        assert holders == [[r for r in range(n) if ring_owned_chunk(r, n) == chunk][0]]
    for step in steps[n - 1 :]:
        assert all(dst == (src + 1) % n for src, dst, _ in step)
        sent = [(dst, chunk, set(contributions[src][chunk])) for src, dst, chunk in step]
        for dst, chunk, values in sent:
            contributions[dst][chunk] = values
    assert all(c == everyone for row in contributions for c in row), "a rank misses a chunk"


@pytest.mark.timeout(10)
def test_ring_schedule_rejects_empty_world():
    with pytest.raises(ValueError, match="at least 1"):
        ring_schedule(0)


@pytest.mark.timeout(10)
def test_collectives_are_no_ops_in_one_process():
    x = torch.arange(6.0).reshape(2, 3)
    assert ring_all_reduce(x) is x and x.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert reduce_broadcast_average(x) is x and x.tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.timeout(10)
def test_ring_allreduce_time_follows_the_alpha_beta_formula():
    assert ring_allreduce_time(1e9, 4, 1e-5, 1e10) == pytest.approx(1.5 * 0.1 + 6e-5)
    assert ring_allreduce_time(1e9, 1, 1e-5, 1e10) == 0.0
    sizes = np.array([1e3, 1e6])
    np.testing.assert_allclose(ring_allreduce_time(sizes, 2, 0.0, 1e9), sizes / 1e9)


@pytest.mark.timeout(10)
def test_server_step_time_follows_the_alpha_beta_formula():
    assert server_step_time(1e9, 4, 1e-5, 1e10) == pytest.approx(6 * (1e-5 + 0.1))
    assert server_step_time(1e9, 1, 1e-5, 1e10) == 0.0
    sizes = np.array([1e3, 1e6])
    np.testing.assert_allclose(server_step_time(sizes, 2, 0.0, 1e9), 2 * sizes / 1e9)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("world_size", [2, 3, 8])
@pytest.mark.parametrize("relative", [False, True])
def test_fit_alpha_beta_recovers_the_model_parameters(world_size, relative):
    alpha, bandwidth = 3e-5, 2.5e9
    sizes = np.logspace(2, 8, 13)
    seconds = ring_allreduce_time(sizes, world_size, alpha, bandwidth)
    fit_alpha, fit_bandwidth = fit_alpha_beta(sizes, seconds, world_size, relative=relative)
    assert fit_alpha == pytest.approx(alpha, rel=0.01)
    assert fit_bandwidth == pytest.approx(bandwidth, rel=0.01)


@pytest.mark.timeout(10)
def test_fit_alpha_beta_recovers_parameters_from_noisy_times_with_relative_errors():
    alpha, bandwidth, n = 1e-4, 1e9, 4
    sizes = np.logspace(2, 8, 25)
    noise = 1 + 0.002 * np.random.default_rng(0).standard_normal(sizes.size)
    seconds = ring_allreduce_time(sizes, n, alpha, bandwidth) * noise
    fit_alpha, fit_bandwidth = fit_alpha_beta(sizes, seconds, n, relative=True)
    assert fit_alpha == pytest.approx(alpha, rel=0.01)
    assert fit_bandwidth == pytest.approx(bandwidth, rel=0.01)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "sizes, seconds, world_size, message",
    [
        ([1e3, 1e6], [1.0], 2, "one time per size"),
        ([1e3, 1e3], [1.0, 1.0], 2, "two distinct"),
        ([1e3, 1e6], [1.0, float("nan")], 2, "finite"),
        ([1e3, 1e6], [1.0, 2.0], 1, "world_size >= 2"),
    ],
)
def test_fit_alpha_beta_rejects_unusable_input(sizes, seconds, world_size, message):
    with pytest.raises(ValueError, match=message):
        fit_alpha_beta(sizes, seconds, world_size)


@pytest.mark.timeout(10)
def test_measure_all_reduce_says_it_needs_a_process_group():
    with pytest.raises(RuntimeError, match="needs a process group"):
        measure_all_reduce([64], repeats=1)

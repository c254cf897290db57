"""Lab 3's checker pieces and notebook, tested directly: the slowed network, the faked GPU
node, the subgroup seen as the world, the bucketing oracle, the trainer's warm-up as an
oracle, and the notebook (points, facts, demonstrations that need an unfinished exercise,
process groups created twice in one kernel)."""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import torch
import torch.distributed as dist
from _harness import lab_notebook, solution_sources

from ddp_lab.answers.lab03 import references as ref
from ddp_lab.checks.lab03 import ex5_bucketed_ddp as ex5
from ddp_lab.checks.lab03 import ex6_warmup_steps as ex6
from ddp_lab.checks.lab03 import fake_node, own_ddp
from ddp_lab.checks.lab03.network import SlowBackwardNet, SlowNetwork, best_steps
from ddp_lab.checks.runner import split_magics
from ddp_lab.grading.notebook import is_test, is_written, nbgrader_meta, source_of

LAB = "lab03_ddp"


@pytest.fixture
def one_rank():
    """A one-process gloo group in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# --- the slowed network ------------------------------------------------------------------------


def test_the_slow_network_sums_returns_at_once_and_lands_the_result_at_the_wait(one_rank):
    net = SlowNetwork(latency=0.05)
    with net.installed():
        t = torch.ones(3)
        start = time.perf_counter()
        work = dist.all_reduce(t, async_op=True)
        assert time.perf_counter() - start < 0.04, "an asynchronous call returns at once"
        t /= 2  # a division before the wait is lost
        assert work.wait() and time.perf_counter() - start >= 0.05
        assert torch.equal(t, torch.ones(3)), "the sum overwrites the tensor at the wait"
        fut = dist.all_reduce(t, async_op=True).get_future()
        assert torch.equal(fut.wait()[0], torch.ones(3))
        net.sync = True
        start = time.perf_counter()
        dist.all_reduce(t, async_op=True)
        assert time.perf_counter() - start >= 0.05, "sync: every call blocks"
    assert dist.all_reduce is not net.all_reduce, "restored"
    assert [c[1] for c in net.calls] == [3, 3, 3] and [c[4] for c in net.calls] == [True] * 3


def test_the_link_carries_one_message_at_a_time(one_rank):
    net = SlowNetwork(latency=0.03)
    with net.installed():
        works = [dist.all_reduce(torch.ones(1), async_op=True) for _ in range(3)]
        start = time.perf_counter()
        works[-1].wait()
        assert time.perf_counter() - start >= 0.08


def test_overlap_is_measured_as_the_reference_wrappers_give_it(one_rank):
    spec = own_ddp.TIMING
    net = SlowNetwork(latency=spec["latency"])
    with net.installed():
        for cls, kwargs, messages in (
            (ref.MyDDP, {}, 8),
            (ref.BucketedDDP, {"bucket_cap_mb": ex5.TIMING_CAP_BYTES / 2**20}, 4),
        ):
            torch.manual_seed(0)
            model = SlowBackwardNet(spec["layers"], spec["width"], spec["compute"])
            best = best_steps(cls(model, **kwargs), torch.randn(8, spec["width"]), net, reps=1)
            gain = best["blocking"]["step"] - best["overlapped"]["step"]
            assert len(best["overlapped"]["calls"]) == messages
            assert gain >= own_ddp.MIN_GAIN_SHARE * own_ddp.ideal_gain(spec, messages)


# --- the faked GPU node and the world of a run ----------------------------------------------


def test_the_faked_gpu_node_records_and_restores():
    calls: list = []
    env = fake_node.node_env(1)
    assert env["RANK"] != env["LOCAL_RANK"]
    real = (torch.cuda.is_available, dist.init_process_group, os.environ.get("RANK"))
    with fake_node.gpu_node(env, calls):
        assert torch.cuda.is_available() and torch.cuda.device_count() == 4
        torch.cuda.set_device(torch.device("cuda", 2))
        dist.init_process_group("nccl", device_id=torch.device("cuda:2"))
        assert dist.is_initialized() and dist.get_rank() == int(env["RANK"])
        assert os.environ["LOCAL_RANK"] == env["LOCAL_RANK"]
    assert calls == [["set_device", 2], ["init", "nccl", 2]]
    assert (torch.cuda.is_available, dist.init_process_group, os.environ.get("RANK")) == real
    with fake_node.no_cuda():
        assert not torch.cuda.is_available() and torch.cuda.device_count() == 0


def test_the_reference_setup_passes_on_a_faked_gpu_node():
    from ddp_lab.checks.lab03 import ex2_ddp_train as ex2

    for rank in range(3):
        env, calls = fake_node.node_env(rank), []
        with fake_node.gpu_node(env, calls):
            got = ref.ddp_setup()
        probe = {"env": env, "calls": calls, "setup": [got[0], got[1], str(got[2])]}
        assert ex2.gpu_problem(probe, rank) is None


# --- the oracles -----------------------------------------------------------------------------


def test_torchs_bucketing_routine_is_the_rule_the_lab_states():
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        sizes = [int(torch.randint(1, 60, (1,), generator=gen)) for _ in range(5)]
        for dtype in (torch.float32, torch.float64):
            item = torch.empty(0, dtype=dtype).element_size()
            cap = int(torch.randint(4, sum(sizes) * item + 8, (1,), generator=gen))
            params = [torch.zeros(n, dtype=dtype) for n in sizes]
            want = [sum(p.numel() for p in b) for b in ref.bucket_params(params, cap)]
            assert ex5.buckets(sizes, item, cap) == want, (sizes, cap, dtype)


def test_the_trainers_warmup_is_the_oracles_ramp():
    for warmup in (0, 1, 2, 7, 50):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        from ddp_lab.optim import warmup_schedule

        sched = warmup_schedule(opt, warmup)
        for step in range(1, warmup + 5):
            lr = opt.param_groups[0]["lr"]
            assert math.isclose(lr, ex6.trainer_factor(step, warmup))
            assert math.isclose(lr, ref.expected_lr_at(step, 1.0, 8, 8, 1, 1, warmup))
            opt.step()
            sched.step()


def test_the_shortest_warmup_is_the_oracles_and_the_reference_agrees():
    """The reference's formula against a search over the trainer's ramp, on many calls."""
    for base in (16, 32, 128):
        for batch in (1, 5, 16, 40, 64):
            for world in (1, 2, 3, 8):
                for accum in (1, 3):
                    for samples in (0, 1, 100, 5 * batch * world * accum, 12345):
                        call = {"base_batch": base, "batch_size": batch, "world_size": world}
                        call.update(accum_steps=accum, warmup_samples=samples)
                        want = ref.expected_warmup_steps(**call)
                        assert ex6.gentle(call, want) and ex6.long_enough(call, want), call
                        if want:
                            below = want - 1
                            assert not (ex6.gentle(call, below) and ex6.long_enough(call, below))


# --- the notebook ----------------------------------------------------------------------------


def _text(folder: str = "solutions") -> str:
    return json.dumps(lab_notebook(LAB, folder)["cells"])


def test_points_and_notebook_shape():
    cells = lab_notebook(LAB)["cells"]
    points = {nbgrader_meta(c)["grade_id"]: nbgrader_meta(c)["points"] for c in cells if is_test(c)}
    assert points == {
        "test_ex1_shard_sampler": 2,
        "test_ex2_ddp_train": 4,
        "test_ex3_evaluate": 2,
        "test_ex4_my_ddp": 3,
        "test_ex5_bucketed_ddp": 4,
        "test_ex6_warmup_steps": 1,
    }
    written = {
        nbgrader_meta(c)["grade_id"]: nbgrader_meta(c)["points"] for c in cells if is_written(c)
    }
    assert written == {"uneven_answer": 2, "lr_limits_answer": 2}
    text = _text()
    for required in ("What goes wrong", "On real GPUs", "Recap", "../../results/lab3/scaling.json"):
        assert required in text, required


def test_the_notebook_states_the_facts():
    text = _text()
    for fact in (
        "forward_sync_buffers=True",  # buffers before every forward, not only at wrap time
        "1 MiB (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`)",  # the first bucket
        "30 minutes by default with gloo, 10",  # the timeouts
        "--warmup-steps",  # the trainer's warm-up, shown
        "Adam",  # the limits of the linear rule
        "silently",  # uneven shards drift out of step
    ):
        assert fact in text, fact
    assert "30 minutes by default)" not in text


@pytest.mark.parametrize("folder", ["solutions", "labs"])
def test_the_notebook_points_at_no_answer_and_uses_only_the_kit(folder):
    text = _text(folder)
    for pointer in ("course's answer", "reference DDP script", "print0"):
        assert pointer not in text, pointer
    for instructor_only in ("ddp_lab.answers", "checks.verdict", "ddp_lab.bench"):
        assert instructor_only not in text, instructor_only
    grading = [line for line in text.split("\\n") if "ddp_lab.grading" in line]
    assert all("hidden_test" in line for line in grading), grading


def _cells() -> dict[str, str]:
    return {c["id"]: source_of(c) for c in lab_notebook(LAB)["cells"]}


def _run_cells(ids, ns: dict) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for cid in ids:
            code, _ = split_magics(_cells()[cid])
            exec(compile(code, cid, "exec"), ns)  # noqa: S102 - the course's own cells
    return out.getvalue()


def test_in_kernel_process_groups_survive_a_rerun_and_an_interrupted_cell(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    _run_cells(["setup"], ns)
    ns["display"] = lambda *a, **k: None
    code_cells = {c["id"] for c in lab_notebook(LAB)["cells"] if c["cell_type"] == "code"}
    for cid, cell in _cells().items():
        if cid in code_cells and "init_process_group(" in cell and "%%writefile" not in cell:
            assert "if dist.is_initialized():" in cell, cid
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # left over
    out = _run_cells(["unused_run", "unused_run"], ns)
    assert out.count("find_unused_parameters=True: 3 steps done") == 2
    assert not dist.is_initialized()


def test_demonstrations_ask_for_the_unfinished_exercise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    _run_cells(["setup"], ns)
    ns["display"] = lambda *a, **k: None
    out = _run_cells(["overlap_run"], ns)
    assert "finish exercises 4 and 5 first" in out  # no files at all
    stub = "# YOUR CODE HERE\nraise NotImplementedError()\n"
    for cell in ("ex4_my_ddp", "ex5_bucketed_ddp"):
        name, _ = split_magics(solution_sources(LAB)[cell])[1].popitem()
        (tmp_path / name).write_text(stub)
    assert "finish exercises 4 and 5 first" in _run_cells(["overlap_run"], ns)

    def warmup_steps_for(*args, **kwargs):
        raise NotImplementedError()

    ns["warmup_steps_for"] = warmup_steps_for
    assert "finish exercise 6 first" in _run_cells(["fig_lr"], ns)
    assert not dist.is_initialized()


def test_the_overlap_demonstration_draws_the_students_wrappers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for cell in ("ex4_my_ddp", "ex5_bucketed_ddp"):
        name, text = split_magics(solution_sources(LAB)[cell])[1].popitem()
        (tmp_path / name).write_text(text)
    shown: list = []
    ns: dict = {}
    _run_cells(["setup"], ns)
    ns["display"] = shown.append
    out = _run_cells(["overlap_run"], ns)
    assert len(ns["measured"]) == 4 and len(shown) == 1, out
    m = ns["measured"]
    assert (
        m["BucketedDDP, as you wrote it"]["step"]
        < m["BucketedDDP, every all-reduce blocking"]["step"]
    )


def test_the_learning_rate_figure_draws_the_students_warmups():
    from ddp_lab.figures import lab03 as figures

    calls = []

    def warmup_steps_for(base_batch, batch_size, world_size, accum_steps=1, warmup_samples=0):
        calls.append(world_size)
        return world_size

    fig = figures.warmup_schedules(warmup_steps_for, 0.1, 32, 32, [1, 2, 4], 10, {2: [(1, 0.1)]})
    assert sorted(set(calls)) == [1, 2, 4] and len(fig.axes[0].lines) == 3
    rates = fig.axes[0].lines[2].get_ydata()
    assert math.isclose(rates[0], 0.1) and math.isclose(rates[3], 0.4), "4 steps to 4 x 0.1"

    def stub(*args, **kwargs):
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        figures.warmup_schedules(stub, 0.1, 32, 32, [1], 10)

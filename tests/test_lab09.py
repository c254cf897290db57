"""Lab 9 (PyTorch's distributed stack: FSDP2, DTensor, device meshes): its checks and the
facts they rest on.

- the case sets cover every edge case in every draw (200 seeds, inputs only);
- exercise 1's judge (kit oracle + the grader's hidden part) accepts the reference and names
  every typical mistake, over 100 draws, without student processes;
- on the grader's path (``run_ranks``: one torchrun job per case), the mistakes that the
  grader's rounds (``tests/test_mistakes.py``) leave out fail their exercise with their
  reasons; the visible checks pass the notebook's solution files under torchrun;
- the notebook's demonstrations, as the notebook writes them, show what its text says:
  FSDP2's rows and padded storage, ZeRO-3's collectives per unit and the peak of gathered
  parameters, the plain DTensor plan's all-reduces, the 2-D mesh's groups and its run equal
  to one process, a sharded ``state_dict()`` that does not load.

The real grader runs (full marks, zero, mistakes, cheat) are in ``test_grading.py`` and
``test_mistakes.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from _harness import GradedLab, assert_verdicts, lab_notebook, saved

from ddp_lab.answers.lab07 import references as lab07_ref
from ddp_lab.answers.lab09 import MISTAKES, MORE_MISTAKES
from ddp_lab.answers.lab09 import references as ref
from ddp_lab.checks import lab09 as checks
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab09 import common
from ddp_lab.checks.lab09 import ex1_fsdp_bytes as ex1
from ddp_lab.checks.runner import STUB, namespace, run_ranks
from ddp_lab.launch import torchrun
from ddp_lab.parallel import hybrid

LAB = checks.LAB
#: Draws whose inputs are checked for every edge case (cheap: nothing is run).
SEEDS = range(200)
#: Draws fed to the judges (outputs built in this process, right and wrong).
PROPERTY_SEEDS = range(100)
GRADED = GradedLab(LAB)
SOURCES, EXERCISES = GRADED.sources, GRADED.exercises
_judge, _inputs = GRADED.judge, GRADED.inputs


def _file(source: str) -> str:
    return source.split("\n", 1)[1]


# --- the case sets ---------------------------------------------------------------------------


def test_every_draw_holds_every_edge_case():
    for seed in SEEDS:
        cases = _inputs("test_ex1_fsdp_bytes", seed)["cases"]
        assert {c["world"] for c in cases} == {1, 2, 3, 4}
        assert {c["model"]["bytes"] for c in cases} == {2, 4, 8}
        tiny = [c for c in cases if max(s[0] for s in c["model"]["shapes"]) < 3]
        assert tiny and any(c["world"] == 3 for c in tiny), "ranks holding nothing"
        assert any(len(s) == 4 for c in cases for s in c["model"]["shapes"]), "a 4-D weight"
        uneven = [s[0] for c in cases for s in c["model"]["shapes"] if s[0] % 2 and s[0] % 3]
        assert uneven, "rows that divide by neither 2 nor 3"

        fsdp = _inputs("test_ex2_fsdp", seed)["cases"]
        assert [(c["world_size"], c["dtype"]) for c in fsdp] == [(3, "float64"), (2, "float32")]
        assert fsdp[0]["tokens"].shape[1] == 3, "a share of 1 sequence a rank"
        assert all(c["cfg"]["vocab"] % 2 == 1 for c in fsdp)
        assert all(len(c["tokens"]) >= 2 for c in fsdp), "several steps"

        mesh = _inputs("test_ex4_mesh", seed)["cases"]
        assert [(c["world_size"], c["tp"], c["dtype"]) for c in mesh][0] == (4, 2, "float64")
        assert mesh[1]["world_size"] == 3 and mesh[1]["tp"] in (1, 3)
        assert all(c["cfg"]["heads"] % c["tp"] == 0 for c in mesh), "whole heads a rank"

        blocks = _inputs("test_ex3_dtensor_block", seed)["cases"]
        assert [(c["world_size"], c["dtype"]) for c in blocks] == [(3, "float64"), (2, "float32")]
        assert all(c["heads"] % c["world_size"] == 0 for c in blocks)
        assert blocks[0]["x"].shape[0] == 1 and blocks[1]["x"].shape[0] > 1
    seen = {_inputs("test_ex4_mesh", s)["cases"][1]["tp"] for s in SEEDS}
    assert seen == {1, 3}, "one row and one column, over the draws"


# --- exercise 1 ---------------------------------------------------------------------------


def test_fsdp_bytes_oracle_is_torch_chunk_rows_of_every_parameter():
    """The oracle's measured bytes equal the rows ``torch.chunk`` gives each rank."""
    for seed in range(20):
        for case in _inputs("test_ex1_fsdp_bytes", seed)["cases"]:
            shapes = [tuple(s) for s in case["model"]["shapes"]]
            want = ref.fsdp_bytes(shapes, case["model"]["bytes"], case["world"])
            assert ex1.oracle(case) == want
    assert ex1.rows(10, 3) == [4, 4, 2] and ex1.rows(2, 3) == [1, 1, 0]
    assert ex1.rows(5, 4) == [2, 2, 1, 0], "torch.chunk leaves the last rank empty-handed"


def test_fsdp_bytes_judge_accepts_the_reference_and_names_every_mistake_every_draw():
    gid = "test_ex1_fsdp_bytes"
    mistakes = [m for m in MISTAKES + MORE_MISTAKES if m.cell == "ex1_fsdp_bytes"]
    assert len(mistakes) >= 8
    spaces = {m.name: namespace({m.cell: m.source}, [m.cell]) for m in mistakes}
    judge = _judge(gid)
    solution = namespace(SOURCES, ["ex1_fsdp_bytes"])
    for seed in PROPERTY_SEEDS:
        inputs = _inputs(gid, seed)
        right = saved(ex1.run({"fsdp_bytes": ref.fsdp_bytes}, inputs, None))
        assert_verdicts(judge, seed, inputs, right, {})
        judge(inputs, saved(ex1.run(solution, inputs, None)))
        for m in mistakes:
            with pytest.raises(CheckFailed, match=m.reason):
                judge(inputs, saved(ex1.run(spaces[m.name], inputs, None)))


def test_visible_fsdp_bytes_check_passes_the_solution_and_names_a_mistake(capsys):
    checks.fsdp_bytes(namespace(SOURCES, ["ex1_fsdp_bytes"])["fsdp_bytes"])
    assert capsys.readouterr().out.startswith("OK: fsdp_bytes matches FSDP2's shards")
    bad = next(m for m in MISTAKES if m.name == "tensor_split_rows")
    with pytest.raises(CheckFailed, match="measured on FSDP2's own shards"):
        checks.fsdp_bytes(namespace({bad.cell: bad.source}, [bad.cell])["fsdp_bytes"])
    with pytest.raises(CheckFailed, match="finish this exercise first"):
        checks.fsdp_bytes(lambda *a: (_ for _ in ()).throw(NotImplementedError()))


# --- exercises 2 to 4 on the grader's path ----------------------------------------------------


def test_collectives_add_up_every_name_of_the_same_collective():
    """DTensor's functional collectives and ``torch.distributed``'s add up under one name."""

    class Seen:
        def get_comm_counts(self):
            return {
                "c10d_functional.all_reduce": 2,
                "c10d.allreduce_": 2,
                "c10d._allgather_base_": 3,
                "c10d_functional.all_gather_into_tensor": 1,
                "c10d._reduce_scatter_base_": 2,
                "c10d.broadcast_": 1,
            }

    assert common.collectives(Seen()) == {
        "all_reduce": 4,
        "all_gather": 4,
        "reduce_scatter": 2,
        "broadcast": 1,
    }


_DISTRIBUTED = [m for m in MORE_MISTAKES if m.cell != "ex1_fsdp_bytes"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mistake", _DISTRIBUTED, ids=lambda m: m.name)
def test_more_mistakes_fail_their_exercise_with_their_reason_on_the_graders_path(mistake, tmp_path):
    """The mistakes that the grader's rounds leave out, each run as the grader runs it (a
    torchrun job per case) and judged with the grader's judge."""
    gid = f"test_{mistake.cell}"
    ex = EXERCISES[gid]
    folder, work = tmp_path / "student", tmp_path / "work"
    folder.mkdir()
    work.mkdir()
    (folder / ex.files[0]).write_text(_file(mistake.source))
    inputs = ex.make_inputs(torch.Generator().manual_seed(5))
    with pytest.raises(CheckFailed, match=mistake.reason):
        _judge(gid)(inputs, run_ranks(ex, LAB, inputs, work, folder, ex.timeout))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_visible_distributed_checks_run_the_solution_files_under_torchrun(tmp_path, capsys):
    for cell in ("ex2_fsdp", "ex3_dtensor_block", "ex4_mesh"):
        name = SOURCES[cell].split("\n", 1)[0].split()[-1]
        (tmp_path / name).write_text(_file(SOURCES[cell]))
    checks.fsdp(str(tmp_path / "fsdp.py"))
    checks.dtensor_block(str(tmp_path / "tp_plan.py"))
    checks.mesh(str(tmp_path / "mesh2d.py"))
    assert capsys.readouterr().out.count("OK: ") == 3
    (tmp_path / "fsdp.py").write_text(f"def shard_model(model, mesh, adamw):\n    {STUB}()\n")
    with pytest.raises(CheckFailed, match="finish this exercise first"):
        checks.fsdp(str(tmp_path / "fsdp.py"))


def test_the_reference_files_are_the_solutions_code():
    """What the tests run as the reference is what the notebook's solution cells do (the
    same calls, in the same order), so the grader's rounds test the notebook's answer."""
    for cell, name in (("ex2_fsdp", "fsdp.py"), ("ex4_mesh", "mesh2d.py")):

        def calls(text: str) -> list[str]:
            lines = [line.split("#")[0].strip() for line in text.splitlines()]
            return [line for line in lines if "(" in line and not line.startswith(('"', "def"))]

        solution = _file(SOURCES[cell]).split("### BEGIN SOLUTION")[1].split("### END")[0]
        reference = ref.FILES[name].split('"""\n', 1)[-1]
        assert [c for c in calls(reference) if c in calls(solution)] == calls(solution), name


# --- the notebook's demonstrations ------------------------------------------------------------


def _demo(
    cell_id: str, tmp_path, nproc: int, extra: dict | None = None, args: list | None = None
) -> dict:
    """Run the file a notebook's ``%%writefile`` demonstration cell writes."""
    cell = next(c for c in lab_notebook(LAB)["cells"] if c["id"] == cell_id)
    text = "".join(cell["source"])
    name = text.split("\n", 1)[0].split()[-1]
    (tmp_path / name).write_text(text.split("\n", 1)[1])
    for file, source in (extra or {}).items():
        (tmp_path / file).write_text(source)
    return torchrun(
        name, args or [], nproc=nproc, timeout=240, cwd=str(tmp_path), stream=False
    ).result


def _text() -> str:
    return "\n".join("".join(c["source"]) for c in lab_notebook(LAB)["cells"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp2_holds_torch_chunk_rows_and_pads_the_parameter_storage(tmp_path):
    """Section 1's demonstration on 3 gloo ranks: each rank holds the rows the reference
    predicts (parameters, gradients, AdamW moments); every rank's parameter storage is
    allocated at the first chunk's size; the final LayerNorm's 64 numbers fall 22, 22, 20."""
    res = _demo("shards_script", tmp_path, 3)
    want = ref.fsdp_bytes([tuple(s) for s in res["shapes"]], 4, 3)
    total = sum(math.prod(s) for s in res["shapes"])
    assert total == 133_888 and "133,888 parameters" in _text()
    padded = sum(math.ceil(s[0] / 3) * math.prod(s[1:]) * 4 for s in res["shapes"])
    for r in res["ranks"]:
        assert r["held"] == want[r["rank"]], r
        assert r["param_storage"] == padded
    assert [r["ln_f_bias_rows"] for r in res["ranks"]] == [22, 22, 20]
    assert res["ranks"][2]["held"]["params"] < padded


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_per_block_units_gather_2l_plus_1_times_and_hold_one_block_at_a_time(tmp_path):
    """Section 2's demonstration on 2 gloo ranks, and the written answer's numbers: one unit
    1 all-gather and 1 reduce-scatter, all 233,856 parameters whole; one unit per block (4
    blocks) 9 and 5, at most the rest (33,920) and one block (49,984) whole."""
    res = _demo("units_script", tmp_path, 2)
    one, per = res["one unit"], res["one unit per block"]
    assert one["collectives"] == {"all-gathers": 1, "reduce-scatters": 1}
    assert per["collectives"] == {"all-gathers": 9, "reduce-scatters": 5}
    assert one["peak_gathered"] == 233_856 and per["peak_gathered"] == 33_920 + 49_984
    text = _text()
    for said in ("233,856", "49,984", "33,920", "83,904", "433,792", "1.85 times"):
        assert said in text
    assert round((2 * 4 * 49_984 + 33_920) / 233_856, 2) == 1.85


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_plain_dtensor_plan_equals_the_unsplit_block_with_2_and_4_all_reduces(tmp_path):
    """Section 3's demonstration on 2 gloo ranks, with lab 7's reference tp.py next door: the
    plain plan and the block built from lab 7's layers equal the unsplit block (float64), 2
    all-reduces forward, 4 backward (exercise 3 asks for 2)."""
    lab7 = tmp_path / "lab07" / "tp.py"
    lab7.parent.mkdir()
    lab7.write_text(lab07_ref.FILES["tp.py"])
    res = _demo("dtensor_script", tmp_path, 2, args=[str(lab7)])
    counts = {r["version"]: (r["forward"], r["backward"]) for r in res["rows"]}
    assert counts == {"DTensor plan": (2, 4), "your lab 7 tp.py": (2, 4)}
    assert all(r["output"] < 1e-12 and r["input_grad"] < 1e-12 for r in res["rows"])
    assert res["q"][1:] == [[48, 48], [24, 48]]
    assert [r["version"] for r in _demo("dtensor_script", tmp_path, 2)["rows"]] == ["DTensor plan"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_2d_mesh_gives_megatrons_groups_and_trains_what_one_process_trains(tmp_path):
    """Section 4's demonstration with the solution's mesh2d.py on 4 gloo ranks: the tensor
    and data groups are ``hybrid.layout(dp=2, tp=2, pp=1)``'s, every rank holds 8 of the 32
    rows of a query weight (tensor 16, then FSDP2 8), and 3 steps equal one process on the
    whole batch (float64)."""
    res = _demo("mesh_script", tmp_path, 4, {"mesh2d.py": _file(SOURCES["ex4_mesh"])})
    groups = hybrid.layout(dp=2, tp=2, pp=1)
    for r in res["ranks"]:
        assert r["tp"] in groups["tensor"] and r["rank"] in r["tp"]
        assert r["dp"] in groups["data"] and r["rank"] in r["dp"]
        assert r["coordinate"] == [r["rank"] // 2, r["rank"] % 2] and r["q_rows"] == 8
    assert res["max_diff"] < 1e-12


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_0s_sharded_state_dict_does_not_load_and_a_full_one_does(tmp_path):
    """ "What goes wrong" on 2 gloo ranks: rank 0's ``state_dict()`` saves DTensors holding
    128 of tok.weight's 256 rows and fails to load into the unsharded GPT; the full state
    dict loads and equals it."""
    res = _demo("wrong_script", tmp_path, 2)
    sharded, full = res["rank 0's state_dict()"], res["full state dict"]
    assert sharded["tok"] == "DTensor" and sharded["tok_rows_in_file"] == 128
    assert "mixed torch.Tensor and DTensor" in sharded["error"]
    assert sharded["error"].endswith("operators!"), sharded["error"]
    assert full["tok"] == "Tensor" and full["tok_rows_in_file"] == 256 and full["max_diff"] == 0

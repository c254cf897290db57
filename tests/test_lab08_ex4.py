"""Lab 8, exercise 4 (``train_flops``): the case set, the judges, the mistakes.

- every draw holds every edge case (200 seeds, inputs only);
- the reference equals ``FlopCounterMode`` on every case of 50 draws (kit judge + hidden);
- every mistake fails on the grader's path with its own reason in every one of 20 draws;
- the visible check passes on the reference and fails on a wrong backward, readably.

What FlopCounterMode counts (the section's facts) is asserted in ``tests/test_facts.py``.
"""

from __future__ import annotations

import pytest
import torch

from ddp_lab.answers import full_judge
from ddp_lab.answers.lab08 import ex4 as answers
from ddp_lab.answers.lab08.references_ex4 import train_flops
from ddp_lab.checks import runner
from ddp_lab.checks.failure import CheckFailed
from ddp_lab.checks.lab08 import ex4_flops as ex4

JUDGE = full_judge(ex4.EXERCISE, answers.HIDDEN["test_ex4_flops"])


def _inputs(seed: int) -> dict:
    return ex4.make_inputs(torch.Generator().manual_seed(seed))


def _outputs(source: str, inputs: dict, tmp_path) -> dict:
    ns = runner.namespace({"ex4_flops": source}, ex4.EXERCISE.cells, tmp_path)
    return runner.run_here(ex4.EXERCISE, ns, inputs, tmp_path)


def test_every_draw_holds_every_edge_case():
    for seed in range(200):
        cases = _inputs(seed)["cases"]
        shapes = [c["input_shape"] for c in cases]
        assert shapes[0][0] == 1, "a single sample"
        assert any(len(s) == 3 for s in shapes), "a (batch, tokens, features) input"
        convs = [layer for c in cases for layer in c["layers"] if layer["kind"] == "conv"]
        assert any(c["stride"] > 1 and c["padding"] > 0 for c in convs)
        assert any(c["padding"] == 0 and c["kernel"] == 5 for c in convs)
        assert any(len(s) == 4 and s[2] != s[3] for s in shapes), "a non-square input"
        assert any(len(s) == 4 and s[2] % 2 for s in shapes), "an odd-sized input"
        frozen = [[bool(layer.get("frozen")) for layer in c["layers"]] for c in cases]
        assert any(f[0] for f in frozen), "a frozen first layer"
        assert any(f[-1] for f in frozen), "a frozen last layer"
        assert any(any(f[1:-1]) and not f[0] for f in frozen), "a frozen middle layer"
        assert any(layer.get("bias") is False for c in cases for layer in c["layers"])


def test_the_reference_equals_flopcountermode_in_every_draw():
    for seed in range(50):
        inputs = _inputs(seed)
        outputs = {"results": [train_flops(c["layers"], c["input_shape"]) for c in inputs["cases"]]}
        assert "FlopCounterMode" in JUDGE(inputs, outputs)


@pytest.mark.parametrize("mistake", answers.MISTAKES, ids=lambda m: m.name)
def test_every_mistake_fails_with_its_reason_in_every_draw(mistake, tmp_path):
    for seed in range(20):
        inputs = _inputs(seed)
        outputs = _outputs(mistake.source, inputs, tmp_path)
        with pytest.raises(CheckFailed) as failed:
            JUDGE(inputs, outputs)
        assert mistake.reason in str(failed.value), (seed, str(failed.value))


def test_the_solution_cell_passes(tmp_path):
    inputs = _inputs(7)
    assert "FlopCounterMode" in JUDGE(inputs, _outputs(answers.SOLUTION_CELL, inputs, tmp_path))


def test_the_visible_check_passes_the_reference_and_names_a_wrong_count(capsys):
    ex4.visible(train_flops)
    assert "OK" in capsys.readouterr().out

    def forward_only(layers, input_shape):
        got = train_flops(layers, input_shape)
        return {"forward": got["forward"], "backward": got["forward"]}

    with pytest.raises(CheckFailed) as failed:
        ex4.visible(forward_only)
    assert "backward FLOPs should be" in str(failed.value)
    assert "Traceback" not in str(failed.value)

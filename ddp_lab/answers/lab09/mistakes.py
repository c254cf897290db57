"""Typical wrong answers of lab 9's exercises, as a student would write them. Each must fail
its own exercise with its ``reason`` in the verdict: ``MISTAKES`` on the grader's path
(``tests/test_mistakes.py``; the sample class submits the first of each exercise),
``MORE_MISTAKES`` in ``tests/test_lab09.py``.
"""

from __future__ import annotations

from ddp_lab.answers import Mistake
from ddp_lab.answers.lab09.mistakes_dtensor import DTENSOR_MISTAKES
from ddp_lab.answers.lab09.references import FSDP_SOURCE, MESH_SOURCE

# --- exercise 1 ---------------------------------------------------------------------------

_BYTES = """import math


def fsdp_bytes(shapes, bytes_per_number, world_size):
    out = []
    for rank in range(world_size):
        mine = 0
        for shape in shapes:
{rows}
            mine += rows * math.prod(shape[1:])
        out.append({{"params": mine * bytes_per_number, "grads": {grads} * bytes_per_number,
                    "optimizer": {moments} * mine * bytes_per_number{step}}})
    return out
"""
_CHUNK = """            per = math.ceil(shape[0] / world_size)
            rows = max(0, min(per, shape[0] - rank * per))"""


def _file(name: str, source: str, *edits: tuple[str, str]) -> str:
    """The ``%%writefile`` cell of ``source`` with each ``(old, new)`` edit made (each must
    change it)."""
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new)
    return f"%%writefile {name}\n{source}"


def _bytes(rows=_CHUNK, grads="mine", moments="2", step="") -> str:
    return _BYTES.format(rows=rows, grads=grads, moments=moments, step=step)


_FLAT = """import math


def fsdp_bytes(shapes, bytes_per_number, world_size):
    total = sum(math.prod(s) for s in shapes)
    chunk = math.ceil(total / world_size)
    out = []
    for rank in range(world_size):
        mine = max(0, min(chunk, total - rank * chunk)) * bytes_per_number
        out.append({"params": mine, "grads": mine, "optimizer": 2 * mine})
    return out
"""

_BLOCKS = "    for block in model.blocks:\n        fully_shard(block, mesh=mesh)\n"
_ROOT = "    fully_shard(model, mesh=mesh)\n"
_OPTIMIZER = "    optimizer = torch.optim.AdamW(model.parameters(), **adamw)\n"
_GRID = '(world // tp, tp), mesh_dim_names=("dp", "tp")'

_ALL = [
    Mistake("ex1_fsdp_bytes", "flat_vector", _FLAT, "ZeRO's flat vector"),
    Mistake(
        "ex1_fsdp_bytes",
        "tensor_split_rows",
        _bytes(rows="            rows = shape[0] // world_size + (rank < shape[0] % world_size)"),
        "torch.tensor_split's rule",
    ),
    Mistake(
        "ex1_fsdp_bytes",
        "numbers_not_rows",
        _bytes(
            rows="            n = math.prod(shape)\n            per = math.ceil(n / world_size)\n"
            "            rows = max(0, min(per, n - rank * per)) / math.prod(shape[1:])"
        ),
        "whole rows",
    ),
    Mistake(
        "ex1_fsdp_bytes",
        "rows_rounded_down",
        _bytes(rows="            rows = shape[0] // world_size"),
        "rows rounded down",
    ),
    Mistake(
        "ex1_fsdp_bytes",
        "padded_rows",
        _bytes(rows="            rows = math.ceil(shape[0] / world_size)"),
        "padded size",
    ),
    Mistake(
        "ex1_fsdp_bytes",
        "whole_gradients",
        _bytes(grads="sum(math.prod(s) for s in shapes)"),
        "reduce-scatters the gradients",
    ),
    Mistake("ex1_fsdp_bytes", "one_moment", _bytes(moments="1"), "two moments"),
    Mistake(
        "ex1_fsdp_bytes",
        "step_counted",
        _bytes(step=" + 4 * len(shapes)"),
        "step counters",
    ),
    # --- exercise 2 ------------------------------------------------------------------------
    Mistake(
        "ex2_fsdp",
        "one_unit",  # fully_shard on the model only: everything gathered at once
        _file("fsdp.py", FSDP_SOURCE, (_BLOCKS, "")),
        "every block should be its own FSDP unit",
    ),
    Mistake(
        "ex2_fsdp",
        "optimizer_first",  # the optimizer holds the parameters fully_shard replaced
        _file(
            "fsdp.py",
            FSDP_SOURCE,
            (_OPTIMIZER, ""),
            (
                "def shard_model(model, mesh, adamw):\n",
                "def shard_model(model, mesh, adamw):\n" + _OPTIMIZER,
            ),
        ),
        "an optimizer built before it holds the old ones",
    ),
    Mistake(
        "ex2_fsdp",
        "kept_gathered",  # reshard_after_forward=False: ZeRO-2's memory
        _file(
            "fsdp.py",
            FSDP_SOURCE,
            (
                "fully_shard(block, mesh=mesh)",
                "fully_shard(block, mesh=mesh, reshard_after_forward=False)",
            ),
        ),
        "reshard_after_forward=False",
    ),
    Mistake(
        "ex2_fsdp",
        "blocks_only",  # the embeddings, final LayerNorm and head never sharded
        _file("fsdp.py", FSDP_SOURCE, (_ROOT, "")),
        "the whole model should be an FSDP unit too",
    ),
    Mistake(
        "ex2_fsdp",
        "model_first",  # the model's unit takes the blocks' parameters
        _file("fsdp.py", FSDP_SOURCE, (_BLOCKS + _ROOT, _ROOT + _BLOCKS)),
        "shard the blocks first",
    ),
    # --- exercise 3 ------------------------------------------------------------------------
    *DTENSOR_MISTAKES,
    # --- exercise 4 ------------------------------------------------------------------------
    Mistake(
        "ex4_mesh",
        "tensor_first",  # the same grid read the other way: tensor groups stride across nodes
        _file("mesh2d.py", MESH_SOURCE, (_GRID, '(tp, world // tp), mesh_dim_names=("tp", "dp")')),
        "the tensor dimension must come last",
    ),
    Mistake(
        "ex4_mesh",
        "model_not_sharded",  # the parameters outside the blocks stay whole, unsynchronised
        _file("mesh2d.py", MESH_SOURCE, ('    fully_shard(model, mesh=mesh["dp"])\n', "")),
        "sharded over the data group (FSDP2 on the whole model)",
    ),
    Mistake(
        "ex4_mesh",
        "names_swapped",  # the right shape, the dimensions named the other way round
        _file("mesh2d.py", MESH_SOURCE, (_GRID, '(world // tp, tp), mesh_dim_names=("tp", "dp")')),
        "the tensor dimension must come last",
    ),
    Mistake(
        "ex4_mesh",
        "whole_mesh_fsdp",  # FSDP2 over both dimensions: it then meets the tensor split
        _file(
            "mesh2d.py",
            MESH_SOURCE,
            ('fully_shard(block, mesh=mesh["dp"])', "fully_shard(block, mesh=mesh)"),
        ),
        "overlapping meshes",
    ),
]

#: What the grader runs (``tests/test_mistakes.py``, the sample class the first of each): all
#: of exercise 1 (in one process, cheap), two of each distributed one.
_ROUNDS = {"ex1_fsdp_bytes": 99}
MISTAKES = [
    m
    for m in _ALL
    if [x.cell for x in _ALL[: _ALL.index(m) + 1]].count(m.cell) <= _ROUNDS.get(m.cell, 2)
]
#: The others, judged in ``tests/test_lab09.py`` (each must fail its exercise with its reason).
MORE_MISTAKES = [m for m in _ALL if m not in MISTAKES]

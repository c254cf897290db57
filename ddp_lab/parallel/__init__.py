"""Beyond data parallelism, the runtime pieces lab 7's demos use (part of the student kit).

- :mod:`~ddp_lab.parallel.memory`: bytes that tensors hold on a rank, measured;
- :mod:`~ddp_lab.parallel.compare`: one model trained with DDP, ZeRO-1 and FSDP under
  torchrun (CPU with gloo, or GPUs with NCCL): weights and per-rank memory side by side;
- :mod:`~ddp_lab.parallel.timeline`: stages with a fixed compute time, to measure a
  pipeline schedule's busy and idle time;
- :mod:`~ddp_lab.parallel.hybrid`: data x tensor x pipeline layouts: which ranks form which
  group, and memory and communication per step.

None of them holds an exercise's answer: where a demo needs one, it takes the student's
code as an argument (a function, or a file next to the notebook).
"""

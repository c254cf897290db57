"""The ``make labN`` workloads: each lab's run through the trainer on every GPU of a node (or
2 CPU processes), with its results and figures in ``results/labN/``.

- :mod:`ddp_lab.workloads.lab3`: DDP scaling (``make lab3``; SLURM across nodes);
- :mod:`ddp_lab.workloads.lab5`: fp32, bf16, fp16 and accumulation (``make lab5``);
- :mod:`ddp_lab.workloads.lab6`: a fault under ``torchrun --max-restarts`` (``make lab6``);
- :mod:`ddp_lab.workloads.lab8`: a profiled DDP run, a trace per rank (``make lab8``);
- :mod:`ddp_lab.workloads.labrun`: what they share (hardware plan, data, launches).
"""

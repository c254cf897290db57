"""Lab 8 exercise 3's reference answer (instructor only): ``make_compress_hook``, the file
``compress.py`` the notebook's solution cell writes.

``FILES`` holds that file as source, for the tests and the grader.
"""

from __future__ import annotations

import inspect

import torch.distributed as dist


def make_compress_hook(dtype):
    """A DDP communication hook that sends each bucket in ``dtype`` and averages it over the
    group: bit for bit torch's ``fp16_compress_hook`` (float16) / ``bf16_compress_hook``."""

    def hook(process_group, bucket):
        n = dist.get_world_size(process_group)  # None: the default group
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(n)  # before the sum: n values may overflow float16
        work = dist.all_reduce(compressed, group=process_group, async_op=True)

        def decompress(fut):
            buffer.copy_(fut.value()[0])  # back into the bucket, in its own dtype
            return buffer

        return work.get_future().then(decompress)

    return hook


_HEAD = "import torch\nimport torch.distributed as dist"

#: The notebook's ``%%writefile compress.py`` file, as the reference writes it.
FILES = {"compress.py": _HEAD + "\n\n\n" + inspect.getsource(make_compress_hook)}

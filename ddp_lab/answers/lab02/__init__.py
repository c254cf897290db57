"""Lab 2's instructor part: reference answers (:mod:`.references`), what the grader adds to
the kit's judges (:mod:`.hidden`) and the typical mistakes (:mod:`.mistakes`)."""

from ddp_lab.answers.lab02.hidden import HIDDEN
from ddp_lab.answers.lab02.mistakes import FORGED_FILES, HANG_LOSES, HANGS, MISTAKES

__all__ = ["FORGED_FILES", "HANGS", "HANG_LOSES", "HIDDEN", "MISTAKES"]

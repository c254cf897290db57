"""``python -m ddp_lab.launch [--nproc N] [--timeout S] [-m] target -- args...``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ddp_lab.launch.result import LaunchFailed, LaunchTimeout
from ddp_lab.launch.start import torchrun


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ddp_lab.launch [--nproc N] [--timeout S] [-m] target -- args...``."""
    p = argparse.ArgumentParser(
        prog="python -m ddp_lab.launch",
        description="Run a script under torchrun --standalone with a timeout, compact "
        "per-rank output and no process left behind.",
    )
    p.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    p.add_argument("--timeout", type=float, default=300, help="seconds (default 300)")
    p.add_argument("--max-restarts", type=int, default=0)
    p.add_argument("--stream", choices=["summary", "all", "none"], default="summary")
    p.add_argument("--log-dir", help="keep per-rank log files under this folder")
    p.add_argument("-m", "--module", action="store_true", help="target is a module name")
    p.add_argument("target", help="script path, or module name with -m")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the target")
    ns = p.parse_args(argv)
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    try:
        res = torchrun(
            ns.target,
            args,
            nproc=ns.nproc,
            module=ns.module,
            timeout=ns.timeout,
            max_restarts=ns.max_restarts,
            stream=ns.stream,
            log_dir=ns.log_dir,
        )
    except LaunchTimeout as err:
        print(f"ddp_lab.launch: {err}", file=sys.stderr)
        return 124
    except LaunchFailed as err:
        print(f"ddp_lab.launch: {err}", file=sys.stderr)
        return err.result.returncode if err.result else 1
    except (ValueError, FileNotFoundError) as err:
        print(f"ddp_lab.launch: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())

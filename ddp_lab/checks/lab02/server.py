"""What lab 2's two parameter servers share: the training problem, the checker's recording
optimizer and gradient function, the reference trajectory, the judge.

Each run trains ``params`` (a 1-D tensor, float32 or float64) for ``steps`` steps on a
least-squares problem split over the workers: worker ``w`` (rank ``w``, ``1 .. n - 1``) holds
its own ``X_w, y_w`` and its gradient is ``X_w^T (X_w p - y_w) / m_w``. Rank 0, the server,
holds the optimizer (SGD with momentum, built by the checker) and computes no gradient.

The checker records, in the ranks (the student's code never sees it):

- on every worker, the parameters each call of its ``grad_fn`` saw;
- on the server, ``params.grad`` at each ``optimizer.step()`` and the parameters after it;
- on every rank, the parameters at the end.

The oracle (:func:`trajectory`) replays the run in one process: with staleness ``s`` the
gradient of step ``t`` is computed on ``p[max(0, t - s)]`` (``p[k]``: the parameters after ``k``
optimizer steps, ``p[0]`` the initial ones), the server averages the workers' gradients and
takes one SGD step. ``s = 0`` is the synchronous server.
"""

from __future__ import annotations

import math

import torch

from ddp_lab.checks.failure import CheckFailed, is_close
from ddp_lab.checks.lab02 import common
from ddp_lab.checks.values import kind, randint, uniform

SERVER_HINT = (
    "Does every worker push before it pulls, and does the server receive every worker's "
    "gradient before it sends the parameters back? With staleness, the server cannot wait for "
    "a worker that is itself waiting to push: send the parameters with dist.isend"
)


# --------------------------------------------------------------------------- the problem


def make_run(gen: torch.Generator, ranks: int, steps: int, dtype, staleness: int = 0) -> dict:
    """One training run on ``ranks`` ranks: ``ranks - 1`` workers with shards of different
    sizes, ``d`` features (1 or 3 to 9), a learning rate and a momentum drawn from ``gen``."""
    d = 1 if steps == 1 else randint(gen, 3, 9)
    sizes = [randint(gen, 2, 4) + 3 * w for w in range(ranks - 1)]  # all different
    truth = torch.randn(d, generator=gen, dtype=torch.float64)
    xs = [torch.randn(m, d, generator=gen, dtype=torch.float64) / math.sqrt(d) for m in sizes]
    ys = [x @ truth + 0.1 * torch.randn(len(x), generator=gen, dtype=torch.float64) for x in xs]
    init = 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)
    return {
        "ranks": ranks,
        "steps": steps,
        "staleness": staleness,
        "lr": uniform(gen, 0.1, 0.4),
        "momentum": uniform(gen, 0.3, 0.9),
        "init": init.to(dtype),
        "xs": [x.to(dtype) for x in xs],
        "ys": [y.to(dtype) for y in ys],
    }


def gradient(x: torch.Tensor, y: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The least-squares gradient of one shard at ``p``: ``X^T (X p - y) / m``."""
    return x.T @ (x @ p - y) / len(x)


class SGD:
    """The optimizer the checker hands the student's server: SGD with momentum, computed
    step for step as ``torch.optim.SGD`` computes it on CPU (the oracle uses torch's own).

    Built instead of ``torch.optim.SGD`` because the first construction of a torch optimizer
    in a process imports ``torch._dynamo``: seconds on a busy grading host, in every job.

    Example:
        >>> p = torch.zeros(2)
        >>> opt = SGD([p], lr=0.5, momentum=0.9)
        >>> p.grad = torch.ones(2)
        >>> opt.step(); opt.step(); p
        tensor([-1.4500, -1.4500])
    """

    def __init__(self, params, lr: float, momentum: float = 0.0):
        self.param_groups = [{"params": list(params), "lr": lr, "momentum": momentum}]
        self.state: dict = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients (``None``, or zeros)."""
        for p in self.param_groups[0]["params"]:
            p.grad = None if set_to_none or p.grad is None else torch.zeros_like(p.grad)

    @torch.no_grad()
    def step(self, closure=None):
        """One step: ``buf = momentum * buf + grad`` (``grad`` at the first step), then
        ``p -= lr * buf``, for every parameter that has a gradient."""
        group = self.param_groups[0]
        for p in group["params"]:
            if p.grad is None:
                continue
            buf = self.state.get(id(p))
            if buf is None or not group["momentum"]:
                buf = torch.clone(p.grad).detach()
            else:
                buf.mul_(group["momentum"]).add_(p.grad)
            self.state[id(p)] = buf
            p.add_(buf, alpha=-group["lr"])


def optimizer(run: dict, params: torch.Tensor):
    """The server's optimizer in the ranks: :class:`SGD` with the run's rate and momentum."""
    return SGD([params], lr=run["lr"], momentum=run["momentum"])


def trajectory(run: dict, version=None, combine=None) -> list[torch.Tensor]:
    """The parameters after each step, ``[p0, p1, ..., pT]``, replayed in one process.

    Args:
        run: the run's inputs.
        version: ``t -> k``: the step whose parameters the gradients of step ``t`` use
            (default ``max(0, t - staleness)``).
        combine: ``[gradients] -> gradient`` the server applies (default: their mean).
    """
    s = run["staleness"]
    version = version or (lambda t: max(0, t - s))
    combine = combine or (lambda gs: sum(gs) / len(gs))
    p = run["init"].clone()
    opt = torch.optim.SGD([p], lr=run["lr"], momentum=run["momentum"])  # torch's own
    out = [p.clone()]
    for t in range(run["steps"]):
        at = out[version(t)]
        p.grad = combine([gradient(x, y, at) for x, y in zip(run["xs"], run["ys"], strict=True)])
        opt.step()
        out.append(p.detach().clone())
    return out


# --------------------------------------------------------------------------- one rank


def one_run(fn, run: dict, rank: int, stale: bool) -> dict:
    """The student's server on this rank for one run; what the checker recorded."""
    params = run["init"].clone()
    out: dict = {}
    if rank == 0:
        opt, grads, after = optimizer(run, params), [], []
        step = opt.step

        def recorded_step(*args, **kwargs):
            g = params.grad
            grads.append(g.detach().clone() if isinstance(g, torch.Tensor) else None)
            result = step(*args, **kwargs)
            after.append(params.detach().clone())
            return result

        opt.step = recorded_step
        grad_fn = None
        out.update(grads=grads, after=after)
    else:
        x, y, points = run["xs"][rank - 1], run["ys"][rank - 1], []

        def grad_fn(p):
            points.append(p.detach().clone() if isinstance(p, torch.Tensor) else None)
            return gradient(x, y, p)

        opt = None
        out.update(points=points)
    args = (params, opt, grad_fn, run["steps"]) + ((run["staleness"],) if stale else ())
    returned = fn(*args)
    out["final"] = params
    out["returned"] = returned if isinstance(returned, torch.Tensor) else None
    return out


# --------------------------------------------------------------------------- the judge


def _where(run: dict) -> str:
    n, s = run["ranks"], run["staleness"]
    dtype = str(run["init"].dtype).removeprefix("torch.")
    stale = f", staleness {s}" if s else ""
    return (
        f"{n} ranks (a server and {n - 1} worker{'s' * (n > 2)}), {run['steps']} step(s), "
        f"{run['init'].numel()} parameter(s), {dtype}{stale}"
    )


def _close(got, want: torch.Tensor, tol) -> bool:
    return is_close(got, want, *tol)


def _counts(run: dict, got: list) -> str | None:
    at, steps = _where(run), run["steps"]
    server = got[0]
    if len(server["after"]) != steps:
        return (
            f"{at}: the server called optimizer.step() {len(server['after'])} time(s); "
            f"expected {steps}, one per step"
        )
    for w in range(1, run["ranks"]):
        if len(got[w]["points"]) != steps:
            return (
                f"{at}: worker {w} computed {len(got[w]['points'])} gradient(s); expected "
                f"{steps}, one per step"
            )
    return None


def _points(run: dict, got: list, want: list, tol, stale: bool) -> str | None:
    at, s = _where(run), run["staleness"]
    for w in range(1, run["ranks"]):
        points = got[w]["points"]
        stuck = _close(got[w]["final"], want[0], tol) and not _close(want[-1], want[0], tol)
        stuck = stuck and not _close(got[w]["returned"], want[-1], tol)
        if stuck and all(_close(q, want[0], tol) for q in points):
            return (
                f"{at}: worker {w} computed every gradient on the initial parameters and ends "
                "with them: the workers never pulled the new parameters from the server (after "
                "each step the server sends them; the worker receives them into params)"
            )
        for t, point in enumerate(points):
            v = max(0, t - s)
            if _close(point, want[v], tol):
                continue
            seen = next((k for k, p in enumerate(want) if _close(point, p, tol)), None)
            said = f"{at}: worker {w} computed the gradient of step {t} on "
            if seen is None:
                return said + f"parameters the server never held ({kind(point)})"
            said += f"the parameters after step {seen}; expected those after step {v}"
            if not stale:
                return said + " (synchronous: pull the new parameters after every push)"
            if seen < v:
                return (
                    f"{said}: {t - seen} step(s) behind, more than the staleness bound {s} "
                    "allows (off by one?): pull before you compute when you would otherwise "
                    "be more than `staleness` steps behind"
                )
            return (
                f"{said}: fresher than the rule asks (max(0, t - staleness)): a worker waits "
                "only for the parameters it needs"
            )
    return None


def _grads(run: dict, got: list, want: list, tol) -> str | None:
    at, s, n = _where(run), run["staleness"], run["ranks"]
    pairs = list(zip(run["xs"], run["ys"], strict=True))
    for t, g in enumerate(got[0]["grads"]):
        each = [gradient(x, y, want[max(0, t - s)]) for x, y in pairs]
        mean = sum(each) / len(each)
        if _close(g, mean, tol):
            continue
        said = f"{at}: at step {t} the server's params.grad "
        if g is None:
            return said + "was not set: put the workers' average into params.grad, then step"
        if n > 2 and _close(g, mean * (n - 1), tol):
            return said + (
                "is the sum of the workers' gradients: average them (divide by the number of "
                "workers, n - 1)"
            )
        if _close(g, mean * (n - 1) / n, tol):
            return said + (
                "is their sum divided by n: the server computes no gradient, so divide by the "
                "number of workers, n - 1"
            )
        return said + f"is not the mean of the workers' gradients ({kind(g)})"
    return None


def problem(run: dict, got: list, stale: bool) -> str | None:
    """The first thing wrong with one run on every rank, or None."""
    if len(got) != run["ranks"] or any(not isinstance(g, dict) for g in got):
        return f"expected the results of {run['ranks']} ranks, got {len(got)}"
    tol = common.tolerance(run["init"].dtype)
    want = trajectory(run)
    why = _counts(run, got) or _points(run, got, want, tol, stale) or _grads(run, got, want, tol)
    if why:
        return why
    at, steps = _where(run), run["steps"]
    for t, p in enumerate(got[0]["after"]):
        if not _close(p, want[t + 1], tol):
            return (
                f"{at}: after step {t} the server's parameters differ from one SGD step with "
                "the workers' mean gradient: step the optimizer the server was given, once"
            )
    for r, out in enumerate(got):
        if _close(out["final"], want[steps], tol):
            continue
        who = "the server" if r == 0 else f"worker {r}"
        if _close(out["returned"], want[steps], tol):
            return f"{at}: {who} returned the final parameters but `params` is not updated in place"
        seen = next((k for k, p in enumerate(want) if _close(out["final"], p, tol)), None)
        after = f" (those after step {seen})" if seen is not None else ""
        return (
            f"{at}: {who} ends with other parameters than the server's last ones{after}: "
            "every rank must end with the final parameters"
        )
    return None


def judge(stale: bool):
    """The oracle judge of a parameter-server exercise."""

    def check(inputs: dict, outputs: dict) -> str:
        cases = outputs.get("cases", []) if isinstance(outputs, dict) else []
        if len(cases) != len(inputs["cases"]):
            raise CheckFailed(f"expected {len(inputs['cases'])} jobs, got {len(cases)}")
        for case, ranks in zip(inputs["cases"], cases, strict=True):
            for i, run in enumerate(case["runs"]):
                got = [
                    ranks[r][i] if r < len(ranks) and i < len(ranks[r]) else None
                    for r in range(run["ranks"])
                ]
                if why := problem(run, got, stale):
                    raise CheckFailed(why)
        runs = [run for case in inputs["cases"] for run in case["runs"]]
        steps = common.numbers(sorted({r["steps"] for r in runs}))
        said = (
            f"on {common.worlds(inputs)} ranks, {steps} steps: every worker computed each "
            "gradient on the right parameters, the server applied their mean with its "
            "optimizer, and every rank ends with the trajectory of one process"
        )
        if stale:
            bounds = common.numbers(sorted({r["staleness"] for r in runs}))
            return f"stale_parameter_server (staleness {bounds}) {said}"
        return f"parameter_server {said}"

    return check


def run_rank(path: str, name: str, what: str, stale: bool):
    """The student process of a parameter-server exercise: the student's function ``name``
    from ``path`` (loaded once, watched), called once per run this rank takes part in."""

    def run(ns: dict, inputs: dict, case: dict, rank: int, world_size: int) -> list:
        found: dict = {}

        def load() -> None:
            fn = common.student_function(path, name)
            found["fn"] = common.watched(fn, what, SERVER_HINT)

        return common.each_run(
            case, rank, lambda r: one_run(found["fn"], r, rank, stale=stale), load
        )

    return run

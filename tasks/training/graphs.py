"""The whole training step (forward, backward, clipping, fused AdamW) captured in one CUDA graph per batch shape.

A step of a small BERT is some hundreds of kernel launches; replaying a captured graph launches them all at once,
so the host no longer paces the device. :class:`StepGraphs` runs the first batch of each shape as an ordinary step
(on a side stream: the warm-up the capture needs, which is also that batch's real step), then captures the step for
that shape with static input buffers; every later batch of the shape is copied into those buffers and the graph is
replayed. Shapes are bounded by the bucketed loader (:mod:`tasks.pretrain.shapes`), so a run captures a handful of
graphs. The optimizer must be capturable (:func:`make_capturable`: the learning rate a device tensor the scheduler
fills in place, the step counts on the device).

A word table trained sparsely (:class:`tasks.training.row_adam.SparseRows`, ``rows``) is captured too: its gathered
rows have a static shape (``fixed_shape``: one more than the batch's word slots, [PAD] padding), their ids are one
more input buffer (``word_row_ids``), and the graph takes those rows from the table, counts their gradient in the
clipping norm and updates them with :meth:`SparseRows.step_static` (every entry computed, the padding writing back
what it read: no host read, no shape that depends on the batch).

If a capture fails, one warning names the reason and the run goes on without graphs (the optimizer as it is, the
step eager or compiled as configured). Nothing here reads the device: losses and the grad norm are the graph's
static outputs, read only where the loop logs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tasks.training.loop import optimizer_step
from tasks.training.row_adam import SparseRows

log = logging.getLogger("lexiflow")

Step = Callable[[dict[str, Any]], tuple[Any, "torch.Tensor | None"]]


def wanted(enabled: bool, device: torch.device, world: int, name: str = "pretrain") -> bool:
    """Whether CUDA graphs run: asked for, on CUDA, one process (DDP runs without them). Says once, at INFO, why an
    option that is on is ignored."""
    if not enabled:
        return False
    if device.type != "cuda":
        log.info("%s: cuda_graphs is on but the device is %s: ignored (CUDA only)", name, device.type)
        return False
    if world > 1:
        log.info("%s: cuda_graphs is on but this is a %d-process DDP run: ignored (one process only)", name, world)
        return False
    return True


def make_capturable(opt: torch.optim.Optimizer, device: torch.device, capturable: bool = True) -> None:
    """Make ``opt`` (AdamW) ready for capture, in place: ``capturable`` set in every group, each group's learning
    rate a 0-dim float32 tensor on ``device`` (an LR scheduler fills it in place, so a replayed step reads the
    current value), step counts on the parameters' device. Called after the optimizer is built and again after a
    checkpoint is loaded into it (loading puts the saved groups' values back)."""
    for group in opt.param_groups:
        group["capturable"] = capturable
        # a float, or a tensor a checkpoint loaded onto the host: the step reads it on the device
        group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32, device=device)
    for p, state in opt.state.items():
        if "step" in state and torch.is_tensor(state["step"]):
            state["step"] = state["step"].to(device=p.device, dtype=torch.float32)


def side_stream() -> contextlib.AbstractContextManager:
    """The warm-up's stream: a side stream that first waits for the current one and that the current one waits for
    afterwards (as torch's CUDA graph guide requires before a capture)."""
    return _SideStream()


class _SideStream:
    def __enter__(self):
        self.main = torch.cuda.current_stream()
        self.side = torch.cuda.Stream()
        self.side.wait_stream(self.main)
        self.ctx = torch.cuda.stream(self.side)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)
        self.main.wait_stream(self.side)
        return False


def capture_step(step: Step, static: dict[str, Any]) -> Callable[[], tuple[Any, torch.Tensor | None]]:
    """Capture ``step(static)`` in a CUDA graph (nothing runs now); returns the replay, which returns the step's
    static outputs."""
    graph = torch.cuda.CUDAGraph()
    # thread_local: the loader's threads keep making their own CUDA calls (pinned memory) while this one captures
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        result = step(static)

    def replay():
        graph.replay()
        return result

    return replay


@dataclass
class _Captured:
    inputs: dict[str, Any]  # static buffers the graph reads
    replay: Callable[[], tuple[Any, torch.Tensor | None]]


class StepGraphs:
    """One training step per call, replayed from a CUDA graph captured per input shape (see the module).

    ``forward(**inputs)`` returns the model's output (``.loss`` the scalar to minimise) and runs under autocast;
    ``inputs`` maps names to tensors (or None, or a Python value such as a flag, which is part of the shape key).
    A call returns ``(output, pre-clip grad norm)`` as :func:`tasks.training.loop.optimizer_step` does.

    With ``rows`` (a sparse word table, one process) ``inputs`` holds ``word_row_ids`` (:meth:`SparseRows.index`'s
    row ids, after the batch's ``index``) and ``forward`` takes the rows as ``word_rows``."""

    def __init__(self, forward: Callable[..., Any], opt: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                 clip: float | None, capture: Callable[..., Callable[[], Any]] | None = None,
                 warm_stream: Callable[[], contextlib.AbstractContextManager] | None = None, name: str = "pretrain",
                 rows: SparseRows | None = None):
        self.forward, self.opt, self.params, self.clip, self.name = forward, opt, list(params), clip, name
        self.rows = rows
        self.capture = capture or capture_step
        self.warm_stream = warm_stream or side_stream
        self.graphs: dict[tuple, _Captured] = {}
        self.failed: str | None = None  # why capturing stopped (then every step runs as without graphs)
        self.replays = 0

    @staticmethod
    def key(inputs: dict[str, Any]) -> tuple:
        """What one graph serves: each tensor's shape and dtype, every other value as it is."""
        return tuple((k, (tuple(v.shape), v.dtype) if torch.is_tensor(v) else v) for k, v in inputs.items())

    def eager(self, inputs: dict[str, Any]) -> tuple[Any, torch.Tensor | None]:
        """The step without a graph: exactly the loop's ordinary step."""
        if self.rows is None:
            out = self.forward(**inputs)
            return out, optimizer_step(self.opt, out.loss, self.params, self.clip)
        inputs = dict(inputs)
        word_rows = self.rows.take(inputs.pop("word_row_ids"))
        out = self.forward(**inputs, word_rows=word_rows)
        return out, optimizer_step(self.opt, out.loss, self.params, self.clip, self.rows)

    def _captured_step(self, static: dict[str, Any]) -> tuple[Any, torch.Tensor | None]:
        """What the graph holds: forward, backward, clipping, optimizer step (the gradients were set to None before
        the capture, so backward writes them afresh on every replay, into the graph's own memory). A sparse word
        table's rows are taken from the table inside the graph (a leaf of static memory whose gradient the graph's
        backward writes), clipped with the rest and stepped at the first group's LR, as the ordinary step does."""
        if self.rows is None:
            out = self.forward(**static)
            out.loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(self.params, self.clip) if self.clip else None
            self.opt.step()
            return out, gnorm
        inputs = dict(static)
        row_ids = inputs.pop("word_row_ids")
        word_rows = self.rows.rows_of(row_ids)
        out = self.forward(**inputs, word_rows=word_rows)
        out.loss.backward()
        params = [*self.params, word_rows] if word_rows.grad is not None else self.params
        gnorm = torch.nn.utils.clip_grad_norm_(params, self.clip) if self.clip else None
        self.opt.step()
        self.rows.step_static(row_ids, word_rows, self.opt.param_groups[0]["lr"])
        return out, gnorm

    def __call__(self, inputs: dict[str, Any]) -> tuple[Any, torch.Tensor | None]:
        """One step: replayed when this shape has a graph, else run (on a side stream) and then captured."""
        if self.failed is not None:
            return self.eager(inputs)
        key = self.key(inputs)
        graph = self.graphs.get(key)
        if graph is not None:
            for k, v in inputs.items():
                if torch.is_tensor(v):
                    graph.inputs[k].copy_(v, non_blocking=True)
            self.replays += 1
            return graph.replay()
        with self.warm_stream():  # this batch's real step, and the capture's warm-up
            result = self.eager(inputs)
        static = {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}
        try:
            self.opt.zero_grad(set_to_none=True)
            self.graphs[key] = _Captured(static, self.capture(self._captured_step, static))
        except Exception as e:  # noqa: BLE001 - any failure: one warning, then the run goes on without graphs
            self.fail(e)
        else:
            shape = ", ".join(f"{k} {list(v.shape)}" for k, v in static.items() if torch.is_tensor(v))
            log.info("%s: CUDA graph %d captured (%s)", self.name, len(self.graphs), shape)
        return result

    def fail(self, e: BaseException) -> None:
        """Stop capturing for the rest of the run, with one warning naming why."""
        why = str(e).strip().splitlines()[0] if str(e).strip() else ""
        self.failed = f"{type(e).__name__}: {why}" if why else type(e).__name__
        self.graphs.clear()
        self.opt.zero_grad(set_to_none=True)
        log.warning("%s: CUDA graph capture failed (%s); the run goes on without CUDA graphs", self.name,
                    self.failed)

"""A stop that comes at once, anywhere: SIGTERM in every phase of the pretrain stage (reading and packing, the first
step that compiles, the held-out evaluation, a checkpoint save, twice during a save) ends the process within 15 s with
exit code 143 and lexiflow's resume line as its last line; the rerun ends on the uninterrupted run's bytes. Also
fine-tuning's evaluation, and the CLI (in a terminal and in a log file), where the line comes after Prefect's.

Each phase is reached the way the crash tests reach theirs (``LEXIFLOW_PAUSE_IN``), except reading and packing,
which is made slow with a slow corpus, so that only a poll between rows can stop it in time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

from tasks.training.checkpoint import KILL_AFTER_ENV, latest_state
from tasks.training.preempt import GRACE_S
from tests.test_checkpoint import LOCAL_OPS, TINY, _train

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCRIPT = textwrap.dedent("""
    import json, logging, sys, time
    from pathlib import Path
    import fsspec
    from tasks.pretrain.data import rows_of
    from tasks.pretrain.train import train
    from tests.test_pretrain import WV, V, W, _cfg, _rows

    spec = json.loads(sys.argv[1])
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    rows = rows_of(_rows())
    if spec.get("slow_rows"):  # a corpus that takes minutes to read: only a poll between rows stops it in time
        def rows(rank=0, world=1):
            Path(spec["marker"]).write_text("reading")
            for r in _rows(n_docs=400):
                time.sleep(0.05)
                yield r
    train(_cfg(**spec["cfg"]), rows, V, WV, W, fsspec.filesystem("file"), spec["path"], progress=False)
""")


def _start(tmp_path: Path, ckpt: Path, cfg: dict, marker: Path, env: dict | None = None, **spec) -> subprocess.Popen:
    script = tmp_path / "stop_run.py"
    script.write_text(SCRIPT)
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0", "LEXIFLOW_PAUSE_MARKER": str(marker),
                **(env or {})}
    arg = json.dumps({"cfg": cfg, "path": str(ckpt), "marker": str(marker), **spec})
    return subprocess.Popen([sys.executable, str(script), arg], cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(proc: subprocess.Popen, marker: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)


def _stop(proc: subprocess.Popen, signals: int = 1) -> tuple[float, str]:
    """SIGTERM (``signals`` times, a second apart); (seconds from the first to the exit, the last line of stderr)."""
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    for _ in range(signals - 1):
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - t
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    return took, [ln for ln in err.splitlines() if ln.strip()][-1]


def _line(where: str, how: str) -> str:
    return f"WARNING lexiflow: pretrain stopped by SIGTERM {where}; run the same command again to {how}"


def test_sigterm_while_reading_and_packing_stops_between_two_rows(tmp_path):
    """Packing a corpus of minutes: a SIGTERM stops it at the next row, well before the watchdog would."""
    marker = tmp_path / "reading"
    proc = _start(tmp_path, tmp_path / "ck", {**TINY, "data": {**TINY["data"], "heldout_frac": 0.0}}, marker,
                  slow_rows=True)
    _wait_for(proc, marker)
    took, last = _stop(proc)
    assert took < 15.0, f"{took:.1f} s"  # the promise; the time itself includes the interpreter's exit on a busy host
    # a poll stopped it, not the watchdog: the line came through logging (the watchdog writes it bare)
    assert last == _line("while reading and packing the training rows", "run the stage again")
    assert latest_state(fsspec.filesystem("file"), str(tmp_path / "ck")) is None


def _checkpoint_at_step_2(tmp_path: Path, ckpt: Path, cfg: dict) -> None:
    """A run killed right after its first checkpoint (step 2) was published."""
    proc = _start(tmp_path, ckpt, cfg, tmp_path / "unused", env={KILL_AFTER_ENV: str(LOCAL_OPS.index("2:rename") + 1)})
    proc.communicate(timeout=300)
    assert proc.returncode == 137
    assert latest_state(fsspec.filesystem("file"), str(ckpt)).step == 2


@pytest.fixture(scope="module")
def uninterrupted_eval() -> dict[str, bytes]:
    return _train(**EVAL_CFG)


EVAL_CFG = dict(eval_every=4, data={**TINY["data"], "heldout_frac": 0.5})  # held-out documents: 4 batches


@pytest.mark.heavy  # a few training subprocesses each: make test-heavy
def test_sigterm_during_the_held_out_evaluation_checkpoints_the_step_and_the_rerun_writes_its_row(
        tmp_path, uninterrupted_eval):
    ckpt, marker = tmp_path / "ck", tmp_path / "eval"
    proc = _start(tmp_path, ckpt, {**TINY, **EVAL_CFG}, marker, env={"LEXIFLOW_PAUSE_IN": "pretrain.eval"})
    _wait_for(proc, marker)
    took, last = _stop(proc)
    assert took < 15
    assert last == _line("during the held-out evaluation at step 4/6; checkpoint written",
                         "resume from this checkpoint")
    state = latest_state(fsspec.filesystem("file"), str(ckpt))
    assert state.step == 4 and state.row_pending and [r["step"] for r in state.log] == [2]
    assert _train(fsspec.filesystem("file"), str(ckpt), **EVAL_CFG) == uninterrupted_eval


@pytest.mark.heavy
def test_sigterm_in_a_phase_that_never_polls_is_ended_by_the_watchdog_and_resumes_from_the_last_checkpoint(
        tmp_path, uninterrupted_eval):
    """A phase that cannot look at the flag (a compilation, a long kernel, a blocked read; here the first step,
    parked): the watchdog ends the process after GRACE_S with the line, naming the checkpoint to resume from."""
    ckpt, marker = tmp_path / "ck", tmp_path / "first-step"
    _checkpoint_at_step_2(tmp_path, ckpt, {**TINY, **EVAL_CFG})
    proc = _start(tmp_path, ckpt, {**TINY, **EVAL_CFG}, marker, env={"LEXIFLOW_PAUSE_IN": "pretrain.first-step"})
    _wait_for(proc, marker)
    took, last = _stop(proc)
    assert GRACE_S <= took < 15
    # not through logging (the stuck main thread may hold its lock): the bare line
    assert last == _line("while running the first step", "resume from the checkpoint at step 2").split(": ", 1)[1]
    assert _train(fsspec.filesystem("file"), str(ckpt), **EVAL_CFG) == uninterrupted_eval


@pytest.mark.heavy
@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_during_a_checkpoint_save_lets_it_publish_even_when_sent_twice(tmp_path, signals, uninterrupted_eval):
    """Parked in the first save between its weights and its optimizer file, SIGTERM (and a second one, which ends
    the process at once anywhere else): the save publishes, the process stops there, the rerun gives the same bytes."""
    ckpt, marker = tmp_path / "ck", tmp_path / "save"
    proc = _start(tmp_path, ckpt, {**TINY, **EVAL_CFG}, marker,
                  env={"LEXIFLOW_PAUSE_IN": "checkpoint", "LEXIFLOW_PAUSE_SIGNALS": str(signals)})
    _wait_for(proc, marker)
    took, last = _stop(proc, signals)
    assert took < 15
    assert last.endswith("pretrain stopped by SIGTERM at step 2/6; checkpoint written; run the same command again to "
                         "resume from this checkpoint") or last.endswith(
        "pretrain stopped by SIGTERM while saving the checkpoint of step 2/6; run the same command again to resume "
        "from the checkpoint at step 2"), last  # the stage's own stop, or the watchdog's right after the publish
    assert latest_state(fsspec.filesystem("file"), str(ckpt)).step == 2
    assert _train(fsspec.filesystem("file"), str(ckpt), **EVAL_CFG) == uninterrupted_eval


def test_fine_tuning_stops_between_two_dev_batches_with_one_line(caplog):
    """fit() (fine-tuning, NER): a SIGTERM during the dev evaluation stops it at the next batch the task's predict
    loop polls, with one line (the stage runs again)."""
    from tasks.training.loop import fit
    from tasks.training.preempt import Preempted, poll
    from tests.test_loop import _Cfg, _toy

    model, x, y = _toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def batch_loss(model, idx):
        return ((model(x[idx]) - y[idx]) ** 2).mean(), len(idx), len(idx)

    def evaluate(model, batches, outs):
        for i in range(3):  # the dev batches of a predict loop
            poll()
            if i == 1:
                os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the dev evaluation went on after the signal")

    with pytest.raises(Preempted) as e:
        fit(model, opt, np.ones(len(x), np.int64), batch_loss, evaluate, _Cfg,
            ("epoch", "lr", "train_loss", "improved"), name="finetune")
    assert e.value.code == 128 + signal.SIGTERM
    assert e.value.line == "finetune stopped by SIGTERM while evaluating epoch 1 on dev; run the same command again " \
                           "to run the stage again"
    assert [r.getMessage() for r in caplog.records if "stopped by" in r.getMessage()] == [e.value.line]


# ----------------------------------------------------------------------------- through the CLI


@pytest.fixture(scope="module")
def cli(tiny_inputs, tmp_path_factory, prefect_server) -> dict:
    import yaml

    from tests.conftest import tiny_config_data

    root = tmp_path_factory.mktemp("stop")
    data = tiny_config_data(tiny_inputs, str(root / "store"), pretrain={
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "ffn_size": 64, "max_len": 64},
        "data": {"max_seq_len": 64, "batch_size": 8, "bucket_batches": 4},
        "steps": 6, "warmup_steps": 1, "log_every": 2, "checkpoint_every": 2, "threads": 1, "device": "cpu"})
    (root / "cfg.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    return {"root": root, "config": str(root / "cfg.yaml"), "api": prefect_server}


def _cli(cli: dict, store: str, pause: str, marker: Path, stderr, *sets: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lexiflow", "run", "pretrain", "--config", cli["config"], "--set",
           f"store_uri={store}", *(a for s in sets for a in ("--set", s))]
    env = {**os.environ, "PREFECT_API_URL": cli["api"], "PYTHONHASHSEED": "0", "LEXIFLOW_PAUSE_IN": pause,
           "LEXIFLOW_PAUSE_MARKER": str(marker), "PYTHONPATH": str(REPO)}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr)


@pytest.mark.heavy  # the pipeline's data stages, then three CLI runs: make test-heavy
@pytest.mark.flow
@pytest.mark.parametrize("where, pause, sets, line", [
    ("log file", "pretrain", (), r"pretrain stopped by SIGTERM at step [24]/6; checkpoint written; run the same "
                                 r"command again to resume from this checkpoint"),
    ("terminal", "pretrain", (), r"pretrain stopped by SIGTERM at step [24]/6; checkpoint written; run the same "
                                 r"command again to resume from this checkpoint"),
    ("log file", "pretrain.first-step", ("pretrain.gpus=2",),
     r"pretrain stopped by SIGTERM while running the first step; run the same command again to run the stage again"),
])
def test_the_cli_ends_on_the_resume_line_after_prefects_crash_lines(cli, tmp_path, where, pause, sets, line):
    """``lexiflow run pretrain`` stopped by SIGTERM (paused after a checkpoint; under torchrun, in a first step that
    never polls, where the ranks' watchdogs end them): Prefect reports the crash of its task and flow runs, and the
    last line, in a log file (stderr to a file) and in a terminal (stderr a pty), is the resume line, within 15 s.
    One store: the second case resumes from the first one's checkpoint."""
    import pty
    import re

    store, marker = str(cli["root"] / "store"), tmp_path / "paused"
    if where == "terminal":
        primary, secondary = pty.openpty()
        proc = _cli(cli, store, pause, marker, secondary, *sets)
        os.close(secondary)
    else:
        log = open(tmp_path / "stderr.log", "wb")
        proc = _cli(cli, store, pause, marker, log, *sets)
    chunks: list[bytes] = []
    deadline = time.monotonic() + 400
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it paused"
        if where == "terminal":
            _drain(primary, chunks)
        time.sleep(0.1)
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    while proc.poll() is None:
        if where == "terminal":
            _drain(primary, chunks)
        time.sleep(0.05)
        assert time.monotonic() - t < 60
    took = time.monotonic() - t
    if where == "terminal":
        _drain(primary, chunks, final=True)
        os.close(primary)
        text = b"".join(chunks).decode("utf-8", "replace")
    else:
        log.close()
        text = (tmp_path / "stderr.log").read_text(encoding="utf-8", errors="replace")
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert took < 15, f"{took:.1f} s"
    assert "Crash detected!" in text, text[-3000:]  # Prefect's lines came, and the resume line after them
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text.replace("\r", "\n"))  # a terminal's colours and returns
    last = [ln for ln in plain.splitlines() if ln.strip()][-1].strip()
    assert re.fullmatch(line, last), text[-3000:]


@pytest.mark.heavy  # the pipeline's data stages (shared with the cases above), then one CLI run
@pytest.mark.flow
def test_the_cli_ended_by_the_watchdog_leaves_its_runs_crashed_and_the_resume_line_last(cli, tmp_path):
    """``lexiflow run pretrain`` on one process, stopped by SIGTERM in a phase that never polls (the first step):
    the watchdog ends the flow's own process, within 15 s, on the resume line; Prefect shows the flow run and the
    pretraining task runs Crashed with that line, none of them left Running."""
    import re

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId

    marker, log_path = tmp_path / "paused", tmp_path / "stderr.log"
    started = time.time()
    flow_runs = FlowFilter(name=FlowFilterName(any_=["pretrain"]))

    def this_run(client):
        runs = [r for r in client.read_flow_runs(flow_filter=flow_runs) if r.created.timestamp() >= started - 5]
        return max(runs, key=lambda r: r.created) if runs else None

    def step_running() -> bool:  # task runs reach the server as events: wait until the step's Running state has
        with get_client(sync_client=True) as client:
            run = this_run(client)
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))) \
                if run else []
        return any(t.name.startswith("pretrain-train") and t.state is not None and t.state.is_running()
                   for t in tasks)

    with open(log_path, "wb") as log:
        proc = _cli(cli, str(cli["root"] / "store"), "pretrain.first-step", marker, log)
        deadline = time.monotonic() + 400
        while not marker.exists() or not step_running():
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it paused"
            time.sleep(0.2)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        took = time.monotonic() - t
    text = log_path.read_text(encoding="utf-8", errors="replace")
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert GRACE_S <= took < 15, f"{took:.1f} s"
    last = [ln for ln in text.splitlines() if ln.strip()][-1].strip()
    assert re.fullmatch(r"pretrain stopped by SIGTERM while (compiling and )?running the first step; run the same "
                        r"command again to (resume from the checkpoint at step \d+|run the stage again)", last), text
    with get_client(sync_client=True) as client:
        run = this_run(client)
        assert (run.state.type.value, run.state.message) == ("CRASHED", last)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        states = {t.name.rsplit("-", 1)[0]: (t.state.type.value, t.state.message) for t in tasks}
        assert states["pretrain-train"] == ("CRASHED", last) and "RUNNING" not in {s for s, _ in states.values()}, \
            states


def _drain(fd: int, chunks: list[bytes], final: bool = False) -> None:
    import select

    while True:
        ready, _, _ = select.select([fd], [], [], 0.2 if final else 0)
        if not ready:
            return
        try:
            data = os.read(fd, 65536)
        except OSError:  # the terminal's other end closed
            return
        if not data:
            return
        chunks.append(data)


# ----------------------------------------------------------------------------- the hard exit tells Prefect


def test_hard_exit_hooks_run_in_turn_and_neither_a_failing_nor_a_hanging_one_holds_the_exit(capfd):
    """:func:`tasks.training.preempt.on_hard_exit`: what the watchdog calls before it ends the process. A hook that
    raises is named on stderr and the next still runs; one that hangs costs at most HOOK_WAIT_S; none is left
    registered after its block."""
    from tasks.training import preempt

    got: list[str] = []

    def fails(line: str) -> None:
        raise ConnectionError("the API is gone")

    def hangs(line: str) -> None:
        got.append("hang " + line)
        time.sleep(60)

    with preempt.on_hard_exit(fails), preempt.on_hard_exit(got.append), preempt.on_hard_exit(hangs):
        t = time.monotonic()
        preempt._run_exit_hooks("pretrain stopped by SIGTERM while compiling")
        took = time.monotonic() - t
    assert got == ["pretrain stopped by SIGTERM while compiling", "hang pretrain stopped by SIGTERM while compiling"]
    assert preempt.HOOK_WAIT_S <= took < preempt.HOOK_WAIT_S + 2
    assert "could not report the stop (ConnectionError: the API is gone)" in capfd.readouterr().err
    assert preempt._exit_hooks == []


CRASH_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import httpx
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.runtime import task_run
    from flows.stage import crash_reported
    from tasks.training import preempt

    @task(name="pretrain-train")
    def step():
        # a task that has run a while: the server has its Running state (task runs reach it as events)
        with get_client(sync_client=True) as client:
            for _ in range(300):
                try:
                    state = client.read_task_run(task_run.id).state  # None: recorded, its state not yet
                except (ObjectNotFound, httpx.HTTPError):  # not recorded yet, or the busy server answered an error
                    state = None
                if state is not None and state.is_running():
                    break
                time.sleep(0.1)
        print(os.environ["MARK"], flush=True)
        preempt._run_exit_hooks(sys.argv[1])  # what the stop watchdog does, then it ends the process
        os._exit(143)

    @flow(name="crash-report-check")
    def run():
        with crash_reported():
            step()

    run()
""")


@pytest.mark.flow
def test_a_watchdogs_hard_exit_leaves_the_flow_run_and_its_task_runs_crashed_with_the_line(prefect_server, tmp_path):
    """A flow process ended by the stop watchdog (os._exit, no exception for Prefect to see): the flow run and the
    task run that was running are Crashed on the real server, with the stop line as their message, not Running."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId

    script, mark = tmp_path / "crash.py", f"flow-run-{os.getpid()}-{time.time_ns()}"
    script.write_text(CRASH_SCRIPT)
    line = "pretrain stopped by SIGTERM while running the first step; run the same command again to run the stage again"
    env = {**os.environ, "PREFECT_API_URL": prefect_server, "PYTHONPATH": str(REPO), "MARK": mark}
    proc = subprocess.run([sys.executable, str(script), line], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 143 and mark in proc.stdout, proc.stderr[-3000:]
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["crash-report-check"])))
        run = max(runs, key=lambda r: r.created)
        assert run.state.type.value == "CRASHED" and run.state.message == line
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        assert [(t.name.split("-")[0:2], t.state.type.value, t.state.message) for t in tasks] == [
            (["pretrain", "train"], "CRASHED", line)]


def test_a_stop_that_leaves_no_time_for_a_save_keeps_the_last_published_checkpoint(tmp_path, caplog):
    """A stop whose checkpoint save, judged by how long this run's last save took, could not publish before the
    watchdog's deadline starts no save: the line names the last published checkpoint, the rerun's starting point.
    (The signal is raised by hand at step 3's log row, as if it had come long ago.)"""
    from tasks.pretrain.data import rows_of
    from tasks.pretrain.train import train
    from tasks.training import preempt
    from tasks.training.checkpoint import published
    from tests.test_pretrain import WV, V, W, _cfg, _rows

    stop = preempt.StopSignal("pretrain")  # not entered: only its flag is used

    def on_log(row):
        if row["step"] == 3:
            stop.signum, stop.since = signal.SIGTERM, time.monotonic() - preempt.SAVE_WAIT_S
    fs, ck = fsspec.filesystem("file"), str(tmp_path / "ck")
    cfg = _cfg(**{**TINY, "log_every": 1})
    with pytest.raises(preempt.Preempted) as e:
        train(cfg, rows_of(_rows()), V, WV, W, fs, ck, progress=False, on_log=on_log, stop=stop)
    assert e.value.line == ("pretrain stopped by SIGTERM at step 4/6; run the same command again to resume from the "
                            "checkpoint at step 2")
    assert [p["step"] for p in published(fs, ck)] == [2]
    assert not (tmp_path / "ck" / "step-00000004").exists()  # not started


def test_under_ddp_the_stop_flag_is_agreed_every_few_steps_as_many_as_fit_the_agreement_time(monkeypatch):
    """StopSignal.after_step under DDP (the collective stubbed): the first agreement after the first step, then
    every N steps, N the smallest of the ranks' proposals (about AGREE_S of measured steps); one process: the flag
    at once."""
    from tasks.training import collectives, preempt

    calls = []

    def max_ints(values):
        calls.append(values)
        return [values[0], max(values[1], -3)]  # another rank proposes 3 steps

    monkeypatch.setattr(collectives, "max_ints", max_ints)
    stop = preempt.StopSignal("pretrain")
    assert [stop.after_step(2) for _ in range(5)] == [False] * 5
    assert len(calls) == 3 and stop.every == 3  # after steps 1, 2 and 5; the next after step 8
    assert calls[0] == [0, -1]  # the first step's time is a compilation's: the next agreement one step later
    stop.signum = signal.SIGTERM
    assert [stop.after_step(2) for _ in range(3)] == [False, False, True]  # within every=3 steps
    assert preempt.StopSignal("x").after_step(1) is False
    assert stop.after_step(1) is True
    assert stop.save_fits(None) and preempt.StopSignal("x").save_fits(100.0)  # unmeasured, or no stop: saved
    stop.since = time.monotonic()
    assert stop.save_fits(1.0) and not stop.save_fits(preempt.SAVE_WAIT_S)

"""How a ``lexiflow`` command ends, through an installed-style console script (the file pip writes for
``lexiflow = lexiflow.cli:main``): offline, with the environment ``python -m lexiflow`` has, nothing sent or tried
over the network; a failed or stopped run's last line is ours (after Prefect's "Stopping temporary server" and crash
reports), in a terminal and in a log file; and whatever a command started (the temporary Prefect server, a local
Dask cluster, torchrun, loader workers) ends with it, ``kill -9`` included.

A ``sitecustomize`` on the path of every process the command starts records its environment and refuses (and
records) any connection or name lookup that leaves the machine."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.conftest import tiny_config_data

REPO = Path(__file__).resolve().parents[1]
KEYS = ("PYTHONHASHSEED", "PREFECT_SERVER_ANALYTICS_ENABLED", "DO_NOT_TRACK")

PROBE = textwrap.dedent('''
    import atexit, json, os, socket, sys
    _out = os.environ.get("LEXIFLOW_TEST_PROBE")
    if _out:
        _outbound = []
        _local = ("127.", "::1", "localhost", "0.0.0.0")

        def _dump():
            with open(os.path.join(_out, str(os.getpid()) + ".json"), "w") as f:
                json.dump({"argv": list(getattr(sys, "argv", [])), "outbound": _outbound,
                           "env": {k: os.environ.get(k) for k in KEYS}}, f)

        def _refuse(what):
            _outbound.append(str(what))
            _dump()

        _connect, _connect_ex, _gai = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

        def _remote(sock, addr):
            return (sock.family in (socket.AF_INET, socket.AF_INET6) and isinstance(addr, tuple)
                    and not str(addr[0]).startswith(_local))

        def connect(self, addr):
            if _remote(self, addr):
                _refuse(addr)
                raise OSError(101, "network is unreachable (offline test)")
            return _connect(self, addr)

        def connect_ex(self, addr):
            if _remote(self, addr):
                _refuse(addr)
                return 101
            return _connect_ex(self, addr)

        def getaddrinfo(host, *args, **kwargs):
            if host not in (None, "") and not str(host).startswith(_local):
                _refuse("dns:" + str(host))
                raise socket.gaierror(socket.EAI_NONAME, "offline test")
            return _gai(host, *args, **kwargs)

        socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo
        _dump()
        atexit.register(_dump)
'''.replace("KEYS", repr(KEYS)))


def console_script(path: Path) -> Path:
    """What pip writes for ``lexiflow = lexiflow.cli:main`` (pip's console-script template)."""
    path.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import re
        import sys
        from lexiflow.cli import main
        if __name__ == "__main__":
            sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
            sys.exit(main())
        """), encoding="utf-8")
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The script, the probe, a PREFECT_HOME of the module's own (the temporary server's database) and an
    environment as a user's shell has it: no PYTHONHASHSEED, no Prefect API, no telemetry setting."""
    root = tmp_path_factory.mktemp("cli_exit")
    probe_dir = root / "site"
    probe_dir.mkdir()
    (probe_dir / "sitecustomize.py").write_text(PROBE, encoding="utf-8")
    home = root / "prefect_home"
    home.mkdir()
    drop = {*KEYS, "PREFECT_API_URL", "LEXIFLOW_TEST_PROBE", "PYTHONPATH"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONPATH=os.pathsep.join([str(probe_dir), str(REPO)]), PREFECT_HOME=str(home),
               PREFECT_LOGGING_LEVEL="INFO", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300", COLUMNS="200")
    return {"root": root, "script": console_script(root / "lexiflow"), "env": env}


def _probes(directory: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]


def _probe_env(world, name: str) -> tuple[dict, Path]:
    d = world["root"] / name
    d.mkdir()
    return {**world["env"], "LEXIFLOW_TEST_PROBE": str(d)}, d


def _cli_process(probes: list[dict]) -> dict:
    """The probe of the process that ran the command (after main's re-execution: ``python -m lexiflow``)."""
    [cli] = [p for p in probes if p["argv"] and p["argv"][0].endswith(os.path.join("lexiflow", "__main__.py"))]
    return cli


# ------------------------------------------------------------------------------------------ fast: the mechanisms


def test_the_installed_script_has_python_m_lexiflows_environment(world):
    """Without PYTHONHASHSEED or a telemetry setting, the console script re-executes as ``python -m lexiflow`` with
    PYTHONHASHSEED=0 and telemetry off (server analytics and the client's DO_NOT_TRACK), as ``-m`` does."""
    envs = {}
    for name, cmd in {"script": [str(world["script"])], "module": [sys.executable, "-m", "lexiflow"]}.items():
        env, d = _probe_env(world, f"version-{name}")
        res = subprocess.run([*cmd, "--version"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and res.stdout.startswith("lexiflow "), res.stderr[-2000:]
        envs[name] = _cli_process(_probes(d))["env"]
    assert envs["script"] == envs["module"] == {"PYTHONHASHSEED": "0", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                                                "DO_NOT_TRACK": "1"}


def test_a_user_who_turns_telemetry_on_keeps_it_on():
    from lexiflow.cli import environment_defaults

    env = {"PREFECT_SERVER_ANALYTICS_ENABLED": "true", "PYTHONHASHSEED": "7"}
    environment_defaults(env)
    assert env == {"PREFECT_SERVER_ANALYTICS_ENABLED": "true", "PYTHONHASHSEED": "7"}  # no DO_NOT_TRACK added
    env = {"DO_NOT_TRACK": "0"}
    environment_defaults(env)
    assert env == {"DO_NOT_TRACK": "0", "PYTHONHASHSEED": "0", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def test_the_final_line_is_printed_after_every_later_exit_line(tmp_path):
    """The console script's last line waits for the exit: a line another library prints from its own atexit
    handler (Prefect's temporary server registers one when it starts) comes first, buffered stdout too."""
    code = textwrap.dedent("""
        import atexit, sys
        from lexiflow.cli.base import defer_final_line, final_line
        defer_final_line()
        print("a result on stdout")
        atexit.register(lambda: print("INFO | prefect - Stopping temporary server", file=sys.stderr))
        final_line("error: the one line")
        sys.exit(2)
    """)
    log = tmp_path / "log"
    with open(log, "w") as f:  # a log file that takes both streams
        res = subprocess.run([sys.executable, "-c", code], cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2
    assert log.read_text().splitlines() == ["a result on stdout", "INFO | prefect - Stopping temporary server",
                                            "error: the one line"]


def test_the_watchdog_ends_what_a_killed_command_started(tmp_path):
    """A process that started the watchdog, then a child that started a grandchild, is killed with SIGKILL: the
    child and the grandchild (reparented, still marked) are ended, and the watchdog exits."""
    code = textwrap.dedent("""
        import subprocess, sys, time
        from lexiflow.cli import reaper
        reaper.enable()
        reaper.start()
        child = ("import subprocess, sys, time; "
                 "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)")
        subprocess.Popen([sys.executable, "-c", child])
        time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 60
        while len(tree := psutil.Process(proc.pid).children(recursive=True)) < 3:  # watchdog, child, grandchild
            assert proc.poll() is None and time.monotonic() < deadline, tree
            time.sleep(0.1)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    _all_gone(tree, 15)


def test_a_command_run_inside_another_program_starts_no_watchdog(monkeypatch):
    """Only the console script is the command: a CliRunner call (a test, a notebook) marks nothing and starts
    nothing, so the host program's other children are never the watchdog's."""
    from lexiflow.cli import reaper

    monkeypatch.delenv(reaper.MARK_ENV, raising=False)
    # an in-process caller's state: another test of this worker may have run main(), which enables the watchdog
    monkeypatch.setattr(reaper, "_enabled", False)
    monkeypatch.setattr(reaper, "_watchdog", None)
    reaper.start()
    assert reaper._watchdog is None and reaper.MARK_ENV not in os.environ


def _all_gone(procs: list[psutil.Process], timeout: float) -> None:
    gone, alive = psutil.wait_procs(procs, timeout=timeout)
    left = [(p.pid, " ".join(p.cmdline())[:100]) for p in alive if p.is_running() and p.status() != "zombie"]
    for p in alive:  # never leave one behind, even when the assertion fails
        try:
            p.kill()
        except psutil.Error:
            pass
    assert not left, left


# ------------------------------------------------------------------------------- heavy: real runs of the script


def _profile(world, tiny_inputs, name: str, **extra) -> Path:
    path = world["root"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tiny_config_data(tiny_inputs, str(world["root"] / "store"), **extra)),
                    encoding="utf-8")
    return path


def _in_terminal(cmd: list[str], env: dict, timeout: float = 600) -> tuple[int, str]:
    """Run ``cmd`` with stdout and stderr on a pseudo-terminal; (exit code, what the terminal showed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed: every process holding it has ended
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(timeout=60), out.decode("utf-8", "replace").replace("\r\n", "\n")


def _lines(text: str) -> list[str]:
    return [ln for ln in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines() if ln.strip()]


@pytest.mark.heavy  # a temporary Prefect server and a prepare run: make test-heavy and CI run it
def test_a_tiny_run_through_the_script_is_offline_and_error_free(world, tiny_inputs):
    env, d = _probe_env(world, "run-prepare")
    res = subprocess.run([str(world["script"]), "run", "prepare", "--config", str(_profile(world, tiny_inputs, "ok"))],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["stage"] == "lexicon"
    assert "Starting temporary server" in res.stderr  # the temporary server ran (and was probed)
    assert not [ln for ln in (res.stdout + res.stderr).splitlines() if "ERROR" in ln], res.stderr[-3000:]
    probes = _probes(d)
    assert _cli_process(probes)["env"] == {"PYTHONHASHSEED": "0", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                                           "DO_NOT_TRACK": "1"}
    assert any("prefect.server.api.server:create_app" in p["argv"] for p in probes)  # the server was probed too
    assert [p["outbound"] for p in probes if p["outbound"]] == []  # nothing left the machine, nothing was tried


@pytest.mark.heavy  # a temporary Prefect server and prepare, twice: make test-heavy and CI run it
def test_a_failed_run_ends_with_our_line_after_prefects_in_a_log_file_and_a_terminal(world, tiny_inputs, tmp_path):
    bare = tmp_path / "bert-without-vocab"
    bare.mkdir()
    (bare / "config.json").write_text("{}", encoding="utf-8")
    cmd = [str(world["script"]), "run", "pretrain", "--config", str(_profile(world, tiny_inputs, "bare")),
           "--set", f"pretrain.init_from={bare}"]
    log = tmp_path / "run.log"
    with open(log, "w") as f:  # a log file: stdout and stderr, not a terminal
        code = subprocess.run(cmd, env=world["env"], cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                              timeout=900).returncode
    code_tty, shown = _in_terminal(cmd, world["env"])
    for rc, text in ((code, log.read_text()), (code_tty, shown)):
        lines = _lines(text)
        assert rc == 2, text[-3000:]
        assert lines[-1].startswith("error: ") and "no vocab.txt in the checkpoint directory" in lines[-1], lines[-5:]
        assert [ln for ln in lines if ln.startswith("error:")] == [lines[-1]]
        stopping = [i for i, ln in enumerate(lines) if "Stopping temporary server" in ln]
        assert stopping and stopping[-1] < len(lines) - 1, lines[-5:]  # Prefect's exit line, then ours


@pytest.mark.heavy  # pretraining under a temporary Prefect server: make test-heavy and CI run it
def test_sigterm_mid_pretraining_ends_with_the_resume_line_last(world, tiny_inputs, tmp_path):
    profile = _profile(world, tiny_inputs, "long", pretrain={
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "ffn_size": 64, "max_len": 64},
        "data": {"max_seq_len": 64, "batch_size": 8, "bucket_batches": 4}, "steps": 100000, "warmup_steps": 1,
        "log_every": 2, "checkpoint_every": 100000, "threads": 1, "device": "cpu"})
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([str(world["script"]), "run", "pretrain", "--config", str(profile)], env=world["env"],
                                cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 600
            while "pretrain step " not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    lines = _lines(log.read_text())
    assert proc.returncode == 128 + signal.SIGTERM, lines[-10:]
    assert "stopped by SIGTERM" in lines[-1] and "run the same command again to resume" in lines[-1], lines[-10:]
    assert any("Crash detected" in ln or "Stopping temporary server" in ln for ln in lines[:-1]), lines[-10:]


@pytest.mark.heavy  # a temporary Prefect server and a local Dask cluster: make test-heavy and CI run it
def test_kill_9_leaves_no_process_of_the_command_behind(world, tiny_inputs, tmp_path):
    """``lexiflow run prepare`` on a local Dask cluster, paused mid-stage (its temporary server, the cluster's
    nannies and workers all up), gets SIGKILL: every process it started is gone within seconds."""
    profile = _profile(world, tiny_inputs, "dask", runner={"kind": "dask", "dask_workers": 2})
    marker = tmp_path / "paused"
    env = {**world["env"], "LEXIFLOW_PAUSE_IN": "lexicon", "LEXIFLOW_PAUSE_MARKER": str(marker)}
    proc = subprocess.Popen([str(world["script"]), "run", "prepare", "--config", str(profile), "--set",
                             f"store_uri={tmp_path / 'store'}"], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err.log", "w"))
    try:
        deadline = time.monotonic() + 600
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err.log").read_text()[-3000:]
            time.sleep(0.2)
        tree = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in tree)
        assert "uvicorn" in names and "reaper.py" in names, names  # the temporary server and the watchdog
        assert sum("distributed" in " ".join(p.cmdline()) or "multiprocessing" in " ".join(p.cmdline())
                   for p in tree) >= 2, names  # the cluster's worker processes
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    _all_gone(tree, 20)

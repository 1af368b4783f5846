"""The task guides (``docs/guides/*.md``) run as written: every shell command in their ``bash`` blocks is run, or
checked, against a miniature of what ``make demo`` leaves behind (``.demo/inputs`` and ``.demo/store`` with a tiny
bundle promoted to production). A ``lexiflow`` command that takes seconds runs for real; ``lexiflow run`` (minutes
or hours) has its profile and ``--set`` overrides validated the way the CLI validates them, and the files it names
must exist; commands that need a server, a GPU, a download or the package registry are listed by name below and
covered elsewhere (``test_e2e.py``, ``test_relabel.py``, ``test_label_nightly.py``)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.registry import load_flow_config
from lexiflow.cli import app

ROOT = Path(__file__).resolve().parents[1]
GUIDES = ROOT / "docs" / "guides"
_FENCE = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)

# commands a guide shows that make test does not run, by their first words, and why
NOT_RUN = {
    ("make", "demo"): "the demo itself (minutes)",
    ("make", "install"): "the package registry",
    (".venv/bin/prefect",): "a Prefect server and worker: test_e2e.py, test_relabel.py",
    (".venv/bin/python", "-m", "flows.local_deploy"): "prefect deploy on a server: test_e2e.py",
    (".venv/bin/pip",): "the package registry",
    ("export",): "shell state",
    ("wget",): "a download",
    ("nvidia-smi",): "a GPU",
    ("df",): "the reader's disk",
    ("mkdir",): "the reader's disk",
    (".venv/bin/dask",): "a Dask cluster of several hosts: test_dask_runner.py",
    ("free",): "the reader's memory",
    ("kill",): "a running process: test_determinism.py, test_label.py",
    (".venv/bin/python", "-m", "flows.serve"): "serves until stopped: test_guides.py checks its deployments",
}


def shell_commands(markdown: str) -> list[list[str]]:
    """The commands of every ``bash`` block, one argv each: continuation lines joined, comments dropped, leading
    ``VAR=value`` assignments kept as words."""
    out = []
    for block in _FENCE.findall(markdown):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                out.append(words)
    return out


def test_shell_commands_joins_continuations_and_drops_comments():
    md = "x\n```bash\na --b 'c d' \\\n    --e f   # note\n# only a comment\n\ng h\n```\n```\nnot bash\n```\n"
    assert shell_commands(md) == [["a", "--b", "c d", "--e", "f"], ["g", "h"]]


def guide(name: str) -> list[list[str]]:
    return shell_commands((GUIDES / name).read_text(encoding="utf-8"))


def test_every_guide_is_in_the_nav_and_linked_from_the_readme():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    (section,) = [s["Guides"] for s in nav if isinstance(s, dict) and "Guides" in s]
    in_nav = {next(iter(e.values())) for e in section}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in sorted(GUIDES.glob("*.md")):
        rel = page.relative_to(ROOT / "docs").as_posix()
        assert rel in in_nav, f"{rel} is not under Guides in mkdocs.yml"
        assert f"docs/{rel}" in readme, f"README does not link docs/{rel}"


class Demo:
    """A miniature ``make demo`` tree in ``root``: inputs, a store with a tiny bundle promoted to production."""

    def __init__(self, root: Path, tiny_inputs: dict[str, str]):
        from tests.bundle_fixture import make_tiny_bundle
        from tests.test_label import GOOD

        self.root = root
        inputs = root / ".demo" / "inputs"
        shutil.copytree(Path(tiny_inputs["root"]) / "corpus", inputs / "corpus")
        shutil.copy(tiny_inputs["embeddings"], inputs / "tencent_sample.txt")
        rows = [(i % 2, GOOD[i % len(GOOD)]) for i in range(20)] + [(1, "")]
        (inputs / "sentiment.csv").write_text(
            "label,review\n" + "".join(f'{y},"{t}"\n' for y, t in rows), encoding="utf-8")
        (root / "configs").symlink_to(ROOT / "configs")
        self.bundle = make_tiny_bundle(str(root / ".demo" / "store"), reference=True)  # bundle-7: with a reference
        self.version = self.bundle.rsplit("/", 1)[1]
        self.tmp = root / "tmp"

    def path(self, word: str) -> str:
        """A guide's word with the reader's placeholders filled in and example roots moved under ``root``."""
        word = re.sub(r"(?<![\w.])/tmp/", str(self.tmp) + "/", word)
        return word.replace("<version>", self.version).replace("$PWD", str(self.root))

    def run(self, argv: list[str], monkeypatch) -> str:
        """Run (or check) one guide command in ``root``; returns what it printed."""
        argv = [self.path(w) for w in argv]
        while argv and re.match(r"^[A-Z_]+=", argv[0]):  # VAR=value command ...
            name, value = argv.pop(0).split("=", 1)
            monkeypatch.setenv(name, value)
        key = next((k for k in NOT_RUN if tuple(argv[: len(k)]) == k), None)
        if key is not None:
            return ""
        if argv[:2] == [".venv/bin/python", "-c"]:  # a one-liner: run in this interpreter (no second import of torch)
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                exec(compile(argv[2], "<guide>", "exec"), {"__name__": "__guide__"})
            return buf.getvalue()
        assert argv[0] == ".venv/bin/lexiflow", f"a guide command this test does not know: {shlex.join(argv)}"
        if argv[1] == "run":
            return self.check_run(argv[2:])
        res = CliRunner().invoke(app, argv[1:], prog_name="lexiflow", env={"COLUMNS": "200"})
        assert res.exit_code == 0, f"{shlex.join(argv)}\n{res.output[-3000:]}"
        return res.output

    def check_run(self, args: list[str]) -> str:
        """``lexiflow run FLOW --config C --set ...``: the config as the CLI loads it, and every file it names."""
        flow, config, sets = args[0], None, []
        rest = iter(args[1:])
        for word in rest:
            if word in ("--config", "-c"):
                config = next(rest)
            elif word == "--set":
                sets.append(next(rest))
            else:
                raise AssertionError(f"lexiflow run: an option this test does not know: {word}")
        cfg = load_flow_config(flow, config, sets)
        for s in sets:
            key, value = s.split("=", 1)
            if key.endswith("_uri") and value.startswith(".demo/"):
                assert list(self.root.glob(value)), f"{s}: no such file after the guide's earlier steps"
        return json.dumps(cfg.model_dump(mode="json"))


@pytest.fixture(scope="module")
def demo_tree(tiny_inputs, tmp_path_factory) -> Demo:
    pytest.importorskip("pandas")
    d = Demo(tmp_path_factory.mktemp("guide_demo"), tiny_inputs)
    res = CliRunner().invoke(app, ["promote", d.bundle, "--alias", "production", "--reason", "the tiny bundle"])
    assert res.exit_code == 0, res.output
    return d


@pytest.fixture
def demo(demo_tree, tmp_path, monkeypatch) -> Demo:
    """The demo tree as the current directory; the guides' example roots under /tmp/ go to this test's tmp_path."""
    monkeypatch.chdir(demo_tree.root)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    demo_tree.tmp = tmp_path
    return demo_tree


def run_guide(demo: Demo, name: str, monkeypatch) -> list[tuple[list[str], str]]:
    return [(argv, demo.run(argv, monkeypatch)) for argv in guide(name)]


# ----------------------------------------------------------------------------- fine-tune and label your own file


def test_finetune_guide_runs_on_the_sample(demo, monkeypatch):
    ran = run_guide(demo, "finetune-your-data.md", monkeypatch)
    runs = [json.loads(out) for argv, out in ran if argv[:2] == [".venv/bin/lexiflow", "run"]]
    assert len(runs) == 2
    for cfg in runs:  # the columns the guide names are the columns of the file it wrote
        ft = cfg["finetune"]
        assert (ft["data_uri"], ft["text_column"], ft["label_column"]) == (
            ".demo/inputs/my_reviews.parquet", "text", "sentiment")
    assert runs[1]["finetune"]["classes"] == "any" and runs[1]["promote"]["metric"] == "test_macro_f1"
    import pyarrow.parquet as pq

    table = pq.read_table(demo.root / ".demo/inputs/my_reviews.parquet")
    assert {"text", "sentiment"} <= set(table.column_names) and table.num_rows == 21
    (label_out,) = [out for argv, out in ran if argv[1:2] == ["label"]]
    summary = json.loads(label_out.strip().splitlines()[-1])
    assert summary["stats"]["in"] == 21 and summary["stats"]["rejected"] == {"missing_text": 1}, summary
    parts = sorted((demo.tmp / "labelled").glob("part-*.parquet"))
    cols = pq.read_table(parts[0]).column_names
    assert {"row_id", "prob", "label", "threshold", "bundle_version"} <= set(cols), cols


def test_finetune_guide_names_real_config_keys():
    """The keys in the guide's key table exist in the finetune/promote config (a renamed key fails here)."""
    from tasks.finetune.config import FinetuneConfig

    text = (GUIDES / "finetune-your-data.md").read_text(encoding="utf-8")
    keys = set(re.findall(r"`finetune\.(\w+)`", text))
    assert {"data_uri", "text_column", "label_column", "classes"} <= keys
    assert keys <= set(FinetuneConfig.model_fields), keys - set(FinetuneConfig.model_fields)
    with pytest.raises(Exception, match="classes"):
        load_flow_config("pipeline", ROOT / "configs/demo.yaml", ["finetune.classes=several"])


# ----------------------------------------------------------------------------- label every night


def guide_table(name: str) -> dict[str, str]:
    """First two cells of every table row whose first cell is one code span: ``{name: second cell}``."""
    text = (GUIDES / name).read_text(encoding="utf-8")
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `([\w.]+)` \| ([^|]*)\|", text, re.M)}


def test_nightly_guide_runs_on_the_sample(demo, monkeypatch):
    ran = run_guide(demo, "nightly-labelling.md", monkeypatch)
    labels = [json.loads(out.strip().splitlines()[-1]) for argv, out in ran if argv[1:2] == ["label"]]
    assert len(labels) == 2 and labels[0] == labels[1]  # the second night with the same input: the same version
    assert [p.name for p in (demo.tmp / "labelled" / "nightly").iterdir()] == [labels[0]["version"]]
    assert labels[0]["uri"].startswith(str(demo.tmp / "labelled" / "nightly") + "/")
    (promoted,) = [out for argv, out in ran if argv[1:2] == ["promote"]][-1:]
    assert f"bundle@production -> {demo.version}" in promoted
    (ls_out,) = [out for argv, out in ran if argv[1:2] == ["ls"]]
    assert demo.version in ls_out and "@production" in ls_out
    monitors = [(argv, out) for argv, out in ran if argv[1:2] == ["monitor"]]
    (trend,) = [out for argv, out in monitors if "--labels" not in argv]
    assert labels[0]["version"] in trend and json.loads(trend.strip().splitlines()[-1])["runs"] == 1
    assert (demo.tmp / "labelled" / "trend.png").exists()
    (realized,) = [out for argv, out in monitors if "--labels" in argv]  # late labels joined to the newest run
    assert f"labels joined to {labels[0]['version']}" in realized and "realized accuracy" in realized, realized
    assert (demo.tmp / "labelled" / "nightly" / labels[0]["version"] / "realized.json").exists()


def test_nightly_guide_matches_prefect_yaml_and_the_flows():
    import inspect

    from flows.label import label_flow

    deployments = {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
    import flows.settings

    nightly = deployments["label-nightly"]
    assert not {"bundle_uri", "input_uri", "output_root"} & set(nightly["parameters"])  # from the Variables
    table = guide_table("nightly-labelling.md")  # the variables the run reads, with their defaults
    names = {getattr(flows.settings, k) for k in ("STORE", "INCOMING", "OUTPUT_ROOT", "DATA_ROOT")}
    assert names <= set(table), set(table)
    assert table["lexiflow_data_root"] == f"`{flows.settings.DEFAULT_DATA_ROOT}`"
    defaults = dict(zip(("bundle", "input", "output_root"), flows.settings.label_roots(None, None, None, None)))
    assert defaults == {"bundle": "/data/lexiflow/store/bundle@production", "input": "/data/incoming/*.csv",
                        "output_root": "/data/labelled/nightly"}  # what the table's defaults say, outside a run
    assert nightly["schedules"][0]["cron"] == "30 3 * * *"
    assert "03:30 UTC" in (GUIDES / "nightly-labelling.md").read_text(encoding="utf-8")
    params = set(inspect.signature(label_flow.fn).parameters)
    runs = [argv for argv in guide("nightly-labelling.md") if argv[1:3] == ["deployment", "run"]]
    assert runs and runs[0][3] == f"{label_flow.name}/label-nightly"
    given = [w.split("=", 1) for w in runs[0] if "=" in w]
    assert {k for k, _ in given} <= params and all(json.loads(v) for _, v in given)
    trigger = deployments["relabel-on-promotion"]["triggers"][0]
    assert trigger["expect"] == ["lexiflow.bundle.promoted"]
    [standing] = flows.settings.standing_inputs()
    assert set(standing) == {"input_uri", "output_root", "options"}


def test_nightly_guide_serve_line_serves_the_nightly_labelling(monkeypatch):
    from flows.serve import deployments

    (argv,) = [a for a in guide("nightly-labelling.md") if "flows.serve" in a]
    env = dict(w.split("=", 1) for w in argv if re.match(r"^[A-Z_]+=", w))
    monkeypatch.chdir(ROOT)  # the profile path is relative to the serving process's working directory
    names = {d.name: d for d in deployments(env["LEXIFLOW_CONFIG"], env)}
    assert names["pipeline-weekly"].parameters == {"profile": env["LEXIFLOW_CONFIG"]}
    assert set(names) == {"pipeline-weekly", "label-nightly"}
    assert names["label-nightly"].parameters["input_uri"] == ".demo/inputs/sentiment.csv"
    assert names["label-nightly"].parameters["bundle_uri"] == ".demo/store/bundle@production"


# ----------------------------------------------------------------------------- your own corpus and vectors


def test_own_data_guide_runs_on_the_sample(demo, monkeypatch):
    """The quickstart's files are made, its pipeline command loads the template with every input found under
    data_dir (plain-text corpus, word2vec-format vectors, the labelled table), and its label command runs."""
    clean = demo.root / "clean-corpus"  # the sample corpus without the fixture's deliberately broken record
    clean.mkdir(exist_ok=True)
    for f in sorted(demo.root.glob(".demo/inputs/corpus/*.jsonl")):
        lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
        (clean / f.name).write_text("".join(ln for ln in lines if ln.rstrip().endswith("}")), encoding="utf-8")
    text = (GUIDES / "own-data.md").read_text(encoding="utf-8").replace(
        ".lexiflow/own-data/store/bundle/<version>", ".demo/store/bundle/<version>").replace(  # a built bundle
        ".demo/inputs/corpus/*.jsonl", "clean-corpus/*.jsonl")
    ran = [(argv, demo.run(argv, monkeypatch)) for argv in shell_commands(text)]
    [cfg] = [json.loads(out) for argv, out in ran if argv[:2] == [".venv/bin/lexiflow", "run"]]
    prep = cfg["prepare"]
    assert prep["corpus_uri"] == "my-data/corpus/*" and prep["embeddings_uri"] == "my-data/vectors.txt"
    assert list(demo.root.glob(prep["corpus_uri"])) and (demo.root / prep["embeddings_uri"]).is_file()
    assert (demo.root / cfg["finetune"]["data_uri"]).is_file() and cfg["label"]["input_uri"] == "@heldout"
    corpus = (demo.root / "my-data" / "corpus" / "part-0.txt").read_text(encoding="utf-8")
    assert "\n\n" in corpus and not corpus.lstrip().startswith("{")  # plain text, documents apart
    header = (demo.root / "my-data" / "vectors.txt").read_text(encoding="utf-8").split("\n", 1)[0].split()
    assert len(header) == 2 and all(h.isdigit() for h in header)  # word2vec text format
    [labelled] = [out for argv, out in ran if argv[1:2] == ["label"]]
    assert json.loads(labelled.strip().splitlines()[-1])["stats"]["out"] > 0, labelled[-2000:]


# ----------------------------------------------------------------------------- the full run


def test_full_run_guide_commands_are_valid_for_the_full_profile(demo, monkeypatch):
    ran = run_guide(demo, "full-run.md", monkeypatch)
    cfgs = [json.loads(out) for argv, out in ran if argv[1:2] == ["run"]]
    assert len(cfgs) == 3 and cfgs[1]["pretrain"]["device"] == "cuda" and cfgs[1]["pretrain"]["compile"]
    assert cfgs[2]["runner"] == {**cfgs[0]["runner"], "dask_address": "tcp://scheduler:8786"}
    urls = [w for argv, _ in ran if argv[0] == "wget" for w in argv if w.startswith("https://")]
    profile = (ROOT / "configs" / "full.yaml").read_text(encoding="utf-8")
    assert urls and all(u.rsplit("/", 1)[1] in profile for u in urls)  # the files the profile reads


def test_full_run_projection_is_the_profiles_tokens_at_the_measured_rate():
    """The token count is the profile's steps x batch x length, and the hours are that at the measured rates."""
    text = (GUIDES / "full-run.md").read_text(encoding="utf-8")
    pre = yaml.safe_load((ROOT / "configs" / "full.yaml").read_text(encoding="utf-8"))["pretrain"]
    steps, batch, length = pre["steps"], pre["data"]["batch_size"], pre["data"]["max_seq_len"]
    tokens = steps * batch * length
    assert f"{steps:,} × {batch} × {length} = **{tokens:,} token" in text
    for rate, shown in ((1.49e6, "0.3 h"), (664e3, "0.7 h")):
        assert f"{tokens / rate:,.0f} s: " in text and shown in text
        assert f"{tokens / rate / 3600:.1f} h" == shown
    assert "not a measured full run" in text and "projection" in text


# ----------------------------------------------------------------------------- CUDA torch


def test_cuda_guide_installs_the_pinned_torch_and_its_checks_run(demo, monkeypatch):
    pin = re.search(r"^torch==(\S+)", (ROOT / "constraints.txt").read_text(encoding="utf-8"), re.M).group(1)
    ran = run_guide(demo, "cuda-torch.md", monkeypatch)
    installs = [argv for argv, _ in ran if argv[:2] == [".venv/bin/pip", "install"]]
    assert len(installs) == 2
    for argv in installs:  # the same version as the constraints, installed under them, from an explicit index
        assert f"torch=={pin}" in argv and argv[argv.index("-c") + 1] == "constraints.txt"
        assert argv[argv.index("--index-url") + 1].startswith("https://")
    checks = [out.split() for argv, out in ran if argv[0] == ".venv/bin/python"]
    import torch

    assert checks[0] == [torch.__version__, str(torch.version.cuda), str(torch.cuda.is_available())]
    assert checks[1] == [str(torch.cuda.is_available())]
    (pretrain,) = [json.loads(out) for argv, out in ran if argv[1:2] == ["run"]]
    assert pretrain["pretrain"]["device"] == "cuda" and pretrain["pretrain"]["steps"] == 20


# ----------------------------------------------------------------------------- when a run stops


def test_stopped_label_run_resumes_as_the_guide_says(demo, monkeypatch):
    (label_argv,) = [argv for argv in guide("when-a-run-stops.md") if argv[1:2] == ["label"]]
    first = json.loads(demo.run(label_argv, monkeypatch).strip().splitlines()[-1])
    out = Path(first["uri"])
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "_manifest.json"}
    assert "_run.json" in files
    # a stop half way: the manifest never written and a part lost; the same command finishes the same bytes
    (out / "_manifest.json").unlink()
    part = sorted(p for p in files if p.startswith("part-"))[0]
    (out / part).unlink()
    again = json.loads(demo.run(label_argv, monkeypatch).strip().splitlines()[-1])
    assert again == first
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != "_manifest.json"} == files


def test_stopped_guide_commands_run_and_gc_keeps_the_production_bundle(demo, monkeypatch):
    ran = run_guide(demo, "when-a-run-stops.md", monkeypatch)
    (rerun,) = [json.loads(out) for argv, out in ran if argv[1:2] == ["run"]]
    assert rerun["pretrain"]["checkpoint_every"] == 100  # the demo profile's, as the guide says
    full = yaml.safe_load((ROOT / "configs" / "full.yaml").read_text(encoding="utf-8"))
    assert full["pretrain"]["checkpoint_every"] == 2000
    (ls_out,) = [out for argv, out in ran if argv[1:2] == ["ls"]]
    assert demo.version in ls_out and "@production" in ls_out
    gcs = [out for argv, out in ran if argv[1:2] == ["gc"]]
    assert len(gcs) == 2 and all(json.loads(o.strip().splitlines()[-1]) is not None for o in gcs)
    assert (demo.root / ".demo" / "store" / "bundle" / demo.version / "_manifest.json").exists()
    from tasks.common.config import RunnerConfig

    assert RunnerConfig().lease_stale_after_s == 120.0

"""What a person sees: bars only in a terminal, PNGs inline in markdown, links, a table republished live."""

from __future__ import annotations

import base64
import io
import json

import pytest

from tasks.common import ui
from tests.reporting import Recording
from tests.staging import begin


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


@pytest.mark.parametrize(("tty", "override", "requested", "shown"), [
    (True, None, True, True),
    (False, None, True, False),  # a worker's log file: no bars
    (True, None, False, False),  # progress: false wins
    (False, "1", True, True),
    (True, "0", True, False),
])
def test_bars_only_when_interactive(monkeypatch, tty, override, requested, shown):
    monkeypatch.setattr("sys.stderr", _Stream(tty))
    if override is None:
        monkeypatch.delenv("LEXIFLOW_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("LEXIFLOW_PROGRESS", override)
    assert ui.bars(requested) is shown


def test_png_markdown_embeds_the_picture():
    from tasks.common.plots import line_panels

    png = line_panels([1, 2, 3], [("loss", [([3.0, 2.0, 1.5], "mlm", {})])], "step", "pretrain")
    md = ui.png_markdown("loss", png)
    assert md.startswith("![loss](data:image/png;base64,") and md.endswith(")")
    assert base64.b64decode(md.split(",", 1)[1][:-1]) == png


def test_link_target():
    assert ui.link_target("s3://b/store/bundle/v") == "s3://b/store/bundle/v"
    assert ui.link_target("rel/store").startswith("file:///") and ui.link_target("rel/store").endswith("/rel/store")


@pytest.mark.flow
def test_publish_table_only_where_a_ui_is_reached():
    rows = [{"epoch": 1, "x": 0.5, "hidden": 1}]
    assert ui.PLAIN.publish_table("k", rows, ("epoch", "x"), "d", ("k-report", "# hi", "r")) is False  # no UI
    rec = Recording()
    assert rec.publish_table("k", rows, ("epoch", "x"), "d", ("k-report", "# hi", "r")) is True
    assert rec.made == [("table", {"key": "k", "table": [{"epoch": 1, "x": 0.5}], "description": "d"}),
                        ("md", {"key": "k-report", "markdown": "# hi", "description": "r"})]
    # a failure is logged, never raised
    assert Recording(fail=True).publish_table("k", rows, ("epoch",), "d") is False


def test_live_table_and_pictures_reach_the_prefect_api(prefect_server, tmp_path):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from storage.artifacts import ArtifactStore
    from tasks.common.plots import line_panels

    store = ArtifactStore(str(tmp_path / "s"))
    w = begin(store, "demo", "v1")
    w.write_bytes("loss.png", line_panels([1, 2], [("loss", [([2.0, 1.0], "mlm", {})])], "step", "demo"))
    art = w.commit(code_version="d", config={}, parents=[], stats={"in": 0, "out": 0, "rejected": {}})

    from flows.runtime import PrefectReporter

    @flow
    def show():
        reporter = PrefectReporter()
        live = reporter.live_table("demo-log-ui-test", ["step", "loss"], "a log", every_s=0.0)
        for step in range(3):
            live.add({"step": step, "loss": 1.0 / (step + 1)})
        reporter.publish_pictures(art)
        reporter.publish_link("demo-link-ui-test", art.uri, "the artifact")
        return live.published

    assert show() == 3  # one table per row while it ran (every_s=0)
    with get_client(sync_client=True) as client:
        def latest(key):
            found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
            return sorted(found, key=lambda a: a.created)

        logs = latest("demo-log-ui-test")
        rows = [json.loads(a.data) if isinstance(a.data, str) else a.data for a in logs]
        assert [len(r) for r in rows] == [1, 2, 3] and rows[-1][-1] == {"step": 2, "loss": pytest.approx(1 / 3)}
        pictures = latest("demo-curves")[-1]
        assert pictures.type == "markdown" and "![demo loss.png](data:image/png;base64,iVBOR" in pictures.data
        target = "file://" + str(tmp_path / "s" / "demo" / "v1")
        assert latest("demo-link-ui-test")[-1].data == f"[the artifact]({target})"

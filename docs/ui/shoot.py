"""Screenshots of the Prefect UI as a person sees it: the pipeline run graph and the fine-tuning curves.

    .venv/bin/python docs/ui/shoot.py --inputs .demo/inputs [--out docs/ui] [--set key=value ...]

Starts a real ``prefect server`` on loopback (with ``PREFECT_UI_API_URL`` set, as the UI needs on a
non-default port), runs the ``pipeline`` flow on the demo profile (shortened by default: see QUICK) into a
temporary store, then shoots the flow run page (run graph) and the ``finetune-curves`` / ``pretrain-curves`` /
``finetune-report`` / ``finetune-explain`` artifact pages with headless Chromium
(``apt-get install chromium fonts-noto-cjk``). Each screenshot carries the bundle version its run built as the
PNG text ``lexiflow:bundle_version`` (the last stdout line's ``bundle``); ``docs/pictures.py --ui`` runs this with
``--full`` and checks that version against the demo store's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
QUICK = ["pretrain.steps=60", "pretrain.checkpoint_every=60", "finetune.max_train_rows=3000",
         "finetune.max_eval_rows=600", "finetune.max_epochs=4", "label.input_uri=null"]
CHROMIUM = ["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
            "--window-size=1600,1000", "--virtual-time-budget=25000"]


def shoot(url: str, png: Path, profile: Path) -> None:
    cmd = [*CHROMIUM, f"--user-data-dir={profile}", f"--screenshot={png}", url]
    subprocess.run(cmd, check=True, capture_output=True, timeout=180)
    print(f"{png}  <- {url}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", required=True, help="the sample inputs (lexiflow sample --out DIR)")
    ap.add_argument("--out", default=str(REPO / "docs" / "ui"))
    ap.add_argument("--set", action="append", default=[], help="extra config overrides")
    ap.add_argument("--full", action="store_true", help="the demo profile as it is (no QUICK overrides)")
    args = ap.parse_args()

    from tests.prefect_server import _free_port, prefect_server

    tmp = Path(tempfile.mkdtemp(prefix="lexiflow-ui-"))
    port = _free_port()
    inputs = Path(args.inputs).resolve()
    os.environ["PREFECT_UI_API_URL"] = f"http://127.0.0.1:{port}/api"
    os.environ["PREFECT_SERVER_UI_ENABLED"] = "true"
    (tmp / "home").mkdir()
    with prefect_server(tmp / "home", port=port, ui=True) as env:
        sets = [] if args.full else list(QUICK)
        sets += [f"store_uri={tmp / 'store'}", f"corpus_uri={inputs}/corpus/*.jsonl",
                 f"embeddings_uri={inputs}/tencent_sample.txt", f"finetune.data_uri={inputs}/sentiment.csv",
                 *args.set]
        cmd = [sys.executable, "-m", "lexiflow", "run", "pipeline", "--config", str(REPO / "configs" / "demo.yaml")]
        for s in sets:
            cmd += ["--set", s]
        subprocess.run(cmd, cwd=REPO, env={**env, "PYTHONHASHSEED": "0"}, check=True)

        from prefect.client.orchestration import SyncPrefectClient
        from prefect.client.schemas.filters import FlowFilter, FlowFilterName

        ui = f"http://127.0.0.1:{port}"
        with SyncPrefectClient(env["PREFECT_API_URL"]) as client:
            run = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["pipeline"])))[0]
            arts = {a.key: a for a in client.read_artifacts() if a.key}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        shots = {"pipeline-run-graph.png": f"{ui}/runs/flow-run/{run.id}"}
        for key in ("finetune-curves", "pretrain-curves", "finetune-report", "finetune-explain"):
            if key in arts:
                shots[f"{key}.png"] = f"{ui}/artifacts/artifact/{arts[key].id}"
        from storage.artifacts import ArtifactStore
        from tasks.common.plots import stamp_png

        bundle = ArtifactStore(str(tmp / "store")).versions("bundle")[-1]
        for name, url in shots.items():
            shoot(url, out / name, tmp / "chromium")
            (out / name).write_bytes(stamp_png((out / name).read_bytes(), {"lexiflow:bundle_version": bundle}))
        print(json.dumps({"flow_run": str(run.id), "shots": sorted(shots), "bundle": bundle}))


if __name__ == "__main__":
    main()

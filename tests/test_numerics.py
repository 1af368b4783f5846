"""Pinned CPU numerics and batch-invariant scores: a text's probability is a function of the text and the bundle.

What is exact here is exact by design (models/rowwise.py, models/numerics.py): the same row alone, in a batch of
any size or in another file gives the same fp32 (and int8) bits; labelling through the CLI gives the same part-file
bytes under other thread, ISA and affinity settings of the environment, because the process pins them itself."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import models.numerics as numerics
from tasks.inference import sentiment as scorer_mod
from tasks.label.config import LabelOptions
from tasks.label.run import OutputConflict, label_stream
from tests.bundle_fixture import make_tiny_bundle
from tests.test_label import GOOD

REPO = Path(__file__).resolve().parents[1]
PINNED = {k: numerics.PINS[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR")}
UNSET = set(numerics.PINS)  # a default environment has none of the pins
HAS_AVX2 = numerics._cpu_has_avx2()


@pytest.fixture(scope="module")
def bundle_uri(tmp_path_factory) -> str:
    return make_tiny_bundle(str(tmp_path_factory.mktemp("numerics") / "store"))


@pytest.fixture(scope="module")
def bundle(bundle_uri):
    from tasks.inference.bundle import load_bundle

    return load_bundle(bundle_uri)


def _texts(n: int) -> list[str]:
    """``n`` review-like texts of many lengths (so many padded lengths and batch compositions)."""
    rng = np.random.default_rng(7)
    base = [t for t in GOOD if t.strip()]
    return ["，".join(rng.choice(base, size=int(rng.integers(1, 6)))) for _ in range(n)]


def test_the_process_runs_pinned_kernels_and_records_them():
    from models.numerics import numerics_record

    rec = numerics_record()
    assert rec["mode"] == "avx2" and rec["cpu_capability"] == ("AVX2" if HAS_AVX2 else rec["cpu_capability"])
    assert rec["onednn_max_cpu_isa"] == "AVX2" and rec["threads"] >= 1 and rec["torch"]
    # MKL honours AVX2 (strict: whatever the arrays' alignment) on Intel only; AMD falls back to AUTO
    assert rec["mkl_cbwr"] is None or rec["mkl_cbwr"].split(",")[0] in ("AVX2", "AUTO")
    assert rec["mkl_cbwr"] != "AVX2"  # the AVX2 branch without STRICT gives unaligned views other bits
    assert all(os.environ[k] == v for k, v in {**PINNED, **numerics.PINS}.items())
    assert rec["numpy_simd"] in ("X86_V3", "X86_V2") and rec["blas"] in ([], ["openblas Haswell x1"])


@pytest.mark.skipif(not HAS_AVX2, reason="without AVX2 nothing is pinned, so nothing is refused")
def test_torch_computing_before_lexiflow_is_refused_with_the_fix_in_the_message():
    code = ("import torch; torch.ones(8) + 1\nimport lexiflow\nfrom models.numerics import numerics_record\n"
            "numerics_record()")
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env["ATEN_CPU_CAPABILITY"] = "default"  # what an unpinned process picks, on any CPU: not AVX2
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "torch computed before lexiflow pinned its CPU kernels (ATen runs DEFAULT, not AVX2)" in proc.stderr
    assert "ATEN_CPU_CAPABILITY=avx2" in proc.stderr
    # importing torch first is fine as long as nothing ran: the pins still take effect
    ok = subprocess.run([sys.executable, "-c", "import torch\nimport lexiflow\nfrom models.numerics import "
                         "numerics_record\nprint(numerics_record()['cpu_capability'])"],
                        cwd=REPO, env=env, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.split()[-1] == "AVX2", ok.stderr


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_text_scores_the_same_bits_alone_in_any_batch_and_in_another_file(bundle, precision):
    import dataclasses

    b = bundle if precision == "fp32" else dataclasses.replace(bundle, model=scorer_mod.quantized(bundle.model))
    texts = _texts(300)
    whole = scorer_mod.score_texts(b, texts, batch_size=32)
    alone = np.array([scorer_mod.score_texts(b, [t], batch_size=1)[0] for t in texts[:40]], np.float32)
    # exact on purpose: bit-identical across batch compositions is the promise under test (models/rowwise.py)
    assert np.array_equal(alone, whole[:40])
    for bs in (3, 7, 64):
        assert np.array_equal(scorer_mod.score_texts(b, texts[100:180], batch_size=bs), whole[100:180])
    assert np.array_equal(scorer_mod.score_texts(b, texts[::-1], batch_size=5)[::-1], whole)


def test_rows_labelled_inside_a_large_file_and_in_a_small_file_get_the_same_bits(bundle, tmp_path, monkeypatch):
    share, _ = scorer_mod.agreement(bundle, scorer_mod.quantized(bundle.model), bundle.heldout_texts())
    monkeypatch.setattr(scorer_mod, "AGREEMENT", min(share, scorer_mod.AGREEMENT))  # random weights: gate lowered
    texts = _texts(400)
    big, small = tmp_path / "big.csv", tmp_path / "small.csv"
    big.write_text("id,review\n" + "".join(f"r{i},{t}\n" for i, t in enumerate(texts)), encoding="utf-8")
    picked = list(range(5, 400, 37))
    small.write_text("id,review\n" + "".join(f"r{i},{texts[i]}\n" for i in picked), encoding="utf-8")
    for precision in ("fp32", "int8"):
        opts = LabelOptions(id_column="id", precision=precision, shard_rows=128, batch_size=16)
        probs = []
        for name, src in (("big", big), ("small", small)):
            res = label_stream(bundle, str(src), str(tmp_path / f"{name}-{precision}"), opts, progress=False)
            rows = [r for p in sorted(Path(res["uri"]).glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
            probs.append({r["row_id"]: r["prob"] for r in rows})
        assert {f"r{i}": probs[0][f"r{i}"] for i in picked} == probs[1], precision


INT8_PROBE = """
import hashlib, torch, lexiflow
from models.rowwise import RowInt8Linear
torch.manual_seed(0)
h = hashlib.sha256()
for k, n in ((384, 1536), (1536, 384), (200, 384)):
    layer = RowInt8Linear(torch.nn.Linear(k, n).eval())
    for m in (1, 7, 333, 2048):
        with torch.inference_mode():
            h.update(layer(torch.randn(m, k) * torch.rand(m, 1) * 5).numpy().tobytes())
print(h.hexdigest())
"""


def test_int8_linears_give_the_same_bits_whatever_fbgemm_kernel_runs():
    """fbgemm is not pinned (models/numerics.py): its int8 products accumulate exactly and every float op after
    them is per element, so the AVX2 kernels and the machine's own (AVX-512, VNNI where it has them) agree."""
    env = {k: v for k, v in os.environ.items() if k != "FBGEMM_ENABLE_INSTRUCTIONS"}
    with ThreadPoolExecutor(max_workers=2) as pool:  # two independent processes, at once
        jobs = [pool.submit(subprocess.run, [sys.executable, "-c", INT8_PROBE], cwd=REPO, env={**env, **extra},
                            capture_output=True, text=True, check=True)
                for extra in ({}, {"FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"})]
        runs = [job.result().stdout.split()[-1] for job in jobs]
    assert runs[0] == runs[1]


def _cli_label(bundle_uri: str, inp: Path, out: Path, env_extra: dict[str, str], prefix: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in UNSET and not k.startswith("PREFECT_API")}
    env.update(env_extra)
    cmd = [*prefix, sys.executable, "-m", "lexiflow", "label", "--bundle", bundle_uri, "--input", str(inp),
           "--output", str(out), "--shard-rows", "40"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*-*.parquet"))}


def test_cli_labelling_writes_the_same_bytes_under_other_threads_isa_settings_and_affinity(bundle_uri, tmp_path):
    inp = tmp_path / "in.csv"
    inp.write_text("review\n" + "".join(f"{t}\n" for t in _texts(120)), encoding="utf-8")
    taskset = [shutil.which("taskset"), "-c", "0"] if shutil.which("taskset") else []
    runs = {
        "default": ({}, []),
        "omp1": ({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "2"}, []),
        "avx2-env": (dict(PINNED), []),
        "avx512-env": ({"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, []),  # overridden
        "fbgemm-avx2": ({"FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"}, []),
        "one-core": ({}, taskset),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:  # independent processes, two at a time: bytes are what counts
        jobs = {name: pool.submit(_cli_label, bundle_uri, inp, tmp_path / name, env, prefix)
                for name, (env, prefix) in runs.items()}
        got = {name: job.result() for name, job in jobs.items()}
    first = got["default"]
    assert len(first) == 3 and all(h == first for h in got.values()), got


def test_numerics_enter_the_label_version_and_a_resume_under_other_numerics_names_the_difference(bundle, tmp_path,
                                                                                                  monkeypatch):
    inp = tmp_path / "in.csv"
    inp.write_text("review\n" + "".join(f"{t}\n" for t in GOOD), encoding="utf-8")
    out = tmp_path / "out"
    res = label_stream(bundle, str(inp), str(out), LabelOptions(), progress=False)
    run = json.loads((out / "_run.json").read_text())
    assert run["config"]["numerics"]["threads"] == 2 and run["config"]["numerics"]["cpu_capability"]
    other_threads = label_stream(bundle, str(inp), None, LabelOptions(threads=1), output_root=str(tmp_path / "r"),
                                 progress=False)
    assert other_threads["version"] != res["version"]  # threads change reductions: another version
    real = numerics.numerics_record
    monkeypatch.setattr(numerics, "numerics_record", lambda: {**real(), "cpu_capability": "AVX512"})
    with pytest.raises(OutputConflict, match=r"other CPU numerics than the recorded run's: cpu_capability: "
                                             r"'AVX2' -> 'AVX512'"):
        label_stream(bundle, str(inp), str(out), LabelOptions(), progress=False)


def _odd_model():
    """A classifier with widths that do not divide into whole vectors per thread (ffn 1000, hidden 40), tanh GELU."""
    import torch

    from models import LebertClassifier, ModelConfig

    cfg = ModelConfig(vocab_size=50, hidden_size=40, num_layers=2, num_heads=4, ffn_size=1000, max_len=32,
                      activation="gelu_tanh", word_vocab_size=30, word_dim=8, max_word_num=3, adapter_layer=1)
    torch.manual_seed(0)
    return LebertClassifier(cfg, use_layers=2).eval()


def _alone_and_batched(model, threads: int):
    import torch

    from models.numerics import torch_threads

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 50, (37, 32), generator=g)
    words = torch.randint(0, 30, (37, 32, 3), generator=g)
    with torch_threads(threads), torch.inference_mode():
        batched = model(ids, ids != 0, words)
        alone = torch.cat([model(ids[i : i + 1], ids[i : i + 1] != 0, words[i : i + 1]) for i in range(37)])
    return alone, batched


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_row_invariance_holds_for_odd_widths_and_thread_counts(threads):
    import torch

    from models.rowwise import rowwise

    alone, batched = _alone_and_batched(rowwise(_odd_model()), threads)
    assert torch.equal(alone, batched)  # exact on purpose: the row-invariance promise itself


def test_the_plain_model_is_not_row_invariant_which_is_why_rowwise_exists():
    """The control for the test above: the same model with plain layers gives a row other bits alone than in the
    batch (MKL multiplies a single row by another kernel). Where it does not, the test above shows nothing here."""
    alone, batched = _alone_and_batched(_odd_model(), 3)
    if bool((alone == batched).all()):
        pytest.skip("plain layers happened to be row-invariant on this CPU: the control shows nothing here")
    assert not bool((alone == batched).all())

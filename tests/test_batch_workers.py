"""CPU scoring runs whole batches on threads of their own (one torch thread each): the same bits as batches in turn.

Exact equality is the design here: a batch's bits are those of its rows alone (the row-invariant layers), and a
batch runs on one thread only where every layer gives the bits it gives on all threads (probed)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import models.rowwise as rw
from models.numerics import torch_threads
from tasks.inference import sentiment as scorer
from tests.bundle_fixture import CHARS, make_tiny_bundle


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from tasks.inference.bundle import load_bundle

    return load_bundle(make_tiny_bundle(str(tmp_path_factory.mktemp("store"))))


def _texts(n: int = 160) -> list[str]:
    rng = np.random.default_rng(7)  # lengths 1..150: many padded lengths, so many batches of several shapes
    return ["".join(rng.choice(CHARS, size=int(rng.integers(1, 150)))) for _ in range(n)]


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_batches_on_threads_give_the_bits_of_batches_in_turn(bundle, monkeypatch, precision):
    import dataclasses

    model = scorer.inference_model(bundle.model) if precision == "fp32" else scorer.quantized(bundle.model)
    b = dataclasses.replace(bundle, model=model)
    texts = _texts()
    monkeypatch.setattr(scorer, "available_cpus", lambda: 2)  # whatever CPUs this test process may use
    with torch_threads(2):
        assert scorer.batch_workers(model) == 2  # the probe finds one thread gives the bits of two here
        on_threads = scorer.score_texts(b, texts, batch_size=8)
        with monkeypatch.context() as m:  # a process allowed one CPU (taskset, a cgroup quota): one batch at a time,
            m.setattr(scorer, "available_cpus", lambda: 1)  # on one torch thread
            assert scorer.batch_workers(model) == 1
            one_cpu = scorer.score_texts(b, texts, batch_size=8)
        with monkeypatch.context() as m:
            m.setattr(scorer, "batch_workers", lambda _model: 0)
            in_turn = scorer.score_texts(b, texts, batch_size=8)
    # exact on purpose, on any CPU: that the schedule changes no bit is the promise under test. The same rows go
    # through the same kernels; only which thread runs a batch differs, and a batch goes on one thread only where
    # the probe found one thread gives the bits of all (elsewhere every schedule here is batches in turn)
    assert on_threads.shape == (len(texts),) and np.array_equal(on_threads, in_turn)
    # exact on purpose, as above: one allowed CPU changes only how many batches run at once
    assert np.array_equal(one_cpu, in_turn)


def test_each_batch_runs_on_one_torch_thread_in_inference_mode_and_the_count_comes_back(bundle, monkeypatch):
    model = scorer.inference_model(bundle.model)
    monkeypatch.setattr(scorer, "available_cpus", lambda: 2)
    monkeypatch.setattr(scorer, "_POOLS", {})  # a pool started here, under test
    seen: list[tuple[str, int, bool]] = []
    with torch_threads(2):
        scorer.map_batches(model, lambda b: seen.append((threading.current_thread().name, torch.get_num_threads(),
                                                         torch.is_inference_mode_enabled())), list(range(12)))
        assert torch.get_num_threads() == 2
        fresh: list[int] = []  # a thread started afterwards starts with the process's count again, not 1
        t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        t.start()
        t.join()
    assert len(seen) == 12 and fresh == [2]
    assert all(name.startswith("lexiflow-batch") and n == 1 and inference for name, n, inference in seen)


def test_the_first_failing_batch_raises_at_once_and_the_batches_not_started_are_dropped(bundle, monkeypatch):
    model = scorer.inference_model(bundle.model)
    monkeypatch.setattr(scorer, "available_cpus", lambda: 2)
    ran: list[int] = []

    def fn(b: int) -> None:
        if b in (3, 4):  # two failures: the earliest batch's error is the one raised
            raise RuntimeError(f"batch {b} is broken")
        time.sleep(3.0 if b == 0 else 0.2)  # batch 0 is slow: an error behind it must not wait for it (waiting,
        # the other worker would run about 15 batches more; a main thread descheduled for a second, about 5)
        ran.append(b)

    with torch_threads(2):
        with pytest.raises(RuntimeError, match="batch 3 is broken"):
            scorer.map_batches(model, fn, list(range(40)))
        assert torch.get_num_threads() == 2
    # at the error, the other worker had run batches 1 and 2 (and perhaps started one more); waiting for batch 0
    # before looking at batch 3 would have let it run about 15 more
    assert 0 in ran and len(ran) < 15


def test_models_with_plain_or_recording_layers_score_one_batch_at_a_time(bundle, monkeypatch):
    import copy

    monkeypatch.setattr(scorer, "available_cpus", lambda: 2)
    plain = copy.deepcopy(bundle.model).eval()
    plain.rowwise_precision = "fp32"  # marked as scoring-ready, but its nn.Linear layers follow batch and threads
    with torch_threads(2):
        assert not rw.one_thread_invariant(plain) and scorer.batch_workers(plain) == 0
        recording = copy.deepcopy(scorer.inference_model(bundle.model))
        assert scorer.batch_workers(recording) == 2
        recording.encoder.adapter.record_attention = True  # one record per forward: batches must go in turn
        assert scorer.batch_workers(recording) == 0


def test_a_layer_whose_bits_follow_the_thread_count_keeps_batches_in_turn(bundle, monkeypatch):
    model = scorer.inference_model(bundle.model)
    monkeypatch.setattr(rw, "_ONE_THREAD", {})  # probe afresh
    plain = rw._block_loop

    def by_threads(*args, **kwargs):  # a BLAS whose additions follow the thread split: one ulp off on one thread
        y = plain(*args, **kwargs)
        return torch.nextafter(y, torch.full_like(y, np.inf)) if torch.get_num_threads() == 1 else y

    monkeypatch.setattr(rw, "_block_loop", by_threads)
    with torch_threads(2):
        assert not rw.one_thread_invariant(model)
        assert scorer.batch_workers(model) == 0
        seen: list[str] = []
        scorer.map_batches(model, lambda b: seen.append(threading.current_thread().name), [0, 1, 2])
        assert seen == [threading.current_thread().name] * 3 and torch.get_num_threads() == 2

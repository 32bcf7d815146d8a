"""The engine's collector settings: raised for serving, never lowered, and left alone on request."""

from __future__ import annotations

import gc

import pytest

from loraplex.platform.engine.gc_tuning import (
    SERVING_THRESHOLDS,
    freeze_startup_heap,
    tune_for_serving,
)


@pytest.fixture
def restore_thresholds():
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


def test_raises_the_thresholds(restore_thresholds, monkeypatch) -> None:
    monkeypatch.delenv("LORAPLEX_GC_TUNING", raising=False)
    gc.set_threshold(700, 10, 10)
    assert tune_for_serving()
    assert gc.get_threshold() == SERVING_THRESHOLDS
    assert gc.isenabled()


def test_never_lowers_a_threshold_set_higher(restore_thresholds, monkeypatch) -> None:
    monkeypatch.delenv("LORAPLEX_GC_TUNING", raising=False)
    gc.set_threshold(200_000, 5, 500)
    tune_for_serving()
    assert gc.get_threshold() == (200_000, SERVING_THRESHOLDS[1], 500)


def test_off_by_environment(restore_thresholds, monkeypatch) -> None:
    monkeypatch.setenv("LORAPLEX_GC_TUNING", "0")
    gc.set_threshold(700, 10, 10)
    assert not tune_for_serving()
    assert gc.get_threshold() == (700, 10, 10)


def test_a_serving_process_freezes_what_start_up_left(restore_thresholds, monkeypatch) -> None:
    monkeypatch.delenv("LORAPLEX_GC_TUNING", raising=False)
    try:
        assert freeze_startup_heap()
        # what existed at start-up is out of the collector's scans; thresholds are raised
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() >= SERVING_THRESHOLDS
    finally:
        gc.unfreeze()
    monkeypatch.setenv("LORAPLEX_GC_TUNING", "0")
    assert not freeze_startup_heap()
    assert gc.get_freeze_count() == 0

"""The predictor's bookkeeping alone: no model, no llama.cpp."""

from __future__ import annotations

import numpy as np
import pytest

from bmoe.stages.predict import Predictor

pytestmark = pytest.mark.pure  # no model, no llama.cpp: `pytest -m pure` runs these in seconds


def test_predictions_are_trusted_only_while_recently_right() -> None:
    routers = {0: np.eye(4, dtype=np.float32), 1: np.eye(4, dtype=np.float32)}
    p = Predictor(routers, k=1)
    x = np.array([0, 0, 1, 0], dtype=np.float32)  # layer 1's router picks expert 2
    assert p.trusted(1), "no evidence yet: read ahead"
    for _ in range(Predictor.RECENT):
        layer, top = p.predict(0, x)
        assert layer == 1 and top.tolist() == [2]
        p.score(1, (3,))  # wrong every time
    assert not p.trusted(1)
    for _ in range(Predictor.RECENT):
        p.predict(0, x)
        p.score(1, (2,))  # right again
    assert p.trusted(1), "a layer whose guesses improve is trusted again"
    assert p.accuracy_pct() == {1: 50.0}



def test_a_batch_predicts_the_union_of_its_rows_and_is_charged_for_extra_names() -> None:
    routers = {0: np.eye(4, dtype=np.float32), 1: np.eye(4, dtype=np.float32), 2: np.eye(4, dtype=np.float32)}
    p = Predictor(routers, k=1, final_layer=2)
    rows = np.eye(4, dtype=np.float32)[[0, 2, 2]]  # three tokens: layer 1's router picks 0, 2, 2
    layer, top = p.predict(0, rows)
    assert layer == 1 and top.tolist() == [2, 0], "each row's top-k, their union, most rows first"
    p.score(1, (2, 3))  # one of two named was routed, one routed was not named
    assert p.accuracy_pct() == {1: 50.0}
    p.score(1, (2,))  # nothing pending: no score
    layer, top = p.predict(1, rows)
    assert layer == 2 and top.tolist() == [2], "the final layer runs on the last row only (llama.cpp's out ids)"
    p.predict(0, rows)
    p.score(1, (0,))  # named two, routed one: the extra name is a read for nothing
    assert p.correct[1] == 2 and p.total[1] == 4


def test_a_batchs_read_ahead_is_cut_to_what_lands_while_the_layer_computes() -> None:
    """A prompt's whole predicted union read ahead cost a cold 5-token prompt a third of its time
    (wrong guesses on lanes the real misses needed); reads past the compute they overlap gain
    nothing. The cut keeps the surest guesses (the predictor's order) and leaves decode's alone."""
    from bmoe.pipeline.boundary import FastPath
    from bmoe.pipeline.gate import RoutingGate

    maps = [np.ones(8, dtype=bool), np.zeros(8, dtype=bool)]  # layer 0 all resident, layer 1 nothing
    gate = RoutingGate(fast_path=FastPath.over(maps))
    asked: list[tuple[int, float]] = []

    def reads_in(layer: int, seconds: float) -> int:
        asked.append((layer, seconds))
        return 2

    gate.ahead_reads = reads_in
    guesses = np.array([5, 1, 7, 3])
    gate.predict(1, guesses, batch=True)
    assert gate._ahead == (1, (1, 3, 5, 7)) and not asked, "no compute seen yet in this call: no cut; file order"
    gate.route(0, np.array([[0, 1]]))  # all resident: compute resumes now
    gate.predict(1, guesses, batch=True)
    assert gate._ahead == (1, (1, 5)), "the two surest, in file order"
    assert asked and asked[0][0] == 1 and asked[0][1] >= 0
    gate.route(0, np.array([[0, 1]]))
    gate.predict(1, guesses)  # one token (decode): as before
    assert gate._ahead == (1, (5, 1, 7, 3))
    gate.ahead_reads = lambda layer, seconds: None  # no read measured yet: no cut
    gate.route(0, np.array([[0, 1]]))
    gate.predict(1, guesses, batch=True)
    assert gate._ahead == (1, (1, 3, 5, 7))

"""Online mixture weights as pure logic (no Ray, no torch): the policies, the weights history as switch stages,
segment boundaries, exact per-source counts and the ledger over a history."""

from __future__ import annotations

from collections import Counter

import pytest

from raytrain_events.core.ledger import Ledger, ledger_of_checkpoint
from raytrain_events.core.mixture import Mixture, MixtureError
from raytrain_events.core.mixture_online import (
    OnlinePolicy,
    WeightsChange,
    apply_history,
    initial_logs,
    next_weights,
    schedule,
    target_shares,
)

NAMES = ("code", "math", "web")  # the mixture's order: sorted by name
BASE = Mixture(
    sources={"web": 100, "code": 60, "math": 80},
    weights={"web": 0.6, "code": 0.3, "math": 0.1},
    epoch_size=160,
    online={"policy": "exp3", "rate": 2.0},
)
LOSSES = [(0.82, 0.61, 0.66), (0.70, 0.62, 0.61), (0.60, 0.68, 0.56), (0.56, 0.76, 0.51), (0.54, 0.80, 0.50)]


def _history(base: Mixture, positions, losses) -> list:
    policy = OnlinePolicy.from_dict(base.online, base.names)
    start = [float(a) for _, a in base.stage_list[0][1]]
    weights = schedule(policy, start, losses)
    total = sum(start)
    old = [tuple(w / total for w in start)] + [tuple(w) for w in weights[:-1]]
    return [WeightsChange(p, p // 8, o, tuple(w), tuple(x)) for p, o, w, x in zip(positions, old, weights, losses)]


def test_exp3_moves_weight_to_the_highest_loss_and_keeps_the_floor():
    policy = OnlinePolicy.from_dict({"policy": "exp3", "rate": 3.0, "floor": 0.1}, NAMES)
    logs, weights = next_weights(policy, initial_logs([1, 1, 1]), [0.2, 0.9, 0.5])
    assert weights[1] > weights[2] > weights[0]
    assert min(weights) >= 0.1 / 3 - 1e-6 and sum(weights) == pytest.approx(1, abs=1e-5)
    for _ in range(50):  # a long run: the floor holds, no overflow
        logs, weights = next_weights(policy, logs, [0.2, 0.9, 0.5])
    assert min(weights) == pytest.approx(0.1 / 3, abs=1e-5) and weights[1] > 0.9


def test_doremi_moves_only_the_excess_over_the_reference():
    reference = {"code": 0.5, "math": 0.2, "web": 0.3}
    policy = OnlinePolicy.from_dict({"policy": "doremi", "rate": 5.0, "reference": reference}, NAMES)
    # code at its reference, web below it: only math's excess (0.3) counts
    _, weights = next_weights(policy, initial_logs([1, 1, 1]), [0.5, 0.5, 0.25])
    assert weights[1] > weights[0] == weights[2]
    # no excess anywhere: the weights stay (smoothed toward uniform by the floor only)
    _, same = next_weights(policy, initial_logs([0.5, 0.3, 0.2]), [0.1, 0.1, 0.1])
    assert same == [round(0.95 * w + 0.05 / 3, 6) for w in (0.5, 0.3, 0.2)]


PI = (0.7, 0.2, 0.1)  # the target task's shares of code/math/web
SOURCE_LOSSES = [(0.9, 0.5, 0.6), (0.6, 0.62, 0.7), (0.45, 0.75, 0.72), (0.4, 0.8, 0.8), (0.38, 0.83, 0.85)]
TARGETS = [sum(p * x for p, x in zip(PI, one)) for one in SOURCE_LOSSES]  # a mixture's loss: its parts' mixed


def test_the_target_policy_reads_the_targets_shares_from_the_eval_history_and_trains_toward_them():
    assert target_shares(list(zip(SOURCE_LOSSES, TARGETS))) == pytest.approx(PI, abs=0.01)
    # one decision already points the right way: the target's loss (0.79) is nearest code's (0.9), then web's
    first = target_shares([(SOURCE_LOSSES[0], TARGETS[0])])
    assert first[0] > 0.5 and first[0] > first[2] > first[1]
    policy = OnlinePolicy.from_dict({"policy": "target", "target": "heldout", "rate": 2.0, "floor": 0.0}, NAMES)
    assert policy.labels(NAMES) == ["code", "math", "web", "heldout"] and policy.to_dict()["target"] == "heldout"
    weights = schedule(policy, [1, 1, 1], SOURCE_LOSSES, TARGETS)
    assert weights[-1] == pytest.approx(PI, abs=0.02)  # two thirds of the way per decision: there after 5
    assert abs(weights[0][0] - 0.7) > abs(weights[-1][0] - 0.7)  # and closer at each
    # the same losses under exp3 go to the highest loss instead (the test can fail)
    exp3 = schedule(OnlinePolicy.from_dict({"policy": "exp3", "rate": 2.0}, NAMES), [1, 1, 1], SOURCE_LOSSES)
    assert exp3[-1][0] < 0.5
    # pure: stepwise with each earlier decision's (losses, target) gives the schedule; a prefix, a prefix
    logs, past = initial_logs([1, 1, 1]), []
    for one, target, expected in zip(SOURCE_LOSSES, TARGETS, weights):
        logs, step = next_weights(policy, logs, one, target=target, past=past)
        past.append((one, round(target, 4)))
        assert step == expected
    assert schedule(policy, [1, 1, 1], SOURCE_LOSSES[:2], TARGETS[:2]) == weights[:2]
    with pytest.raises(ValueError, match="target's eval loss: none was given"):
        next_weights(policy, initial_logs([1, 1, 1]), SOURCE_LOSSES[0])
    # the history keeps each decision's target loss (what a resume replays)
    change = WeightsChange(40, 5, (1 / 3,) * 3, tuple(weights[0]), SOURCE_LOSSES[0], round(TARGETS[0], 4))
    assert WeightsChange.from_dict(change.to_dict(NAMES), NAMES) == change
    assert "target" not in WeightsChange(40, 5, (0.5, 0.5), (0.5, 0.5), (0.1, 0.2)).to_dict(("a", "b"))


def test_the_schedule_is_a_pure_function_of_its_losses():
    policy = OnlinePolicy.from_dict(BASE.online, NAMES)
    first, again = schedule(policy, [3, 1, 6], LOSSES), schedule(policy, [3, 1, 6], LOSSES)
    assert first == again and len(first) == len(LOSSES)
    # losses differing below the rounding (float noise of a synchronized metric) choose the same weights
    assert schedule(policy, [3, 1, 6], [[x + 1e-9 for x in one] for one in LOSSES]) == first
    assert schedule(policy, [3, 1, 6], LOSSES[:3]) == first[:3]  # a prefix of the losses: a prefix of the history
    assert schedule(policy, [3, 1, 6], [LOSSES[0], LOSSES[2]])[1] != first[1]  # the test can fail


def test_a_history_keeps_the_order_before_each_change_and_its_segments_start_there():
    positions = [40, 96, 160, 200, 280]  # mid-epoch, the epoch boundary, and one in epoch 1
    mixture = apply_history(BASE, _history(BASE, positions, LOSSES))
    assert mixture.continues(BASE) and mixture.online == BASE.online
    plan, base_plan = mixture.plan(seed=5, total_samples=320), BASE.plan(seed=5, total_samples=320)
    assert list(plan.starts) == [0, *positions]
    assert plan.rows(0, 0, 40) == base_plan.rows(0, 0, 40)  # nothing before the first change moves
    assert plan.rows(0, 40, 160) != base_plan.rows(0, 40, 160)
    # each earlier prefix of the history gives the same rows up to its next change
    for k, stop in enumerate(positions[1:], start=1):
        partial = apply_history(BASE, _history(BASE, positions[:k], LOSSES[:k])).plan(seed=5, total_samples=320)
        e, p = divmod(stop, 160)
        assert partial.consumed(e, p) == plan.consumed(e, p)
    # the segments of each epoch start at the changes inside it
    assert [s.start for s in plan.segments(0)] == [0, 40, 96]
    assert [s.start for s in plan.segments(1)] == [0, 40, 120]


def test_per_source_counts_are_exact_under_a_history():
    positions = [40, 96, 200]
    history = _history(BASE, positions, LOSSES[:3])
    plan = apply_history(BASE, history).plan(seed=1, total_samples=320)
    rows = [plan.rows(e, 0, 160) for e in (0, 1)]
    for e in (0, 1):
        for position in (0, 7, 40, 41, 96, 100, 159, 160):
            counted = Counter(s for s, _ in rows[e][:position])
            assert plan.cursors(e, position) == tuple(counted[i] for i in range(3))
    totals = Counter(s for epoch in rows for s, _ in epoch)
    assert plan.consumed(1, 160) == tuple(totals[i] for i in range(3))
    # a segment after a change holds each source in its new proportions (largest remainders of its length)
    segment = plan.segments(0)[2]  # [96, 160) under the second change's weights
    assert segment.start == 96 and sum(segment.quotas) == 64
    for quota, weight in zip(segment.quotas, history[1].new):
        assert abs(quota - 64 * weight) < 1


def test_the_ledger_answers_over_the_weights_history():
    history = _history(BASE, [40, 96, 200], LOSSES[:3])
    mixture = apply_history(BASE, history)
    plan = mixture.plan(seed=4, total_samples=320)
    # the checkpoint as `MixtureCounts` saves it: the mixture with its switch stages, the seed, the starts
    state = {
        "timestamp": {"epoch": 1, "sample_in_epoch": 72},
        "callbacks": {"MixtureCounts": {"mixture": mixture.to_dict(), "seed": 4, "stage_starts": list(plan.starts)}},
    }
    ledger = ledger_of_checkpoint(state)
    trained = Counter((plan.names[s], r) for e, stop in ((0, 160), (1, 72)) for s, r in plan.rows(e, 0, stop))
    for name, rows in (("code", 60), ("math", 80), ("web", 100)):
        for row in range(rows):
            assert ledger.ask(name, row).times == trained[(name, row)]
    # the base mixture's ledger (the history ignored) answers otherwise: the history matters
    base = Ledger(plan=BASE.plan(seed=4, total_samples=320), epoch=1, position=72)
    assert any(base.ask("math", r).times != trained[("math", r)] for r in range(80))


@pytest.mark.parametrize(
    "online, stages, fix",
    [
        ({"policy": "bandit"}, None, r"use one of \['exp3', 'doremi', 'target'\]"),
        ({"policy": "target"}, None, r"needs target='<label>' \(got None\)"),
        ({"policy": "target", "target": ""}, None, r"needs target='<label>'"),
        ({"policy": "exp3", "target": "heldout"}, None, "target= is for policy 'target' only"),
        ({"policy": "exp3", "rate": 0}, None, "rate=0 must be a positive"),
        ({"policy": "exp3", "rate": -0.5}, None, "rate=-0.5 must be a positive"),
        ({"policy": "exp3", "floor": 1}, None, r"floor=1 must be in \[0, 1\)"),
        ({"policy": "doremi"}, None, r"needs reference=\{source: loss\}"),
        ({"policy": "exp3", "reference": {"web": 1}}, None, "for policy 'doremi' only"),
        ({"policy": "exp3", "evaluators": {"wiki": "w"}}, None, r"names \['wiki'\], which are not sources"),
        ({"policy": "exp3", "step": 3}, None, r"unknown keys \['step'\]"),
        ({"policy": "exp3"}, {"0dur": {"web": {"repeat": 1}, "code": {"choose": 60}}}, "as proportions"),
        ({"policy": "exp3"}, {"0dur": {"web": 1}, "0.5dur": {"code": 1}}, r"stages at \['0.5dur'\] of its own"),
    ],
)
def test_a_bad_online_policy_is_refused_naming_the_fix(online, stages, fix):
    kwargs = {"stages": stages} if stages else {"weights": {"web": 0.5, "code": 0.5}}
    with pytest.raises(MixtureError, match=fix):
        Mixture(sources={"web": 100, "code": 60, "math": 80}, online=online, **kwargs)


def test_an_online_mixture_is_plain_data():
    again = Mixture.from_dict(BASE.to_dict())
    assert again == BASE and again.online == {"policy": "exp3", "rate": 2.0, "floor": 0.05}
    switched = BASE.switched(40, {"web": 0.5, "code": 0.5})
    assert Mixture.from_dict(switched.to_dict()) == switched and switched.continues(BASE)
    other = Mixture(sources=BASE.sources, weights={"web": 0.6, "code": 0.3, "math": 0.1}, epoch_size=160)
    assert not switched.continues(other)  # another policy (none): not a continuation

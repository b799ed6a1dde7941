"""`swiftlm rlhf --rlhf_type simpo|orpo|cpo`: each loss on one batch against the formula
written out over separate forwards of each conversation, a short run that learns the
preference, and the flags each method does not read."""

import math

import pytest
import torch
from test_dpo import ROWS, loss_on_three_pairs, rlhf

from conftest import logged, write_jsonl
from swiftlm.cli.main import main
from swiftlm.data.encode import IGNORE_INDEX
from tolerance import assert_close, forward_terms


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


def by_hand(kind: str, c: float, r: float, nc: int, nr: int) -> float:
    """The per-pair loss from answer log-prob sums c, r and answer lengths nc, nr."""
    ca, ra = c / nc, r / nr
    if kind == "simpo":  # beta 2.0, gamma 1.0, cpo_alpha 0.5
        return -log_sigmoid(2.0 * (ca - ra) - 1.0) + 0.5 * -ca
    if kind == "orpo":  # beta 0.1
        log_odds = (ca - ra) - (math.log(1 - math.exp(ca)) - math.log(1 - math.exp(ra)))
        return -ca - 0.1 * log_sigmoid(log_odds)
    if kind == "cpo":  # beta 0.1, sigmoid, cpo_alpha 0.5
        return -log_sigmoid(0.1 * (c - r)) + 0.5 * -ca
    return (ca - ra - 1 / (2 * 0.1)) ** 2 + 0.5 * -ca  # cpo ipo: length-averaged


def size(kind: str, c: float, r: float, nc: int, nr: int) -> float:
    """What the pair's loss's rounding is relative to (tests/tolerance.py): its own size, and
    the log-prob sums' roundings (relative to |c|, |r|) carried by its slopes, |dL/dc| |c| +
    |dL/dr| |r| (central differences of by_hand)."""
    step = 1e-6

    def slope(dc: float, dr: float) -> float:
        up, down = by_hand(kind, c + dc, r + dr, nc, nr), by_hand(kind, c - dc, r - dr, nc, nr)
        return (up - down) / (2 * step)

    carried = abs(slope(step, 0) * c) + abs(slope(0, step) * r)
    return abs(by_hand(kind, c, r, nc, nr)) + carried


SETTINGS = {
    "simpo": {"rlhf_type": "simpo", "cpo_alpha": 0.5},
    "orpo": {"rlhf_type": "orpo"},
    "cpo": {"rlhf_type": "cpo", "cpo_alpha": 0.5},
    "cpo_ipo": {"rlhf_type": "cpo", "cpo_alpha": 0.5, "loss_type": "ipo"},
}


@pytest.mark.numerics
@pytest.mark.parametrize("kind", SETTINGS)
def test_the_loss_of_a_batch_equals_the_formula(kind, tiny_model_dir):
    _, samples, model, loss, metrics = loss_on_three_pairs(tiny_model_dir, SETTINGS[kind])

    def answer(sample, side) -> tuple[float, int]:
        ids, labels = sample[f"{side}_input_ids"], sample[f"{side}_labels"]
        with torch.no_grad():
            logps = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        picked = [
            logps[t - 1, ids[t]].item() for t in range(1, len(ids)) if labels[t] != IGNORE_INDEX
        ]
        return sum(picked), len(picked)

    expected, magnitude = 0.0, 0.0
    for sample in samples:
        (c, nc), (r, nr) = answer(sample, "chosen"), answer(sample, "rejected")
        expected += by_hand(kind, c, r, nc, nr)
        magnitude += size(kind, c, r, nc, nr)
    # A padded batch against each conversation alone (rows of at most 64 tokens, max_length).
    assert_close(loss, expected, terms=forward_terms(64), magnitude=magnitude, what=kind)
    assert 0 <= metrics["rewards/accuracies"].item() <= 3


@pytest.mark.parametrize("kind", ["simpo", "orpo", "cpo"])
def test_a_short_run_learns_the_preference(kind, tiny_model_dir, tmp_path):
    data, out = write_jsonl(tmp_path / "pairs.jsonl", ROWS), tmp_path / kind
    flags = dict(max_steps=5, per_device_train_batch_size=4, learning_rate="5e-3", lora_dropout=0)
    assert main(rlhf(tiny_model_dir, data, out, rlhf_type=kind, **flags)) == 0
    margins = logged(out, "rewards/margins")
    assert margins[-1] > margins[0] and logged(out)[-1] < logged(out)[0]
    beta = {"simpo": 2.0, "orpo": 0.1, "cpo": 0.1}[kind]
    assert f"beta: {beta}" in (out / "config.yaml").read_text()  # the effective default


@pytest.mark.bad_input(
    input="`swiftlm rlhf`: a flag the chosen --rlhf_type does not read (`--rpo_alpha` with "
    "orpo, a DPO-only `--loss_type` with simpo)",
    outcome="Error naming the flag, the method and what it accepts; nothing is loaded",
)
@pytest.mark.parametrize(
    "flags, message",
    [
        ({"rlhf_type": "simpo", "loss_type": "hinge"}, "--rlhf_type simpo accepts sigmoid"),
        ({"rlhf_type": "orpo", "rpo_alpha": 1}, "--rpo_alpha is not used by --rlhf_type orpo"),
        ({"rlhf_type": "dpo", "cpo_alpha": 0}, "--cpo_alpha is not used by --rlhf_type dpo"),
    ],
)
def test_flags_the_method_does_not_read_are_refused(
    flags, message, tiny_model_dir, tmp_path, capsys
):
    data = write_jsonl(tmp_path / "pairs.jsonl", ROWS)
    assert main(rlhf(tiny_model_dir, data, tmp_path / "run", max_steps=1, **flags)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()

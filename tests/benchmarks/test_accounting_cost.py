"""benchmarks/accounting_cost.py replays the epsilon calls of a head-first run: the replay
must be the calls `dpfit train` makes, and its two arms the same numbers."""

from __future__ import annotations

from benchmark_scripts import load_benchmark

from dpfit import accounting
from dpfit.models import save_tiny_random_model, write_tiny_sentiment_csv
from dpfit.train import TrainConfig, train

bench = load_benchmark("accounting_cost")


def test_the_replay_makes_the_calls_a_head_first_run_makes(tmp_path, monkeypatch):
    made: list[tuple[int, str]] = []
    real = accounting.ledger_epsilon

    def spy(records, delta, accountant="rdp", grid=accounting.PLD_DISCRETIZATION, rel="add-remove"):
        made.append((sum(r.count for r in records), rel))
        return real(records, delta, accountant, grid, rel)

    monkeypatch.setattr(accounting, "ledger_epsilon", spy)
    model = str(save_tiny_random_model(tmp_path / "model"))
    data = str(write_tiny_sentiment_csv(tmp_path / "data.csv", n=200))
    res = train(
        TrainConfig(
            model=model, data=data, head_first=True, head_epochs=1, epochs=1, batch_size=30,
            physical_batch_size=8, lr=0.05,
        )
    )  # fmt: skip
    head, main = res.metrics["head_first_steps"], res.metrics["steps"]
    assert head > 0 and main > 0
    assert made == bench.calls(head, main, "add-remove")


def test_both_arms_give_the_same_epsilons(tmp_path):
    out = tmp_path / "cost"
    assert (
        bench.main(["--head-steps", "3", "--steps", "4", "--rounds", "1", "--out", str(out)]) == 0
    )
    assert "same float" in out.with_suffix(".md").read_text()

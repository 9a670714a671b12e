"""The server's trial of clip norms on its public data (``--method public-trial``).

Pseudo-clients of ``PER_CLIENT`` examples are cut from one half of the public validation set
and train as clients train (the engine's own local training); for each candidate C the
trial is start + mean of their updates clipped at C + N(0, (k C)^2), k the run's
accumulated noise per unit clip, scored on the other half (the loss, the mean over ``DRAWS``
noise draws, the same draws for every candidate). Only public data is read, so the trial
costs no privacy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from dpfit.data.bundled import TextExample
from dpfit.federated.clipping import ClipRuleError, clip_update

PER_CLIENT = 10  # examples per pseudo-client
PSEUDO_STREAM = 0x7071  # pseudo-client i's local shuffles: default_rng([seed, this, i])
DRAWS = 8  # noise draws per candidate, averaged
MIN_PSEUDO_CLIENTS = 2

# start, pseudo-clients' data -> their updates (new - start), one list of arrays each
TrainFn = Callable[[Sequence[np.ndarray], list[list[TextExample]]], list[list[np.ndarray]]]
# texts, labels -> (params -> (loss, accuracy)) on them
ScoreFactory = Callable[[Sequence[str], Sequence[int]], Callable[..., tuple[float, float]]]
# start, candidates, noise std per unit clip, rng -> trial loss per candidate
TrialFn = Callable[[Sequence[np.ndarray], Sequence[float], float, np.random.Generator], list[float]]


def split_public(
    texts: Sequence[str], labels: Sequence[int], seed: int, per_client: int = PER_CLIENT
) -> tuple[list[list[TextExample]], list[str], list[int]]:
    """(pseudo-clients, scoring texts, scoring labels): a seeded half of the public rows cut
    into pseudo-clients of ``per_client`` (the remainder dropped), the other half scores."""
    order = np.random.default_rng(seed).permutation(len(texts))
    half = len(texts) // 2
    fit = [TextExample(texts[i], int(labels[i])) for i in order[:half]]
    pseudo = [fit[i : i + per_client] for i in range(0, len(fit) - per_client + 1, per_client)]
    if len(pseudo) < MIN_PSEUDO_CLIENTS:
        raise ClipRuleError(
            f"--method public-trial cuts pseudo-clients of {per_client} examples from half of "
            f"the server's public validation set; {len(texts)} examples give {len(pseudo)}. "
            f"Give at least {2 * per_client * MIN_PSEUDO_CLIENTS} validation examples "
            "(--eval-examples, or a larger --eval-data), or use another --method"
        )
    rest = order[half:]
    return pseudo, [texts[i] for i in rest], [int(labels[i]) for i in rest]


def trial_losses(
    updates: Sequence[Sequence[np.ndarray]],
    start: Sequence[np.ndarray],
    candidates: Sequence[float],
    noise_per_clip: float,
    score: Callable[..., tuple[float, float]],
    rng: np.random.Generator,
    draws: int = DRAWS,
) -> list[float]:
    """Per candidate C: the mean over ``draws`` of the scored loss of start + the mean of
    the updates clipped at C + C k Z_j, Z_j ~ N(0, I), j = 1..draws. The same Z_j serve every
    candidate (common random numbers): the candidates are compared on the same noise, so a
    loss at C does not depend on which other candidates are scored."""
    base = [[rng.standard_normal(np.shape(s)) for s in start] for _ in range(draws)]
    out = []
    for c in candidates:
        clipped = [clip_update(u, c)[0] for u in updates]
        mean = [np.mean([u[i] for u in clipped], axis=0) for i in range(len(start))]
        std = noise_per_clip * c
        losses = []
        for z in base:
            trial = [
                (np.asarray(s, np.float64) + g + std * e).astype(np.asarray(s).dtype)
                for s, g, e in zip(start, mean, z, strict=True)
            ]
            losses.append(float(score(trial)[0]))
        out.append(float(np.mean(losses)))
    return out


def make_trial_fn(
    train: TrainFn, scorer: ScoreFactory, texts: Sequence[str], labels: Sequence[int], seed: int
) -> TrialFn:
    """The server's trial over its public (texts, labels), with the engine's training."""
    pseudo, score_texts, score_labels = split_public(texts, labels, seed)
    score = scorer(score_texts, score_labels)

    def trial(start, candidates, noise_per_clip, rng) -> list[float]:
        updates = train(start, pseudo)
        return trial_losses(updates, start, candidates, noise_per_clip, score, rng)

    return trial


def pseudo_rngs(seed: int, k: int) -> list[np.random.Generator]:
    """Local-shuffle generators of k pseudo-clients: public randomness, as the clients'."""
    return [np.random.default_rng([seed, PSEUDO_STREAM, i]) for i in range(k)]

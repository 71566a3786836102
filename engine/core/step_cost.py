"""How long a step takes, learned from the steps that ran: the prefill budget of a step-time target.

Stall-free batching (Sarathi-Serve): a step that computes a long prompt makes every streaming
chat in the batch wait for it, so with a step-time target the scheduler gives prompts only the
time the step's decodes leave. This model predicts a step's seconds from its shape,

    seconds ≈ c0 + c_decode · decodes + c_token · prompt tokens + c_keys · keys read / 1000,

where "keys read" is the attention work (each new token times the context it attends to). It is
fitted to the steps that computed prompt tokens (those are the steps the budget shapes; steps of
decodes alone run other kernels, compiled graphs on a CPU), by least squares with exponential
forgetting, so it follows the machine as it warms up, loads compiled steps, or gets busier. A
small pull toward the previous fit keeps it defined before the shapes have varied enough to
separate the terms. It is `ready` once it has seen a few steps, some of them with decodes (the
steps the budget shapes); until then the scheduler gives prompts its smallest chunk beside decodes.
"""
from __future__ import annotations

from dataclasses import dataclass

FEATURES = 4
FORGET = 0.97        # weight of a step seen k steps ago: 0.97^k (about the last 30 steps count)
RIDGE = 1e-3         # pull toward the previous coefficients, against drifting where data says nothing
MIN_OBSERVATIONS = 3
MIN_WITH_DECODES = 2  # steps with decodes seen before the decodes' cost is trusted
KEYS_SCALE = 1e-3    # keys read are counted in thousands, so every coefficient has a similar size


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computes: decodes (one new token each), prompt tokens, and attention keys read."""
    num_decodes: int = 0
    num_prefill_tokens: int = 0
    keys_read: int = 0  # sum over sequences of new tokens x context length

    def features(self) -> tuple[float, float, float, float]:
        return 1.0, float(self.num_decodes), float(self.num_prefill_tokens), self.keys_read * KEYS_SCALE


def keys_read(start: int, num_new: int) -> int:
    """Attention work of computing positions start .. start + num_new - 1 (causal: each reads up to itself)."""
    return num_new * start + num_new * (num_new + 1) // 2


class StepCostModel:
    def __init__(self) -> None:
        self._gram = [[0.0] * FEATURES for _ in range(FEATURES)]  # sum of w x x^T
        self._moment = [0.0] * FEATURES                           # sum of w x y
        self.coefficients: tuple[float, ...] | None = None       # seconds per feature; None until fitted
        self.observations = 0
        self.observations_with_decodes = 0

    @property
    def ready(self) -> bool:
        return (self.observations >= MIN_OBSERVATIONS and self.observations_with_decodes >= MIN_WITH_DECODES
                and self.coefficients is not None)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Learn from a step that computed prompt tokens and took `seconds`."""
        if shape.num_prefill_tokens <= 0 or not seconds > 0:
            return
        x = shape.features()
        for i in range(FEATURES):
            row = self._gram[i]
            for j in range(FEATURES):
                row[j] = FORGET * row[j] + x[i] * x[j]
            self._moment[i] = FORGET * self._moment[i] + x[i] * seconds
        self.observations += 1
        self.observations_with_decodes += shape.num_decodes > 0
        self.coefficients = self._solve()

    def predict(self, shape: StepShape) -> float:
        """Seconds the step would take (0 before any fit)."""
        if self.coefficients is None:
            return 0.0
        return sum(c * f for c, f in zip(self.coefficients, shape.features()))

    def prompt_tokens_within(self, seconds: float, start: int) -> int:
        """How many tokens of one prompt, from position `start` on, fit in `seconds` of a step's time."""
        if self.coefficients is None or seconds <= 0:
            return 0
        _, _, per_token, per_key = self.coefficients
        per_key *= KEYS_SCALE
        # Solve per_token·n + per_key·(n·start + n²/2) = seconds for n (the causal keys, rounded up).
        a, b = per_key / 2, per_token + per_key * (start + 0.5)
        if b <= 0:
            return 0
        if a <= 0:
            return int(seconds / b)
        return int((-b + (b * b + 4 * a * seconds) ** 0.5) / (2 * a))

    def _solve(self) -> tuple[float, ...]:
        """Least squares on the forgetting sums, ridge-pulled toward the last fit; coefficients
        are kept non-negative (no term of a step makes it faster)."""
        previous = self.coefficients or (0.0,) * FEATURES
        # Each term's pull in proportion to its own data (features differ by orders of magnitude).
        pull = [RIDGE * self._gram[i][i] + 1e-12 for i in range(FEATURES)]
        gram = [[self._gram[i][j] + (pull[i] if i == j else 0.0) for j in range(FEATURES)]
                for i in range(FEATURES)]
        moment = [self._moment[i] + pull[i] * previous[i] for i in range(FEATURES)]
        solution = _solve_linear(gram, moment)
        if solution is None:
            return tuple(previous)
        return tuple(max(value, 0.0) for value in solution)


def _solve_linear(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on a small dense system; None if singular."""
    n = len(vector)
    rows = [list(matrix[i]) + [vector[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) < 1e-18:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            if factor:
                for c in range(col, n + 1):
                    rows[r][c] -= factor * rows[col][c]
    solution = [0.0] * n
    for r in range(n - 1, -1, -1):
        solution[r] = (rows[r][n] - sum(rows[r][c] * solution[c] for c in range(r + 1, n))) / rows[r][r]
    return solution

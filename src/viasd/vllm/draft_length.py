"""How many tokens to draft per request at a given batch size, from costs measured while serving.

A step of the target verifies every request's drafts in one pass, so its time grows with the tokens it carries:
measured as `seconds = fixed + per_token * tokens`, a least-squares line through the recent mean time of each
step size seen (a size keeps its mean however long the rule then stays at another size, so the fit never
forgets what made it choose). A draft token costs the
drafter's measured time per token, and is kept with the measured acceptance rate `alpha` of a position (kept
drafts stop at the first rejected one, so k drafts keep alpha + ... + alpha^k on average). The rule picks the k that
commits the most tokens per second for the batch; as the batch grows, verifying drafts costs more of the step and
k falls, down to 0 (no speculation) when drafts do not pay.
"""

from __future__ import annotations

from dataclasses import dataclass

RECENT = 0.2  # weight of a new step in its size's running mean time
MIN_STEPS = 8  # steps before the fit is trusted (until then: the most drafts allowed, and half as many)


def expected_kept(alpha: float, k: int) -> float:
    """Mean drafts kept of k, when each position is kept with probability alpha until the first rejection."""
    return sum(alpha**j for j in range(1, k + 1))


def best_length(
    batch: int, alpha: float, fixed: float, per_token: float, draft_seconds: float, most: int
) -> tuple[int, float]:
    """The draft length 0..most with the most committed tokens per second for `batch` requests, and that rate."""
    best, rate = 0, 0.0
    for k in range(most + 1):
        seconds = fixed + per_token * batch * (k + 1) + draft_seconds * batch * k
        tokens = batch * (1.0 + expected_kept(alpha, k))
        if seconds > 0 and tokens / seconds > rate * (1 + 1e-9):
            best, rate = k, tokens / seconds
    return best, rate


@dataclass
class Tally:
    """Counts of one kind of event for the rate estimates."""

    kept: int = 0
    tried: int = 0


class DraftLength:
    """The measured costs and acceptance, and the draft length they call for."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.sizes: dict[int, float] = {}  # tokens a target step carried -> running mean of its seconds
        self.steps = 0
        self.positions = Tally()  # draft positions the target judged, and how many it kept
        self.draft_seconds = 0.0  # drafter time, all model drafts together
        self.drafted = 0  # model-drafted tokens

    def observe_step(self, tokens: int, seconds: float) -> None:
        known = self.sizes.get(tokens)
        self.sizes[tokens] = seconds if known is None else known + RECENT * (seconds - known)
        self.steps += 1

    def observe_drafts(self, drafted: int, kept: int) -> None:
        """One request's drafts of the last step: `kept` of `drafted` were kept."""
        if drafted:
            self.positions.kept += kept
            self.positions.tried += kept + (1 if kept < drafted else 0)

    def observe_drafter(self, tokens: int, seconds: float) -> None:
        self.drafted += tokens
        self.draft_seconds += seconds

    @property
    def alpha(self) -> float:
        """The rate at which the target keeps a draft position (0.5 before any is judged)."""
        return self.positions.kept / self.positions.tried if self.positions.tried else 0.5

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) of a target step, or None while too few steps, or steps of one size
        only, are known."""
        if self.steps < MIN_STEPS or len(self.sizes) < 2:
            return None
        points = list(self.sizes.items())
        n = len(points)
        mean_x = sum(x for x, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        spread = sum((x - mean_x) ** 2 for x, _ in points)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
        return max(mean_y - slope * mean_x, 0.0), max(slope, 0.0)

    def length(self, batch: int) -> int:
        """Drafts per request for a step of `batch` requests."""
        fitted = self.fit()
        if fitted is None:
            # Exploring: vary the length so the fit sees steps of different sizes.
            return self.most if self.steps % 2 == 0 else max(self.most // 2, 1)
        per_draft = self.draft_seconds / self.drafted if self.drafted else 0.0
        return best_length(batch, self.alpha, *fitted, per_draft, self.most)[0]

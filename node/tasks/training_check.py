"""Did an update train on its producer's data? Its own-data gain (Gauntlet-style): what decides by it. The
measures are node/train/check.py's (tiny-lm) and node/train/recipes.py ``gain``'s (hf), run in the trainer child.

An honest producer's update lowers the loss on the batches it trained on: applied to the round's weights
θ_r, it gives back the local model that saw them. A replayed (stale) update, a copy of another producer's
or one made up without training has no such reason: it moves θ_r to weights those batches never shaped,
and measured, it raises their loss. The batches are the producer's own, rebuilt from the rendezvous
assignment and its seed (node.train.data.derive_seed), so nobody can pick easier ones.

    gain = loss(θ_r, B) − loss(θ_r − Δ̂, B)     B: the first CHECK_BATCHES batches its inner steps drew

Δ̂ is the update as its slices decode (what aggregation would use), so compression is inside the figure.
An update with a gain below UNTRAINED_GAIN did not train from θ_r on its batches: no honest update came
within the margin measured by scripts/screen_margins.py (docs/bench/screen-margins.json). Floats differ
between machines by far less than TOLERANCE, which a checker allows on either side of the threshold.
"""

from __future__ import annotations

from node.train.check import CHECK_BATCHES, COPY_BATCHES, own_advantage, own_batches, own_gain

__all__ = ["CHECK_BATCHES", "COPY_BATCHES", "own_advantage", "own_batches", "own_gain"]

CHECK_MIN_STEPS = 12
"""Updates of fewer inner steps are not judged: a first step's momentum (carried from the last round) can move
away from its batch, and from scratch a few honest updates of 1, 2 and 8 steps raised their own batches' loss
(scripts/screen_margins.py); none of 12 steps or more did."""
CHECK_MAX_STEPS = 50
"""Nor are updates of more: the margin below was measured up to 50 steps (scripts/screen_margins.py). Past it the
premise can fail for honest producers: in the netlab partition test (a 6 s time budget, hundreds of steps at AdamW
lr 3e-3, the held-out loss swinging between rounds) honest updates raised their first batches' loss by up to 1.2
nats, and two honest nodes were banned."""
STRIKE_ROUNDS = 4
"""A producer found in two rounds less than this many apart is banned: an untrained producer is found round
after round; an honest update that misfired once (never seen at 12 steps or more) costs one charge."""
UNTRAINED_GAIN = -0.05
"""Nats per byte: an update whose gain on its own batches is below this did not train on them from θ_r."""
UNTRAINED_GAIN_HF = {"lora": -0.3, "full": -0.1}
"""Nats per token, by hf.method, for hf-causal-lm updates (their gain is measured by the trainer child,
node/train/recipes.py ``gain``). Measured on a tiny Llama (scripts/hf_check_margins.py,
docs/bench/hf-check-margins.json): honest LoRA updates at the demo's high inner learning rate came within -0.08
of 0 once training flattened, while LoRA updates sent again from an earlier round or made up at an honest
update's norm mostly fell to -0.3 .. -17; honest full fine-tuning never went below +0.004, and its cheats fell
less far (-0.03 .. -0.66; a stale full update still helps a fine-tune for a while). On that homogeneous data a copy
of another producer's update fits one's batches as well as one's own: hf updates are judged untrained or not,
never as copies."""
COPY_MARGIN = 0.02
"""Nats: of two producers the screen found to send near copies of one update, the one whose batches it fits
worse by this much (own_advantage below −COPY_MARGIN) sent the copy. An honest update fits its own batches
better: its least advantage measured is in docs/bench/screen-margins.json (min_own_advantage)."""
TOLERANCE = 0.005
"""What a checker allows around UNTRAINED_GAIN: a proof needs the accuser's gain below the threshold minus
this, and a confirmer's below the threshold plus this (for a copy, the margin likewise), so no float difference
between honest machines turns an accusation into a false one or back."""


def banned_at(rounds: list[int]) -> bool:
    """Whether findings in these rounds (the last one just made) ban their producer."""
    return sum(1 for r in rounds if r > rounds[-1] - STRIKE_ROUNDS) >= 2


def judged(steps: int) -> bool:
    """Whether an update of ``steps`` inner steps is judged at all: within the steps its margin was measured at."""
    return CHECK_MIN_STEPS <= steps <= CHECK_MAX_STEPS


def copied(advantage: float) -> bool:
    """Whether an update with this own_advantage over a near copy's producer is the copy: it fits the other's
    batches better, beyond the batches' own difference, by more than COPY_MARGIN (and the tolerance)."""
    return advantage < -COPY_MARGIN - TOLERANCE


def confirms_copy(advantage: float) -> bool:
    return advantage < -COPY_MARGIN + TOLERANCE


def untrained(gain: float, threshold: float = UNTRAINED_GAIN) -> bool:
    """What a producer's own check decides: below the threshold by more than the tolerance (an accusation)."""
    return gain < threshold - TOLERANCE


def confirms(gain: float, threshold: float = UNTRAINED_GAIN) -> bool:
    """Whether a checker's own gain backs an accusation: below the threshold within the tolerance."""
    return gain < threshold + TOLERANCE

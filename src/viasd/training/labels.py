"""What a chain head's training aims its cross-entropy at (no heavy imports: the command checks it at the edge).

`tokens`: the token the target wrote. `distribution`: the target's own distribution over the head's vocabulary at
that position, read from its recorded feature through the output rows the head shares (EAGLE's classification
loss); positions without a recorded feature keep their written token.
"""

LABELS = ("tokens", "distribution")

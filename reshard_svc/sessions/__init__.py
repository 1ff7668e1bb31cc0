"""Long-lived objects over the verbs: a training loop's :class:`CheckpointManager` and an RL
loop's :class:`WeightSync`. They hold state across calls (steps, leases, versions, what a
sender last sent), run the verbs of :mod:`reshard_svc.runtime` and reach storage only through
its protocols; nothing below imports them."""

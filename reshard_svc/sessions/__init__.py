"""Long-lived objects over the verbs: a training loop's :class:`CheckpointManager` (in
``manager``, composing its persistent tier in ``persistent`` and its fast tier of node
memory and peer copies in ``fast`` and ``fast_restore``; the steps as ``reshard steps``
lists them in ``steps``) and an RL
loop's :class:`WeightSync` (the ``sync`` package: session, records, journal, landing, codec, costs). They hold state
across calls (steps, leases, versions, what a sender last sent), run the verbs of
:mod:`reshard_svc.runtime` and reach storage through its protocols; nothing below imports
them."""

"""Live weight sync (:class:`WeightSync`): versioned pushes that send only what changed.

One idea a file: the session and its three-step protocol (``session.py``); what it knows
across pushes and what a push's ranks agreed (``records.py``); the undo journal and its
pool of buffers (``journal.py``); a push's destination on this rank (``landing.py``); how
a piece is sent, whole or as a delta, and received (``codec.py``); the cost model that
picks raw or delta (``costs.py``).
"""

from reshard_svc.sessions.sync.session import SyncResult, WeightSync

__all__ = ["SyncResult", "WeightSync"]

"""The trainer's side of a push, mirroring ``receive/`` on the worker's: ``pusher`` (``Pusher``,
the front that runs a push round by round), ``senders`` (several senders at once: each rank's
lane, the agreement before any byte and the verdict after), and the parts behind them --
``routes`` (how each member is reached, pure), ``formation`` (forming the sync group over them),
``roster`` (the members, what each holds, and who is to blame when a round fails), ``sender``
(planning a push and broadcasting its buckets), ``wire`` (dense or a delta: the push's one seam
with ``weight_sync.delta``) and ``sharded`` (sources gathered from the ranks of a sharded
trainer). What a state dict may hold is checked below them all, in ``wire.state_dict``.
"""

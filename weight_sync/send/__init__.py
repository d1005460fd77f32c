"""The parts behind the trainer's ``Pusher`` (``weight_sync.send.pusher``, the front that runs a push
round by round), mirroring ``receive/`` on the worker's side: ``checks`` (what a state dict may
hold, before any byte moves), ``routes`` (how each member is reached, pure), ``formation``
(forming the sync group over them), ``roster`` (the members, what each holds, and who is to
blame when a round fails), ``sender`` (planning a push and broadcasting its buckets), ``wire``
(dense or a delta: the push's one seam with ``weight_sync.delta``) and ``sharded`` (sources
gathered from the ranks of a sharded trainer).
"""

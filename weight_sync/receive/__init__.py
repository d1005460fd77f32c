"""The worker's side of a push: ``receiver`` (``Receiver``, the front that validates a push,
routes it and owns the transport), ``inbound`` (several senders at once: a lane per sender,
followed together), and the parts behind them -- ``checks`` (what a worker can load of a plan,
pure), ``state`` (the receive state machine: a push's phases and the versions a worker holds),
``buckets`` (buckets in: from the transport into the model, or through the staging area) and
``assembly`` (each lane's blocks placed in the model, or put together for a loader).
"""

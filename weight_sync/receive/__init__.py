"""The parts behind a worker's ``Receiver`` (``weight_sync.receive.receiver``, the front that validates
a push, routes it and owns the transport): ``checks`` (what a worker can load of a plan, pure),
``state`` (the receive state machine: a push's phases and the versions a worker holds) and
``buckets`` (buckets in: from the transport into the model, or through the staging area).
"""

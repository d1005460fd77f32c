"""Control planes: how the trainer reaches the members of a push -- the seam beside
``transport.Transport``. The plane's verbs (``plane``), the store plane for ranks without Ray
(``store``; several senders' commands and verdicts: ``lane_store``), inference servers over HTTP
(``http``), and the bounded waits every plane shares (``futures``, ``deadline``)."""

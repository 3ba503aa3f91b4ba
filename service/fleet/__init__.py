"""A node and its central service: the profiles a node follows from the central one
(``central``) and the outbox that feeds it (``publisher``)."""

"""Start-up in one place: Settings to a loaded model, its engine and its app.

``start.build`` dispatches to the chat (``chat``), embedding (``embedding``), several-models
(``several``) and sharded (``sharded``, ``ranks``) start-ups; ``app`` is the one app factory
with its one plumbing stack. Only the command line imports this package."""

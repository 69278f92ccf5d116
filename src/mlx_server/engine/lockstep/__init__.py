"""Several ranks running one engine in lockstep (``mlx.launch``; see ``leader.py``)."""

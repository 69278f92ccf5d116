"""Runners behind the ``Runner`` protocol: lone, batch, vision."""

"""The engine's core: the owner thread and its loop, the scheduler, delivery, handles, faults."""

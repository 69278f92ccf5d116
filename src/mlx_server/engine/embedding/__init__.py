"""The embedding engine and its encoder runner."""

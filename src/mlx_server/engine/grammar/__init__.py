"""Grammar-constrained decoding: llguidance matchers, token masks, the logits processor."""

"""Speculative decoding: n-gram drafts, verified by the target model in one forward."""

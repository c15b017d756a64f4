"""Attention backends over the paged KV cache (abstract.py: the interface;
selector.py: choosing one). Nothing is imported here: config.py checks a
backend's name through selector.py in engines that never load torch."""

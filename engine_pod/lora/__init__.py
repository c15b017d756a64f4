"""LoRA adapters (PEFT layout) applied on top of the base model's projections.

``config.py`` holds how many adapters an engine serves at once,
``adapter.py`` reads and checks an adapter folder and its low-rank factors,
``punica.py`` adds the low-rank products of a batch that mixes adapters (a
per-token slot index; torch on CPU, ``triton_ops.py`` on GPU), ``layers.py``
attaches the slots to the model's projections.
"""

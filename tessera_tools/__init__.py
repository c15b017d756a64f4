"""Tessera's tools, the top layer: the `tessera` command (`cli`), `tessera up` (`up`),
`make-model` and the shared test cases (`fixtures`), and the benchmarks (`bench`).

They import every layer below (the base `tessera`, `kv_store`, `engine_pod`, `gateway`,
`tessera_operator`); nothing below imports them (docs/architecture.md, "Layers").
"""

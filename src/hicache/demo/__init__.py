"""The demo: a small hybrid model served through hicache (an embedding framework in miniature).

Imports torch: the command line imports this package lazily, inside ``hicache demo``.

- model: the hybrid causal LM (full attention + indexer, sliding window, Gated DeltaNet).
- framework: demo_plan and DemoServer (page tables, prefill, backup, layer-wise restore).
- harness: recompute versus cached runs, compared logit by logit and token by token.
- workload: the multi-turn workload of ``hicache demo`` and its figures.
"""
